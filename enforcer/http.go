package enforcer

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

// setRateLimitHeaders writes the RateLimit-Policy and RateLimit fields for the rule the result
// describes. set is the response's header setter: http.Header.Set, or the check API server's.
func setRateLimitHeaders(set func(name, value string), res *limiter.Result) {
	if res.Rule == nil || res.Decision.Limit == 0 || res.Rule.Fields.Policy == "" {
		return
	}
	set("RateLimit-Policy", res.Rule.Fields.Policy)
	set("RateLimit", res.Rule.Fields.Limit(res.Decision.Remaining, policy.Seconds(res.Decision.Reset)))
}

// problem is an RFC 9457 problem detail.
type problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail"`
	Policy     string `json:"policy,omitempty"`
	Rule       string `json:"rule,omitempty"`
	RetryAfter int64  `json:"retryAfter,omitempty"`
}

// refusal describes a refused request: 429 for a limit, 503 when a fail-closed rule's store is
// down. It sets the headers through set and returns the status and the problem+json body. A
// request that can never pass (its cost is over the rule's capacity) gets no Retry-After: no
// time would let it through.
func refusal(set func(name, value string), res *limiter.Result) (status int, body []byte) {
	p := describe(res)
	if p.RetryAfter > 0 {
		set("Retry-After", strconv.FormatInt(p.RetryAfter, 10))
	}
	set("Content-Type", "application/problem+json")
	set("Cache-Control", "no-store")
	body, _ = json.Marshal(p) // strings and integers: cannot fail
	return p.Status, append(body, '\n')
}

// describe is the problem that describes a refused request.
func describe(res *limiter.Result) problem {
	retry := max(1, policy.Seconds(res.RetryAfter))
	p := problem{Policy: res.Policy, RetryAfter: retry}
	if res.Rule != nil {
		p.Rule = res.Rule.Name
	}
	switch {
	case res.Outcome == limiter.Unavailable:
		p.Type, p.Title, p.Status = "https://sluice.dev/problems/store-unavailable", "Service Unavailable", http.StatusServiceUnavailable
		p.Detail = "the rate-limit store is unavailable and rule " + strconv.Quote(p.Rule) + " fails closed"
	case res.Never:
		p.Type, p.Title, p.Status, p.RetryAfter = "https://sluice.dev/problems/never-passes", "Too Many Requests", http.StatusTooManyRequests, 0
		p.Detail = "the request's cost exceeds what rate limit " + strconv.Quote(p.Rule) + " can ever admit; it can never pass"
	case res.Rule != nil && res.Rule.Limit.Kind == algorithm.Concurrency:
		// No clock frees a slot: Retry-After is the shortest the field says, 1, a time to try
		// again rather than a promise.
		p.Type, p.Title, p.Status = "https://sluice.dev/problems/concurrency-limited", "Too Many Requests", http.StatusTooManyRequests
		p.Detail = "concurrency limit " + strconv.Quote(p.Rule) + " allows " + strconv.FormatInt(res.Rule.Limit.Limit, 10) +
			" requests in flight; one frees when a request ends, so no time is promised"
	default:
		p.Type, p.Title, p.Status = "https://sluice.dev/problems/rate-limited", "Too Many Requests", http.StatusTooManyRequests
		p.Detail = "rate limit " + strconv.Quote(p.Rule) + " exceeded; retry after " + strconv.FormatInt(retry, 10) + "s"
	}
	return p
}

// malformed describes a request that cannot be decided as sent (400, 414): nothing was charged.
func malformed(set func(name, value string), status int, detail string) []byte {
	p := problem{Type: "https://sluice.dev/problems/malformed-request", Title: http.StatusText(status), Status: status, Detail: detail}
	set("Content-Type", "application/problem+json")
	set("Cache-Control", "no-store")
	body, _ := json.Marshal(p)
	return append(body, '\n')
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
	// writeTimeout cuts the connection of a client whose response write makes no progress for
	// that long. HTTP/2 needs it here: a client that grants no flow-control window stalls its
	// stream without ever stalling the socket, where the listener's write deadline watches.
	writeTimeout time.Duration
}

func newProxy(l *limiter.Limiter, upstream *url.URL, transport http.RoundTripper, writeTimeout time.Duration, m *upstreamMetrics, log logr.Logger) *proxy {
	upstream = upstreamURL(upstream)
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(upstream)
			pr.Out.Host = pr.In.Host
			peer := peerAddr(pr.In)
			setForwarded(pr.Out.Header, pr.In.Header, peer, pr.In.Host, trusts(l, peer))
		},
		Transport: transport,
		// FlushInterval 0: ReverseProxy still flushes streamed responses (unknown length,
		// text/event-stream) as every chunk arrives, and sends a small response in one write
		// instead of one per header and body.
		FlushInterval: 0,
		// Without a pool, every response allocates a fresh 32 KiB copy buffer.
		BufferPool: &bufferPool{},
		ModifyResponse: func(resp *http.Response) error {
			note(resp.Request.Context(), resp, resp.StatusCode)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				note(r.Context(), nil, 0)
				return // the client left: nobody reads an answer, and the upstream did not fail
			}
			status := m.failed(err)
			note(r.Context(), nil, status)
			log.V(1).Info("Upstream request failed", "error", err.Error(), "status", status)
			if isGRPC(r.Header) {
				writeGRPCStatus(w.Header(), grpcCode(status), http.StatusText(status)+": "+abbreviate(err.Error()))
				status = http.StatusOK
			}
			w.WriteHeader(status)
		},
	}
	return &proxy{limiter: l, rp: rp, writeTimeout: writeTimeout}
}

// connKey holds a request's connection in its context (http.Server.ConnContext).
type connKey struct{}

func withConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// progressWriter closes the connection under a response whose Write blocks past a timeout.
type progressWriter struct {
	http.ResponseWriter
	conn    net.Conn
	timeout time.Duration
}

func (w *progressWriter) Write(p []byte) (int, error) {
	t := time.AfterFunc(w.timeout, func() { _ = w.conn.Close() })
	defer t.Stop()
	return w.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the server's writer, to flush.
func (w *progressWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

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
	h := w.Header()
	if r.Method == http.MethodConnect {
		w.WriteHeader(http.StatusMethodNotAllowed) // a tunnel, whose traffic nothing would decide
		return
	}
	if r.ProtoMajor == 1 {
		if up := upgradeOf(r.Header); up != "" && !strings.EqualFold(up, "websocket") {
			// As the fasthttp proxy: only WebSocket is spliced.
			h.Set("Connection", "close")
			body := malformed(h.Set, http.StatusBadRequest, "upgrade to "+strconv.Quote(abbreviate(up))+" refused: only websocket is proxied; speak HTTP/2 with prior knowledge")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = w.Write(body)
			return
		}
		// Decided on what the upstream will read, as the fasthttp proxy does.
		removeConnectionNamed(r.Header)
	}
	// RequestURI is the target as received (HTTP/2's :path), before net/http's own reading.
	v := decide(p.limiter, &input{method: r.Method, target: r.RequestURI, header: r.Header, peer: peerAddr(r), gone: r.Context().Done(), seesResponse: true})
	if r.Context().Err() != nil {
		v.owed().drop()
		return // the client left while its request was decided, and was counted: nobody reads an answer
	}
	if v.status != http.StatusOK && isGRPC(r.Header) {
		v.writeGRPC(h)
		w.WriteHeader(http.StatusOK)
		return
	}
	if body := v.write(h.Set); v.status != http.StatusOK {
		w.WriteHeader(v.status)
		_, _ = w.Write(body)
		return
	}
	if !hold(p.limiter, v.Wait, r.Context().Done()) {
		v.owed().drop()
		return
	}
	if c, ok := r.Context().Value(connKey{}).(net.Conn); ok && p.writeTimeout > 0 {
		w = &progressWriter{ResponseWriter: w, conn: c, timeout: p.writeTimeout}
	}
	o := v.owed()
	if !o.owes() {
		p.rp.ServeHTTP(w, r)
		return
	}
	// ServeHTTP returns once the response is complete (its body and trailers copied, or an
	// upgraded connection ended), or its client gone, which cancels the upstream request too;
	// it panics (http.ErrAbortHandler) when the client leaves mid-body: deferred, the end comes
	// either way.
	n := &responseNote{}
	defer func() { o.end(n.result()) }()
	p.rp.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), noteKey{}, n)))
}

// responseNote is what an owing request's response was, for its end: the upstream's response
// (ModifyResponse), or the status the proxy answered when the upstream failed (ErrorHandler);
// neither when the client left first.
type responseNote struct {
	resp   *http.Response
	status int
}

type noteKey struct{}

// note records on the request's note, if it has one, what its response was.
func note(ctx context.Context, resp *http.Response, status int) {
	if n, ok := ctx.Value(noteKey{}).(*responseNote); ok {
		n.resp, n.status = resp, status
	}
}

// result is the response's status and a reader of its fields, header and trailer.
func (n *responseNote) result() (int, func(string) []string) {
	if n.resp == nil {
		return n.status, nil
	}
	return n.resp.StatusCode, func(name string) []string {
		return append(append([]string(nil), n.resp.Header.Values(name)...), n.resp.Trailer.Values(name)...)
	}
}

// upgradeOf is the protocol a request asks to switch to, "" if none.
func upgradeOf(h http.Header) string {
	for _, v := range h.Values("Connection") {
		for f := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(f), "upgrade") {
				return h.Get("Upgrade")
			}
		}
	}
	return ""
}

// removeConnectionNamed removes the fields a request's Connection names, but Upgrade, which
// ReverseProxy reads to splice a WebSocket; it removes the hop-by-hop fields itself.
func removeConnectionNamed(h http.Header) {
	for _, v := range h.Values("Connection") {
		for f := range strings.SplitSeq(v, ",") {
			if f = strings.TrimSpace(f); f != "" && !strings.EqualFold(f, "upgrade") && !strings.EqualFold(f, "close") && !strings.EqualFold(f, "keep-alive") {
				h.Del(f)
			}
		}
	}
}
