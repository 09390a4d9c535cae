// Package check is the check API: forward-auth for ingress controllers and gateways.
package check

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/conns"
	"github.com/sluice-dev/sluice/enforcer/internal/fastserve"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/seam"
)

// API is the forward-auth API for ingress controllers and gateways: it decides the original
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
// for its wait, and released at once if the caller closes the connection meanwhile (conns.Hold).
//
// Every endpoint is also served under PoliciesPath for one policy by name:
// /policies/<namespace>/<name>/auth-request and /policies/<namespace>/<name>/forward-auth decide
// against that policy's rules alone. A pool's replica (Pool) serves only these: its policies are
// many, and a request that named none would be decided against all of them. A policy the
// enforcer does not serve is refused with 404, naming it, never decided against no rules.
type API struct {
	Limiter *limiter.Limiter
	Pool    bool
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
func (c *API) route(path string) (ep endpoint, id, notFound string) {
	rest, named := strings.CutPrefix(path, PoliciesPath)
	if !named {
		ep, ok := endpoints[path]
		switch {
		case !ok:
			return ep, "", unknownEndpoint
		case c.Pool:
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
	if c.Limiter.Policy(id) == nil {
		return ep, id, limiter.NotServed(id)
	}
	return ep, id, ""
}

// Serve answers one call of the check API.
func (c *API) Serve(ctx *fasthttp.RequestCtx) {
	// Routed on the path as sent: fasthttp's Path is decoded and normalized, which would decide
	// /policies/a%2Fb/forward-auth or /policies/x/../a/b/forward-auth for policy a/b, where
	// neither names it.
	ep, id, notFound := c.route(fastserve.B2S(ctx.URI().PathOriginal()))
	resp := &ctx.Response.Header
	if notFound != "" {
		ctx.SetStatusCode(http.StatusNotFound)
		ctx.SetBody(seam.Malformed(resp.Set, http.StatusNotFound, notFound))
		return
	}
	h := &ctx.Request.Header
	method, err1 := one(h, ep.method)
	uri, err2 := one(h, ep.uri)
	var v seam.Verdict
	if err := errors.Join(err1, err2); err != nil {
		v = seam.Invalid(http.StatusBadRequest, strings.ReplaceAll(err.Error(), "\n", "; ")+"; "+unknownEndpoint)
	} else {
		v = seam.Decide(c.Limiter, &seam.Input{Method: method, Target: uri, Header: fastserve.Header{H: h}, Peer: fastserve.Peer(ctx), Policy: id})
	}
	body := v.Write(resp.Set)
	if v.Status != http.StatusOK {
		ctx.SetStatusCode(ep.refused(v.Status))
		ctx.SetBody(body)
		return
	}
	if !conns.Hold(ctx.Conn(), v.Wait) {
		c.Limiter.Left()
		fastserve.Abandon(ctx) // the caller gave up; one that only half-closed must not read an early 200
	}
}

// one returns the value of a field that must be sent once, and not empty.
func one(h *fasthttp.RequestHeader, name string) (string, error) {
	switch values := h.PeekAll(name); {
	case len(values) == 0 || len(values[0]) == 0:
		return "", fmt.Errorf("header %s is missing", name)
	case len(values) > 1:
		return "", fmt.Errorf("header %s is sent more than once", name)
	default:
		return fastserve.B2S(values[0]), nil
	}
}

// NewServer serves the check API with the proxy's limits against slow and oversized clients:
// readTimeout to read a request, idleTimeout between requests, 64 KiB of header.
func NewServer(h fasthttp.RequestHandler, log logr.Logger, readTimeout, idleTimeout time.Duration) *fasthttp.Server {
	return &fasthttp.Server{
		Handler:               h,
		ReadTimeout:           readTimeout,
		IdleTimeout:           idleTimeout,
		ReduceMemoryUsage:     true,                // an idle connection holds no 64 KiB buffers
		ReadBufferSize:        seam.MaxHeaderBytes, // fasthttp's header size limit
		MaxRequestBodySize:    64 << 10,            // ingresses send none
		NoDefaultServerHeader: true,
		Logger:                fastserve.Logger{Log: log, Server: "check"},
		ErrorHandler:          fastserve.RefuseMalformed,
	}
}
