package enforcer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/limiter"
)

// check is the forward-auth API for ingress controllers (ingress-nginx auth-url, Traefik
// ForwardAuth): it decides the original request described by the headers and answers 200, 429
// or 503 with the same headers as the proxy, forwarding nothing. The original method and URI come
// from X-Original-Method and X-Original-URL (ingress-nginx) or X-Forwarded-Method and
// X-Forwarded-Uri (Traefik). The client address is the ingress's X-Forwarded-For when the ingress
// is in trustedProxies.
//
// An ingress sends one small bodiless HTTP/1.1 request per client request and needs nothing of
// HTTP/2, upgrades or streaming, so the check API is served by fasthttp, which spends a fraction
// of net/http's CPU per request (docs/benchmarks.md). One consequence: fasthttp does not tell a
// handler that its client left, so a leaky-bucket request is held for its whole wait even when
// the ingress gave up. Its place in the queue was taken when it was decided, so releasing it
// early would free only the goroutine; the wait is bounded by the rule's maxWait.
type check struct {
	limiter *limiter.Limiter
}

const missingOriginal = "the check API needs the original method and URI in X-Original-Method and X-Original-URL, or X-Forwarded-Method and X-Forwarded-Uri"

func (c *check) serve(ctx *fasthttp.RequestCtx) {
	header := fastHeader{&ctx.Request.Header}
	method := header.first("X-Original-Method", "X-Forwarded-Method")
	uri := header.first("X-Original-Url", "X-Forwarded-Uri")
	if method == "" || uri == "" {
		ctx.Error(missingOriginal, http.StatusBadRequest)
		return
	}
	path := uri
	if u, err := url.Parse(uri); err == nil {
		path = u.Path
	}
	// Not ctx: fasthttp cancels every request's context when the server shuts down, and a
	// decision in flight then must still be made, not failed over. The store's own deadline
	// bounds it.
	res := c.limiter.Decide(context.Background(), &limiter.Request{Method: strings.ToUpper(method), Path: path, Header: header, Peer: remoteAddr(ctx)})
	resp := &ctx.Response.Header
	setRateLimitHeaders(resp.Set, &res)
	if res.Outcome != limiter.Allowed {
		status, body := refusal(resp.Set, &res)
		ctx.SetStatusCode(status)
		ctx.SetBody(body)
		return
	}
	time.Sleep(res.Wait)
}

// fastHeader reads fasthttp's request header as a policy.Header (enforcer/policy).
type fastHeader struct{ h *fasthttp.RequestHeader }

func (f fastHeader) Values(name string) []string {
	var values []string
	for _, v := range f.h.PeekAll(name) {
		values = append(values, string(v))
	}
	return values
}

// first returns the first value of the first of the fields that has a non-empty one.
func (f fastHeader) first(names ...string) string {
	for _, n := range names {
		if v := f.h.Peek(n); len(v) > 0 {
			return string(v)
		}
	}
	return ""
}

func remoteAddr(ctx *fasthttp.RequestCtx) netip.Addr {
	if a, ok := ctx.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// newCheckServer serves the check API with the proxy's limits against slow and oversized
// clients: 10 s to read a request, 120 s idle, 64 KiB of header.
func newCheckServer(c *check, log logr.Logger) *fasthttp.Server {
	return &fasthttp.Server{
		Handler:               c.serve,
		ReadTimeout:           10 * time.Second,
		IdleTimeout:           120 * time.Second,
		ReadBufferSize:        64 << 10, // fasthttp's header size limit
		MaxRequestBodySize:    64 << 10, // ingresses send none
		NoDefaultServerHeader: true,
		Logger:                fastLogger{log},
		ErrorHandler:          refuseMalformed,
	}
}

// refuseMalformed answers a request the server could not read with the status that says why.
func refuseMalformed(ctx *fasthttp.RequestCtx, err error) {
	var small *fasthttp.ErrSmallBuffer
	var netErr net.Error
	switch {
	case errors.As(err, &small):
		ctx.Error("request header over 64 KiB", http.StatusRequestHeaderFieldsTooLarge)
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		ctx.Error("request body over 64 KiB: the check API needs none", http.StatusRequestEntityTooLarge)
	case errors.As(err, &netErr) && netErr.Timeout():
		ctx.Error("request not read in time", http.StatusRequestTimeout)
	default:
		ctx.Error("malformed request", http.StatusBadRequest)
	}
}

// fastLogger sends fasthttp's connection errors to the structured log, at debug level: they are
// clients' faults (timeouts, malformed requests), one per bad connection.
type fastLogger struct{ log logr.Logger }

func (l fastLogger) Printf(format string, args ...any) {
	l.log.V(1).Info("Check API connection error", "error", fmt.Sprintf(format, args...))
}
