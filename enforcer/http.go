package enforcer

import (
	"encoding/json"
	"math"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dunglas/httpsfv"

	"github.com/sluice-dev/sluice/enforcer/algorithm"
	"github.com/sluice-dev/sluice/enforcer/limiter"
	"github.com/sluice-dev/sluice/enforcer/policy"
)

// seconds rounds a duration up to whole seconds: a client that waits them is never early.
func seconds(d time.Duration) int64 { return int64(math.Ceil(d.Seconds())) }

// window is the time the rule's quota refers to: the window, or the time an empty bucket takes
// to fill.
func window(r *policy.Rule) time.Duration {
	switch r.Limit.Kind {
	case algorithm.TokenBucket, algorithm.LeakyBucket:
		return time.Duration(float64(r.Limit.Period) * float64(r.Limit.Limit) / float64(r.Limit.Rate))
	}
	return r.Limit.Period
}

// setRateLimitHeaders writes the RateLimit-Policy and RateLimit fields of
// draft-ietf-httpapi-ratelimit-headers, as structured-field lists, for the rule the result
// describes:
//
//	RateLimit-Policy: "burst";q=10;w=1
//	RateLimit: "burst";r=0;t=1
func setRateLimitHeaders(h http.Header, res *limiter.Result) {
	if res.Rule == nil || res.Decision.Limit == 0 {
		return
	}
	p := httpsfv.NewItem(res.Rule.Name)
	p.Params.Add("q", res.Decision.Limit)
	p.Params.Add("w", max(1, seconds(window(res.Rule))))
	policyField, err := httpsfv.Marshal(httpsfv.List{p})
	if err != nil {
		return
	}
	l := httpsfv.NewItem(res.Rule.Name)
	l.Params.Add("r", res.Decision.Remaining)
	l.Params.Add("t", seconds(res.Decision.Reset))
	limitField, err := httpsfv.Marshal(httpsfv.List{l})
	if err != nil {
		return
	}
	h.Set("RateLimit-Policy", policyField)
	h.Set("RateLimit", limitField)
}

// problem is an RFC 9457 problem detail.
type problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail"`
	Policy     string `json:"policy,omitempty"`
	Rule       string `json:"rule,omitempty"`
	RetryAfter int64  `json:"retryAfter"`
}

// refuse answers a refused request: 429 for a limit, 503 when a fail-closed rule's store is down.
func refuse(w http.ResponseWriter, res *limiter.Result) {
	retry := max(1, seconds(res.RetryAfter))
	p := problem{Policy: res.Policy, RetryAfter: retry}
	if res.Rule != nil {
		p.Rule = res.Rule.Name
	}
	if res.Outcome == limiter.Unavailable {
		p.Type, p.Title, p.Status = "https://sluice.dev/problems/store-unavailable", "Service Unavailable", http.StatusServiceUnavailable
		p.Detail = "the rate-limit store is unavailable and rule " + strconv.Quote(p.Rule) + " fails closed"
	} else {
		p.Type, p.Title, p.Status = "https://sluice.dev/problems/rate-limited", "Too Many Requests", http.StatusTooManyRequests
		p.Detail = "rate limit " + strconv.Quote(p.Rule) + " exceeded; retry after " + strconv.FormatInt(retry, 10) + "s"
	}
	h := w.Header()
	h.Set("Retry-After", strconv.FormatInt(retry, 10))
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(p.Status)
	_ = json.NewEncoder(w).Encode(p)
}

func peerAddr(r *http.Request) netip.Addr {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		a, _ := netip.ParseAddr(host)
		return a.Unmap()
	}
	return ap.Addr().Unmap()
}

// proxy is the reverse proxy: it decides each request, holds leaky-bucket requests for their
// wait, and forwards what passes to the upstream with the body streamed.
type proxy struct {
	limiter *limiter.Limiter
	rp      *httputil.ReverseProxy
}

func newProxy(l *limiter.Limiter, upstream *url.URL, transport http.RoundTripper) *proxy {
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(upstream)
			pr.Out.Host = pr.In.Host
			// Keep the chain of proxies before us, then add the peer.
			pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
			pr.SetXForwarded()
		},
		Transport: transport,
		// FlushInterval 0: ReverseProxy still flushes streamed responses (unknown length,
		// text/event-stream) as every chunk arrives, and sends a small response in one write
		// instead of one per header and body.
		FlushInterval: 0,
		// Without a pool, every response allocates a fresh 32 KiB copy buffer.
		BufferPool: &bufferPool{},
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, _ error) {
			w.WriteHeader(http.StatusBadGateway)
		},
	}
	return &proxy{limiter: l, rp: rp}
}

// bufferPool recycles ReverseProxy's copy buffers.
type bufferPool struct{ p sync.Pool }

func (b *bufferPool) Get() []byte {
	if buf, ok := b.p.Get().(*[]byte); ok {
		return *buf
	}
	return make([]byte, 32<<10)
}

func (b *bufferPool) Put(buf []byte) { b.p.Put(&buf) }

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	res := p.limiter.Decide(r.Context(), &limiter.Request{Method: r.Method, Path: r.URL.Path, Header: r.Header, Peer: peerAddr(r)})
	setRateLimitHeaders(w.Header(), &res)
	if res.Outcome != limiter.Allowed {
		refuse(w, &res)
		return
	}
	if !hold(r, res.Wait) {
		return
	}
	p.rp.ServeHTTP(w, r)
}

// hold keeps a leaky-bucket request for its wait. It reports false when the client went away
// meanwhile: the request is then released at once.
func hold(r *http.Request, wait time.Duration) bool {
	if wait <= 0 {
		return true
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

// check is the forward-auth API for ingress controllers (ingress-nginx auth-url, Traefik
// ForwardAuth): it decides the original request described by the headers and answers 200, 429
// or 503 with the same headers as the proxy, forwarding nothing. The original method and URI come
// from X-Original-Method and X-Original-URL (ingress-nginx) or X-Forwarded-Method and
// X-Forwarded-Uri (Traefik). The client address is the ingress's X-Forwarded-For when the ingress
// is in trustedProxies.
type check struct {
	limiter *limiter.Limiter
}

func (c *check) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	method := firstOf(r.Header, "X-Original-Method", "X-Forwarded-Method")
	uri := firstOf(r.Header, "X-Original-Url", "X-Forwarded-Uri")
	if method == "" || uri == "" {
		http.Error(w, "the check API needs the original method and URI in X-Original-Method and X-Original-URL, or X-Forwarded-Method and X-Forwarded-Uri", http.StatusBadRequest)
		return
	}
	path := uri
	if u, err := url.Parse(uri); err == nil {
		path = u.Path
	}
	res := c.limiter.Decide(r.Context(), &limiter.Request{Method: strings.ToUpper(method), Path: path, Header: r.Header, Peer: peerAddr(r)})
	setRateLimitHeaders(w.Header(), &res)
	if res.Outcome != limiter.Allowed {
		refuse(w, &res)
		return
	}
	if hold(r, res.Wait) {
		w.WriteHeader(http.StatusOK)
	}
}

func firstOf(h http.Header, names ...string) string {
	for _, n := range names {
		if v := h.Get(n); v != "" {
			return v
		}
	}
	return ""
}
