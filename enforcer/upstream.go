package enforcer

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
)

// The hop to the upstream. Which proxy serves which combination:
//
//	upstream   client HTTP/1.1                  client h2c (and gRPC)
//	http://    fasthttp, HTTP/1.1 (fast path)   net/http, HTTP/1.1
//	https://   net/http, h2 or HTTP/1.1 (ALPN)  net/http, h2 or HTTP/1.1 (ALPN)
//	h2c://     net/http, h2c                    net/http, h2c
//
// Both proxies bound the hop with the same three timeouts and count its failures alike.

// UpstreamSchemes are the schemes --upstream takes.
var UpstreamSchemes = []string{"http", "https", "h2c"}

// errUpstreamTimeout is why a request whose upstream sent no response header in time ended.
var errUpstreamTimeout = errors.New("upstream sent no response header within the response header timeout")

// upstreamMetrics counts the requests the upstream failed, by reason: timeout (504) or error
// (502: refused, reset, a TLS failure).
type upstreamMetrics struct{ failures *prometheus.CounterVec }

func newUpstreamMetrics(reg prometheus.Registerer) *upstreamMetrics {
	m := &upstreamMetrics{failures: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_upstream_failures_total",
		Help: "Proxied requests the upstream failed, by reason: timeout (answered 504) or error (502).",
	}, []string{"reason"})}
	for _, reason := range []string{"timeout", "error"} {
		m.failures.WithLabelValues(reason)
	}
	reg.MustRegister(m.failures)
	return m
}

// failed counts a failed upstream request and returns the status that answers it.
func (m *upstreamMetrics) failed(err error) int {
	if isTimeout(err) {
		m.failures.WithLabelValues("timeout").Inc()
		return http.StatusGatewayTimeout
	}
	m.failures.WithLabelValues("error").Inc()
	return http.StatusBadGateway
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, errUpstreamTimeout) || errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, fasthttp.ErrTimeout) ||
		errors.Is(err, fasthttp.ErrDialTimeout) || (errors.As(err, &ne) && ne.Timeout())
}

// upstreamOptions are the hop's settings, from Config.
type upstreamOptions struct {
	tls                           *tls.Config
	connect, responseHeader, idle time.Duration
}

// newTransport is the net/http proxy's transport for an upstream of any scheme: HTTP/1.1 to
// http://, h2 or HTTP/1.1 by ALPN to https://, h2 with prior knowledge to h2c://. net/http
// retries a request that failed on a reused connection before any response byte when it is
// idempotent or provably not sent.
func newTransport(upstream *url.URL, o upstreamOptions) http.RoundTripper {
	var protocols http.Protocols
	switch upstream.Scheme {
	case "h2c":
		protocols.SetUnencryptedHTTP2(true)
	case "https":
		protocols.SetHTTP1(true)
		protocols.SetHTTP2(true)
	default:
		protocols.SetHTTP1(true)
	}
	t := &http.Transport{
		DialContext:           (&net.Dialer{Timeout: o.connect, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          4096,
		MaxIdleConnsPerHost:   4096,
		IdleConnTimeout:       o.idle,
		TLSHandshakeTimeout:   o.connect,
		ExpectContinueTimeout: time.Second,
		Protocols:             &protocols,
		HTTP2:                 &http.HTTP2Config{MaxConcurrentStreams: maxStreams},
		// As the fasthttp path's: 10 MiB by default. (An HTTP/2 upstream's header list is
		// counted as HTTP/2 does, 32 bytes more a field.)
		MaxResponseHeaderBytes: MaxHeaderBytes,
	}
	if upstream.Scheme == "https" {
		c := &tls.Config{MinVersion: tls.VersionTLS12}
		if o.tls != nil {
			c = o.tls.Clone()
		}
		if c.ServerName == "" {
			c.ServerName = upstream.Hostname()
		}
		t.TLSClientConfig = c
	}
	return &headerTimeout{rt: t, timeout: o.responseHeader}
}

// upstreamURL is where the net/http proxy sends requests: an h2c:// upstream is http:// to
// net/http, which speaks h2c to it by the transport's protocols.
func upstreamURL(u *url.URL) *url.URL {
	if u.Scheme != "h2c" {
		return u
	}
	c := *u
	c.Scheme = "http"
	return &c
}

// headerTimeout bounds the wait for the upstream's response header: from the end of the request
// body (at once for a request without one) to the response header. What comes after, a
// streamed body or an upgraded connection, is not bounded by it. gRPC calls are not bounded
// either: a server stream may send its header with its first message, late, and the call's own
// deadline (grpc-timeout) bounds it.
type headerTimeout struct {
	rt      http.RoundTripper
	timeout time.Duration
}

func (h *headerTimeout) RoundTrip(req *http.Request) (*http.Response, error) {
	if h.timeout <= 0 || isGRPC(req.Header) {
		return h.rt.RoundTrip(req)
	}
	ctx, cancel := context.WithCancelCause(req.Context())
	w := &headerWatch{timeout: h.timeout, cancel: cancel}
	out := req.WithContext(ctx)
	if req.Body == nil || req.Body == http.NoBody {
		w.arm()
	} else {
		out.Body = &armAtEOF{ReadCloser: req.Body, w: w}
	}
	resp, err := h.rt.RoundTrip(out)
	w.stop()
	if err != nil {
		if context.Cause(ctx) == errUpstreamTimeout { //nolint:errorlint // the sentinel itself is the cause
			err = errUpstreamTimeout
		}
		cancel(nil)
		return nil, err
	}
	// The context lives on with the body, an upgraded connection's included; the server's
	// request context, its parent, ends it when the handler returns.
	return resp, nil
}

// headerWatch cancels a request when its timer fires before stop.
type headerWatch struct {
	timeout time.Duration
	cancel  context.CancelCauseFunc
	mu      sync.Mutex
	timer   *time.Timer
	stopped bool
}

func (w *headerWatch) arm() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.stopped && w.timer == nil {
		w.timer = time.AfterFunc(w.timeout, func() { w.cancel(errUpstreamTimeout) })
	}
}

func (w *headerWatch) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
	if w.timer != nil {
		w.timer.Stop()
	}
}

// armAtEOF starts a header watch once the request body has been sent whole.
type armAtEOF struct {
	io.ReadCloser
	w *headerWatch
}

func (a *armAtEOF) Read(p []byte) (int, error) {
	n, err := a.ReadCloser.Read(p)
	if err == io.EOF {
		a.w.arm()
	}
	return n, err
}

// isGRPC reports whether a request is a gRPC call (application/grpc, or +proto, +json...).
func isGRPC(h http.Header) bool {
	ct := h.Get("Content-Type")
	return strings.HasPrefix(ct, "application/grpc") && (len(ct) == len("application/grpc") || ct[len("application/grpc")] == '+' || ct[len("application/grpc")] == ';')
}

// headerDeadlineConn is a fasthttp upstream connection with the response header timeout: each
// write of the request sets a read deadline that the first byte of the response clears, so that
// a streamed response may last any time once it has begun.
type headerDeadlineConn struct {
	net.Conn
	timeout time.Duration
	waiting bool
}

func (c *headerDeadlineConn) Write(p []byte) (int, error) {
	c.waiting = true
	_ = c.Conn.SetReadDeadline(time.Now().Add(c.timeout))
	return c.Conn.Write(p)
}

func (c *headerDeadlineConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.waiting {
		c.waiting = false
		_ = c.Conn.SetReadDeadline(time.Time{})
	}
	return n, err
}

// SetReadDeadline keeps the header deadline while the response has not begun: fasthttp clears
// the read deadline of a connection after writing a request on it (it sets none of its own).
func (c *headerDeadlineConn) SetReadDeadline(t time.Time) error {
	if t.IsZero() && c.waiting {
		return nil
	}
	return c.Conn.SetReadDeadline(t)
}

// retryOnce is fasthttp's retry rule, net/http's: a request that failed before any byte of its
// response arrived (the upstream closed a pooled connection as it was reused) is sent once more
// on a new connection when it is idempotent and its body can be sent again. fasthttp does not
// retry a streamed body at all.
func retryOnce(req *fasthttp.Request, attempts int, err error) (resetTimeout, retry bool) {
	if attempts > 1 || isTimeout(err) {
		return false, false
	}
	if !errors.Is(err, io.EOF) && !errors.Is(err, fasthttp.ErrConnectionClosed) && !errors.Is(err, net.ErrClosed) && !isReset(err) {
		return false, false
	}
	h := &req.Header
	idempotent := h.IsGet() || h.IsHead() || h.IsOptions() || h.IsTrace() || h.IsPut() || h.IsDelete() ||
		len(h.Peek("Idempotency-Key")) > 0 || len(h.Peek("X-Idempotency-Key")) > 0
	return false, idempotent
}

func isReset(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "read" && strings.Contains(oe.Err.Error(), "reset")
}
