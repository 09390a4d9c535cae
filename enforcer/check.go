package enforcer

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
)

// check is the forward-auth API for ingress controllers and gateways: it decides the original
// request that the headers describe and answers as the proxy would (200, 429 or 503 with the
// same fields), forwarding nothing. Each endpoint reads the original method and URI from the one
// source its caller sets, and nothing else, since both callers pass the client's own headers on:
//
//   - AuthRequestPath, for nginx's auth_request (ingress-nginx's auth-url): X-Original-Method and
//     X-Original-URL, which nginx sets over the client's;
//   - ForwardAuthPath, for Traefik's ForwardAuth: X-Forwarded-Method and X-Forwarded-Uri, which
//     Traefik sets over the client's.
//
// A field that is missing, repeated or does not parse is 400. The client address is the
// caller's X-Forwarded-For when the caller is in trustedProxies.
//
// A caller sends one small bodiless HTTP/1.1 request per client request and needs nothing of
// HTTP/2, upgrades or streaming, so the check API is served by fasthttp, which spends a fraction
// of net/http's CPU per request (docs/benchmarks.md). A leaky-bucket request's answer is held
// for its wait, and released at once if the caller closes the connection meanwhile (holdConn).
//
// Every endpoint is also served under PoliciesPath for one policy by name:
// /policies/<namespace>/<name>/auth-request and /policies/<namespace>/<name>/forward-auth decide
// against that policy's rules alone. A pool's replica (pool) serves only these: its policies are
// many, and a request that named none would be decided against all of them. A policy the
// enforcer does not serve is refused with 404, naming it, never decided against no rules.
type check struct {
	limiter *limiter.Limiter
	pool    bool
}

// The check API's endpoints.
const (
	// AuthRequestPath is nginx's: a refusal is answered 403 and a fail-closed rule's store
	// failure 401, the only refusals auth_request passes on (the nginx configuration in
	// docs/enforcer.md restores 429 and 503 with error_page).
	AuthRequestPath = "/auth-request"
	// ForwardAuthPath is Traefik's, answered 429 and 503 as the proxy does.
	ForwardAuthPath = "/forward-auth"
)

// endpoint is where one caller of the check API describes the original request.
type endpoint struct {
	method, uri string
	// refused maps a refusal's status to what the caller passes on.
	refused func(status int) int
}

var endpoints = map[string]endpoint{
	AuthRequestPath: {"X-Original-Method", "X-Original-Url", func(status int) int {
		switch status {
		case http.StatusTooManyRequests:
			return http.StatusForbidden
		case http.StatusServiceUnavailable:
			return http.StatusUnauthorized
		}
		return status
	}},
	ForwardAuthPath: {"X-Forwarded-Method", "X-Forwarded-Uri", func(status int) int { return status }},
}

// PoliciesPath begins the check API's paths of one policy: PoliciesPath + "<namespace>/<name>"
// followed by AuthRequestPath or ForwardAuthPath.
const PoliciesPath = "/policies/"

const unknownEndpoint = "the check API answers on " + AuthRequestPath + " (nginx auth_request: X-Original-Method, X-Original-URL) and " +
	ForwardAuthPath + " (Traefik ForwardAuth: X-Forwarded-Method, X-Forwarded-Uri), for one policy under " + PoliciesPath + "<namespace>/<name>"

const poolEndpoint = "a pool's check API decides for one policy at a time: " + PoliciesPath + "<namespace>/<name>" + ForwardAuthPath +
	" (Traefik ForwardAuth) or " + PoliciesPath + "<namespace>/<name>" + AuthRequestPath + " (nginx auth_request)"

// route finds the endpoint of a path and the policy it names, or the 404 that answers it.
func (c *check) route(path string) (ep endpoint, id, notFound string) {
	rest, named := strings.CutPrefix(path, PoliciesPath)
	if !named {
		ep, ok := endpoints[path]
		switch {
		case !ok:
			return ep, "", unknownEndpoint
		case c.pool:
			return ep, "", poolEndpoint
		}
		return ep, "", ""
	}
	// <namespace>/<name>/<endpoint>, cut without allocating: the endpoint keeps its slash.
	ns, rest, _ := strings.Cut(rest, "/")
	name, rest, _ := strings.Cut(rest, "/")
	last := len(path) - len(rest) - 1
	if ns == "" || name == "" || last < 0 || path[last] != '/' || strings.Contains(rest, "/") {
		return ep, "", unknownEndpoint
	}
	ep, ok := endpoints[path[last:]]
	if !ok {
		return ep, "", unknownEndpoint
	}
	id = ns + "/" + name
	if c.limiter.Policy(id) == nil {
		return ep, id, limiter.NotServed(id)
	}
	return ep, id, ""
}

func (c *check) serve(ctx *fasthttp.RequestCtx) {
	// Routed on the path as sent: fasthttp's Path is decoded and normalized, which would decide
	// /policies/a%2Fb/forward-auth or /policies/x/../a/b/forward-auth for policy a/b, where
	// neither names it.
	ep, id, notFound := c.route(b2s(ctx.URI().PathOriginal()))
	resp := &ctx.Response.Header
	if notFound != "" {
		ctx.SetStatusCode(http.StatusNotFound)
		ctx.SetBody(malformed(resp.Set, http.StatusNotFound, notFound))
		return
	}
	header := fastHeader{&ctx.Request.Header}
	method, err1 := header.one(ep.method)
	uri, err2 := header.one(ep.uri)
	var v verdict
	if err := errors.Join(err1, err2); err != nil {
		v = invalid(http.StatusBadRequest, strings.ReplaceAll(err.Error(), "\n", "; ")+"; "+unknownEndpoint)
	} else {
		v = decide(c.limiter, &input{method: method, target: uri, header: header, peer: remoteAddr(ctx), policy: id})
	}
	body := v.write(resp.Set)
	if v.status != http.StatusOK {
		ctx.SetStatusCode(ep.refused(v.status))
		ctx.SetBody(body)
		return
	}
	if !holdConn(ctx.Conn(), v.Wait) {
		c.limiter.Left()
		abandon(ctx) // the caller gave up; one that only half-closed must not read an early 200
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

// one returns the value of a field that must be sent once, and not empty.
func (f fastHeader) one(name string) (string, error) {
	switch values := f.h.PeekAll(name); {
	case len(values) == 0 || len(values[0]) == 0:
		return "", fmt.Errorf("header %s is missing", name)
	case len(values) > 1:
		return "", fmt.Errorf("header %s is sent more than once", name)
	default:
		return b2s(values[0]), nil
	}
}

func remoteAddr(ctx *fasthttp.RequestCtx) netip.Addr {
	if a, ok := ctx.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// newCheckServer serves the check API with the proxy's limits against slow and oversized
// clients: readTimeout to read a request, idleTimeout between requests, 64 KiB of header.
func newCheckServer(h fasthttp.RequestHandler, log logr.Logger, readTimeout, idleTimeout time.Duration) *fasthttp.Server {
	return &fasthttp.Server{
		Handler:               h,
		ReadTimeout:           readTimeout,
		IdleTimeout:           idleTimeout,
		ReduceMemoryUsage:     true,           // an idle connection holds no 64 KiB buffers
		ReadBufferSize:        MaxHeaderBytes, // fasthttp's header size limit
		MaxRequestBodySize:    64 << 10,       // ingresses send none
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
