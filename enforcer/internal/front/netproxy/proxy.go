// Package netproxy is the reverse proxy on net/http: every client of an https:// or h2c://
// upstream, and the h2c clients (gRPC among them) of an http:// one.
package netproxy

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"github.com/sluice-dev/sluice/enforcer/internal/forwarded"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/seam"
	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
)

// peerAddr is the address of a request's TCP peer.
func peerAddr(r *http.Request) netip.Addr {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		a, _ := netip.ParseAddr(host)
		return a.Unmap()
	}
	return ap.Addr().Unmap()
}

// Proxy is the reverse proxy on net/http: it decides each request, holds leaky-bucket requests
// for their wait, and forwards what passes to the upstream with the body streamed. It serves
// every client of an https:// or h2c:// upstream, and h2c clients (gRPC) of an http:// one.
type Proxy struct {
	limiter *limiter.Limiter
	rp      *httputil.ReverseProxy
	// writeTimeout cuts the connection of a client whose response write makes no progress for
	// that long. HTTP/2 needs it here: a client that grants no flow-control window stalls its
	// stream without ever stalling the socket, where the listener's write deadline watches.
	writeTimeout time.Duration
}

// New is the proxy to the upstream u through transport (NewTransport), whose writes to a client
// may make no progress for writeTimeout.
func New(l *limiter.Limiter, u *url.URL, transport http.RoundTripper, writeTimeout time.Duration, m *upstream.Metrics, log logr.Logger) *Proxy {
	up := upstreamURL(u)
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(up)
			pr.Out.Host = pr.In.Host
			peer := peerAddr(pr.In)
			forwarded.Set(pr.Out.Header, pr.In.Header, peer, pr.In.Host, forwarded.Trusts(l, peer))
		},
		Transport: transport,
		// FlushInterval 0: ReverseProxy still flushes streamed responses (unknown length,
		// text/event-stream) as every chunk arrives, and sends a small response in one write
		// instead of one per header and body.
		FlushInterval: 0,
		// Without a pool, every response allocates a fresh 32 KiB copy buffer.
		BufferPool: &bufferPool{},
		ModifyResponse: func(resp *http.Response) error {
			if n := note(resp.Request.Context(), resp, resp.StatusCode); n != nil && resp.StatusCode != http.StatusSwitchingProtocols {
				// An upgraded response's body is the connection, which ReverseProxy splices as
				// it is; any other is read to its end, or not, for the request's end.
				resp.Body = &endedBody{ReadCloser: resp.Body, n: n}
			}
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				note(r.Context(), nil, 0)
				return // the client left: nobody reads an answer, and the upstream did not fail
			}
			status := m.Failed(err)
			note(r.Context(), nil, status)
			log.V(1).Info("Upstream request failed", "error", err.Error(), "status", status)
			if isGRPC(r.Header) {
				writeGRPCStatus(w.Header(), grpcCode(status), http.StatusText(status)+": "+seam.Abbreviate(err.Error()))
				status = http.StatusOK
			}
			w.WriteHeader(status)
		},
	}
	return &Proxy{limiter: l, rp: rp, writeTimeout: writeTimeout}
}

// connKey holds a request's connection in its context (http.Server.ConnContext).
type connKey struct{}

// WithConn is http.Server.ConnContext for the proxy's servers: it gives a request its
// connection, which the proxy cuts when a write makes no progress.
func WithConn(ctx context.Context, c net.Conn) context.Context {
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

// ServeHTTP decides a request and forwards it if it passes.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodConnect {
		w.WriteHeader(http.StatusMethodNotAllowed) // a tunnel, whose traffic nothing would decide
		return
	}
	if r.ProtoMajor == 1 {
		// As the fasthttp proxy: only WebSocket is spliced.
		if bad := seam.Upgrade(upgradeOf(r.Header)); bad != nil {
			h := w.Header()
			h.Set("Connection", "close")
			body := bad.Write(h.Set)
			w.WriteHeader(bad.Status)
			_, _ = w.Write(body)
			return
		}
		// Decided on what the upstream will read, as the fasthttp proxy does.
		removeConnectionNamed(r.Header)
	}
	// RequestURI is the target as received (HTTP/2's :path), before net/http's own reading.
	v := seam.Decide(p.limiter, &seam.Input{Method: r.Method, Target: r.RequestURI, Header: r.Header, Peer: peerAddr(r), Gone: r.Context().Done(), SeesResponse: true})
	if r.Context().Err() != nil {
		v.Owed().Drop()
		return // the client left while its request was decided, and was counted: nobody reads an answer
	}
	if v.Status != http.StatusOK {
		p.refuse(w, r, &v)
		return
	}
	v.Write(w.Header().Set)
	if !seam.Hold(p.limiter, v.Wait, r.Context().Done()) {
		v.Owed().Drop()
		return
	}
	if c, ok := r.Context().Value(connKey{}).(net.Conn); ok && p.writeTimeout > 0 {
		w = &progressWriter{ResponseWriter: w, conn: c, timeout: p.writeTimeout}
	}
	p.forward(w, r, v.Owed())
}

// refuse answers a request the seam did not allow: in gRPC for a gRPC call.
func (p *Proxy) refuse(w http.ResponseWriter, r *http.Request, v *seam.Verdict) {
	if isGRPC(r.Header) {
		writeGRPC(w.Header(), v)
		w.WriteHeader(http.StatusOK)
		return
	}
	body := v.Write(w.Header().Set)
	w.WriteHeader(v.Status)
	_, _ = w.Write(body)
}

// forward sends an admitted request to the upstream. ReverseProxy's ServeHTTP returns once the
// response is complete (its body and trailers copied, or an upgraded connection ended), or its
// client gone, which cancels the upstream request too; it panics (http.ErrAbortHandler) when the
// client leaves mid-body: deferred, the request's end comes either way.
func (p *Proxy) forward(w http.ResponseWriter, r *http.Request, o seam.Owed) {
	if !o.Owes() {
		p.rp.ServeHTTP(w, r)
		return
	}
	n := &responseNote{}
	defer func() {
		if n.resp != nil && !n.ended && n.resp.StatusCode != http.StatusSwitchingProtocols {
			o.Cut(n.result()) // its client left during the body, or the upstream broke it off
			return
		}
		o.End(n.result())
	}()
	p.rp.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), noteKey{}, n)))
}

// responseNote is what an owing request's response was, for its end: the upstream's response
// (ModifyResponse), or the status the proxy answered when the upstream failed (ErrorHandler);
// neither when the client left first.
type responseNote struct {
	resp   *http.Response
	status int
	// ended is set once the upstream's body has been read to its end (endedBody), after which
	// ReverseProxy copies the trailers.
	ended bool
}

type noteKey struct{}

// note records on the request's note, if it has one, what its response was, and returns it.
func note(ctx context.Context, resp *http.Response, status int) *responseNote {
	n, ok := ctx.Value(noteKey{}).(*responseNote)
	if ok {
		n.resp, n.status = resp, status
	}
	return n
}

// endedBody notes when an owing request's response body has been read to its end.
type endedBody struct {
	io.ReadCloser
	n *responseNote
}

func (b *endedBody) Read(p []byte) (int, error) {
	k, err := b.ReadCloser.Read(p)
	if errors.Is(err, io.EOF) {
		b.n.ended = true
	}
	return k, err
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
