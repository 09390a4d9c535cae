package netproxy

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/sluice-dev/sluice/enforcer/internal/seam"
	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
)

// NewTransport is the proxy's transport for an upstream of any scheme: HTTP/1.1 to
// http://, h2 or HTTP/1.1 by ALPN to https://, h2 with prior knowledge to h2c://. net/http
// retries a request that failed on a reused connection before any response byte when it is
// idempotent or provably not sent.
func NewTransport(u *url.URL, o upstream.Options) http.RoundTripper {
	var protocols http.Protocols
	switch u.Scheme {
	case "h2c":
		protocols.SetUnencryptedHTTP2(true)
	case "https":
		protocols.SetHTTP1(true)
		protocols.SetHTTP2(true)
	default:
		protocols.SetHTTP1(true)
	}
	t := &http.Transport{
		DialContext:           (&net.Dialer{Timeout: o.Connect, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          4096,
		MaxIdleConnsPerHost:   4096,
		IdleConnTimeout:       o.Idle,
		TLSHandshakeTimeout:   o.Connect,
		ExpectContinueTimeout: time.Second,
		Protocols:             &protocols,
		HTTP2:                 &http.HTTP2Config{MaxConcurrentStreams: seam.MaxStreams},
		// 64 KiB, as the fasthttp path's read buffer bounds it, where net/http's default is
		// 10 MiB. (An HTTP/2 upstream's header list is counted as HTTP/2 does, 32 bytes more a
		// field.)
		MaxResponseHeaderBytes: seam.MaxHeaderBytes,
	}
	if u.Scheme == "https" {
		c := &tls.Config{MinVersion: tls.VersionTLS12}
		if o.TLS != nil {
			c = o.TLS.Clone()
		}
		if c.ServerName == "" {
			c.ServerName = u.Hostname()
		}
		t.TLSClientConfig = c
	}
	return &headerTimeout{rt: t, timeout: o.ResponseHeader}
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
		if context.Cause(ctx) == upstream.ErrTimeout { //nolint:errorlint // the sentinel itself is the cause
			err = upstream.ErrTimeout
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
		w.timer = time.AfterFunc(w.timeout, func() { w.cancel(upstream.ErrTimeout) })
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
