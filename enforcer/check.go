package enforcer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
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
// of net/http's CPU per request (docs/benchmarks.md). A leaky-bucket request's answer is held
// for its wait, and released at once if the ingress closes the connection meanwhile (holdConn).
type check struct {
	limiter *limiter.Limiter
}

// AuthRequestPath is the check API's path for nginx's auth_request (ingress-nginx's auth-url):
// there a refusal is answered 403, and a fail-closed rule's store failure 401, the only refusals
// auth_request passes on; on every other path they are 429 and 503.
const AuthRequestPath = "/auth-request"

const missingOriginal = "the check API needs the original method and URI in X-Original-Method and X-Original-URL, or X-Forwarded-Method and X-Forwarded-Uri"

func (c *check) serve(ctx *fasthttp.RequestCtx) {
	header := fastHeader{&ctx.Request.Header}
	method := header.first("X-Original-Method", "X-Forwarded-Method")
	uri := header.first("X-Original-Url", "X-Forwarded-Uri")
	if method == "" || uri == "" {
		ctx.Error(missingOriginal, http.StatusBadRequest)
		return
	}
	// Decoded, and with dot segments resolved, as the proxy decides and the upstream reads it.
	var u fasthttp.URI
	path := uri
	// A URI without a scheme is a request target: "//admin" is a path, not an authority.
	if err := u.Parse([]byte("original"), []byte(uri)); err == nil {
		path = string(u.Path())
	}
	// Not ctx: fasthttp cancels every request's context when the server shuts down, and a
	// decision in flight then must still be made, not failed over. The store's own deadline
	// bounds it.
	res := c.limiter.Decide(context.Background(), &limiter.Request{Method: strings.ToUpper(method), Path: path, Header: header, Peer: remoteAddr(ctx)})
	resp := &ctx.Response.Header
	setRateLimitHeaders(resp.Set, &res)
	if res.Outcome != limiter.Allowed {
		status, body := refusal(resp.Set, &res)
		if string(ctx.Path()) == AuthRequestPath {
			// nginx's auth_request passes on 2xx, 401 and 403 only, and turns any other status
			// into a 500: a refusal is 403, a fail-closed rule's 503 is 401, and the nginx
			// configuration restores 429 and 503 with error_page (docs/enforcer.md).
			status = http.StatusForbidden
			if res.Outcome == limiter.Unavailable {
				status = http.StatusUnauthorized
			}
		}
		ctx.SetStatusCode(status)
		ctx.SetBody(body)
		return
	}
	if !holdConn(ctx.Conn(), res.Wait) {
		ctx.SetConnectionClose() // the ingress gave up: nobody reads the answer
	}
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
// clients: readTimeout to read a request, 120 s idle, 64 KiB of header.
func newCheckServer(c *check, log logr.Logger, readTimeout time.Duration) *fasthttp.Server {
	return &fasthttp.Server{
		Handler:               c.serve,
		ReadTimeout:           readTimeout,
		IdleTimeout:           120 * time.Second,
		ReadBufferSize:        64 << 10, // fasthttp's header size limit
		MaxRequestBodySize:    64 << 10, // ingresses send none
		NoDefaultServerHeader: true,
		Logger:                fastLogger{log},
		ErrorHandler:          refuseMalformed,
	}
}

// refuseMalformed answers a request the check API or the proxy could not read with the status
// that says why.
func refuseMalformed(ctx *fasthttp.RequestCtx, err error) {
	var small *fasthttp.ErrSmallBuffer
	var netErr net.Error
	switch {
	case errors.As(err, &small):
		ctx.Error("request header over 64 KiB", http.StatusRequestHeaderFieldsTooLarge)
	case errors.Is(err, fasthttp.ErrBodyTooLarge): // the check API's only: the proxy streams bodies
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
