// Package fastproxy is the reverse proxy for HTTP/1.1 clients of an http:// upstream, on
// fasthttp: the enforcer's fast path. Every other combination of client and upstream goes by
// netproxy (the upstream package's table).
package fastproxy

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/conns"
	"github.com/sluice-dev/sluice/enforcer/internal/fastserve"
	"github.com/sluice-dev/sluice/enforcer/internal/forwarded"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/panics"
	"github.com/sluice-dev/sluice/enforcer/internal/seam"
	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
)

// Proxy is the reverse proxy for HTTP/1.1, on fasthttp: it decides each request, holds
// leaky-bucket requests for their wait (releasing one whose client leaves), and forwards what
// passes to the upstream with both bodies streamed, as httputil.ReverseProxy would: hop-by-hop
// fields removed, X-Forwarded-For, -Host and -Proto set, upgrades (WebSocket) spliced both ways.
// Cleartext HTTP/2 goes to netproxy instead, beside it on the same listener.
type Proxy struct {
	limiter  *limiter.Limiter
	upstream *url.URL
	client   *fasthttp.HostClient
	// dial opens a connection of its own to the upstream, for an upgraded request or one that
	// holds a concurrency slot.
	dial func(ctx context.Context) (net.Conn, error)
	log  logr.Logger
	// panics contains those of an upgraded connection's splice, which runs beside the server.
	panics *panics.Panics
	// headerTimeout bounds the wait for the response of a request on a connection of its own,
	// as the pool's connections bound every other's; metrics counts the upstream's failures.
	headerTimeout time.Duration
	metrics       *upstream.Metrics
}

// New is the proxy to an http:// upstream: cleartext HTTP/1.1, which the fast path speaks. An
// https:// or h2c:// upstream (TLS with its roots, server name and client certificate; HTTP/2)
// goes by netproxy, and is refused here.
func New(l *limiter.Limiter, up *url.URL, o upstream.Options, m *upstream.Metrics, p *panics.Panics, log logr.Logger) (*Proxy, error) {
	if up.Scheme != "http" {
		return nil, fmt.Errorf("the fasthttp proxy speaks cleartext HTTP/1.1 to an http:// upstream, not %s://: netproxy serves it", up.Scheme)
	}
	addr := up.Host
	if up.Port() == "" {
		addr = net.JoinHostPort(up.Hostname(), "80")
	}
	d := &net.Dialer{Timeout: o.Connect, KeepAlive: 30 * time.Second}
	client := &fasthttp.HostClient{
		Addr: addr,
		// As many connections as requests in flight: a proxy must not queue behind its pool.
		MaxConns:            1 << 16,
		MaxIdleConnDuration: o.Idle,
		// The response header's limit: fasthttp's default, 4 KiB, made an upstream's larger
		// cookies a 502. Held per request in flight, not per idle connection.
		ReadBufferSize: seam.MaxHeaderBytes,
		// Streamed both ways: a response is relayed as the upstream writes it.
		StreamResponseBody:            true,
		DisablePathNormalizing:        true,
		DisableHeaderNamesNormalizing: true,
		NoDefaultUserAgentHeader:      true,
		Dial: func(addr string) (net.Conn, error) {
			c, err := d.Dial("tcp", addr)
			if err != nil || o.ResponseHeader <= 0 {
				return c, err
			}
			return &headerDeadlineConn{Conn: c, timeout: o.ResponseHeader}, nil
		},
		RetryIfErr: retryOnce,
	}
	return &Proxy{limiter: l, upstream: up, client: client, log: log, panics: p, headerTimeout: o.ResponseHeader, metrics: m,
		dial: func(ctx context.Context) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }}, nil
}

// Serve decides a request and forwards it if it passes.
func (p *Proxy) Serve(ctx *fasthttp.RequestCtx) {
	req := &ctx.Request
	if req.Header.IsConnect() {
		ctx.SetStatusCode(http.StatusMethodNotAllowed) // a tunnel, whose traffic nothing would decide
		return
	}
	upgrade := upgradeType(&req.Header)
	if bad := seam.Upgrade(upgrade); bad != nil {
		ctx.SetStatusCode(bad.Status)
		ctx.SetBody(bad.Write(ctx.Response.Header.Set))
		ctx.SetConnectionClose()
		return
	}
	// Decided on what the upstream will read: a field the client names in Connection is removed
	// before it is forwarded, so it is removed before it is decided too.
	removeHopHeaders(&req.Header)
	v := seam.Decide(p.limiter, &seam.Input{
		Method:       fastserve.B2S(req.Header.Method()),
		Target:       fastserve.B2S(req.Header.RequestURI()),
		Header:       fastserve.Header{H: &req.Header},
		Peer:         fastserve.Peer(ctx),
		SeesResponse: true,
	})
	if v.Status != http.StatusOK {
		ctx.SetStatusCode(v.Status)
		ctx.SetBody(v.Write(ctx.Response.Header.Set))
		return
	}
	o := v.Owed()
	if o.Owes() {
		// Every path below ends the request once, some of them after the handler returns; a
		// panic on the way ends it here, before the panic is answered 500.
		defer func() {
			if r := recover(); r != nil {
				o.End(0, nil)
				panic(r)
			}
		}()
	}
	if !conns.Hold(ctx.Conn(), v.Wait) {
		p.limiter.Left()
		o.Drop()
		fastserve.Abandon(ctx)
		return
	}
	p.rewrite(ctx, req)
	if upgrade != "" {
		p.upgrade(ctx, upgrade, o)
		return
	}
	p.forward(ctx, req, o)
	removeHopHeaders(&ctx.Response.Header)
	// After the upstream's fields, which the response now holds.
	v.Write(ctx.Response.Header.Set)
	if len(req.Header.RawHeaders()) > maxIdleHeaderBytes || largeHeader(&ctx.Response.Header) {
		// fasthttp keeps a connection's request and response buffers at their largest while it
		// idles: a connection that carried a large header block, either way, is closed, not
		// kept holding them.
		ctx.SetConnectionClose()
	}
}

// upgradeType is the protocol a request asks to switch to, "" if none.
func upgradeType(h *fasthttp.RequestHeader) string {
	if !h.ConnectionUpgrade() {
		return ""
	}
	return string(h.Peek("Upgrade"))
}

// forward sends an admitted request to the upstream: on a connection of its own when it holds a
// slot (forwardHeld), through a response of its own when it owes its response's charges
// (forwardOwing), and otherwise straight into the client's response.
func (p *Proxy) forward(ctx *fasthttp.RequestCtx, req *fasthttp.Request, o seam.Owed) {
	// The body of a long upload arrives while the request is forwarded, past the deadline the
	// server set for reading the request.
	if req.IsBodyStream() {
		_ = ctx.Conn().SetReadDeadline(time.Time{})
	}
	switch {
	case o.Holds():
		p.forwardHeld(ctx, req, o)
	case o.Owes():
		p.forwardOwing(ctx, req, o)
	default:
		if err := p.client.Do(req, &ctx.Response); err != nil {
			ctx.Response.Reset()
			ctx.SetStatusCode(p.metrics.Failed(err))
			p.log.V(1).Info("Upstream request failed", "error", err.Error())
		}
	}
}

// maxIdleHeaderBytes is the largest header block after which a proxy connection is kept alive.
const maxIdleHeaderBytes = 8 << 10

// largeHeader reports whether a response's fields take more than maxIdleHeaderBytes.
func largeHeader(h *fasthttp.ResponseHeader) bool {
	n := 0
	for k, v := range h.All() {
		if n += len(k) + len(v) + len(": \r\n"); n > maxIdleHeaderBytes {
			return true
		}
	}
	return false
}

// rewrite turns the client's request into the upstream's, as httputil.ReverseProxy's Rewrite
// with SetURL and SetXForwarded: the upstream's scheme and address, the client's Host kept, and
// the forwarded fields set (package forwarded): X-Forwarded-For (a trusted peer's chain plus the
// peer), -Host, -Proto and Forwarded. serve has removed the hop-by-hop fields already, before
// the decision.
func (p *Proxy) rewrite(ctx *fasthttp.RequestCtx, req *fasthttp.Request) {
	h := &req.Header
	// Copies, on the stack while they are short: setting fields moves the bytes Peek points into.
	var hostBuf, xffBuf, fwdBuf [128]byte
	host := append(hostBuf[:0], h.Host()...)
	if len(host) == 0 {
		host = append(host, p.upstream.Host...) // an HTTP/1.0 client sent none
	}
	peer := fastserve.Peer(ctx)
	xff, fwd := xffBuf[:0], fwdBuf[:0]
	xfh, xfp := host, []byte("http")
	if forwarded.Trusts(p.limiter, peer) {
		for _, prior := range h.PeekAll("X-Forwarded-For") {
			xff = append(append(xff, prior...), ", "...)
		}
		var prior []byte
		for i, v := range h.PeekAll("Forwarded") {
			if i > 0 {
				prior = append(prior, ", "...)
			}
			prior = append(prior, v...)
		}
		fh, fp, ok := forwarded.First(fastserve.B2S(prior))
		if ok {
			fwd = append(append(fwd, prior...), ", "...)
		}
		if v := h.Peek("X-Forwarded-Host"); len(v) > 0 {
			xfh = append([]byte(nil), v...)
		} else if fh != "" {
			xfh = []byte(fh)
		}
		if v := h.Peek("X-Forwarded-Proto"); len(v) > 0 {
			xfp = append([]byte(nil), v...)
		} else if fp != "" {
			xfp = []byte(fp)
		}
	}
	xff = peer.AppendTo(xff)
	fwd = forwarded.AppendElement(fwd, peer, host)
	h.SetBytesV("X-Forwarded-For", xff)
	h.SetBytesV("X-Forwarded-Host", xfh)
	h.SetBytesV("X-Forwarded-Proto", xfp)
	h.SetBytesV("Forwarded", fwd)
	if p.upstream.Path != "" && p.upstream.Path != "/" {
		path := req.URI().PathOriginal()
		req.URI().SetPathBytes(append([]byte(strings.TrimSuffix(p.upstream.Path, "/")), path...))
	}
	req.SetHostBytes(host) // SetHost sets the URI's host and the Host field: the client's
	req.UseHostHeader = true
}

// hopHeaders are the fields that belong to one connection (RFC 9110, 7.6.1), as
// httputil.ReverseProxy removes them.
var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// header is what removeHopHeaders needs of a request or response header.
type header interface {
	Peek(key string) []byte
	Del(key string)
}

// removeHopHeaders removes the hop-by-hop fields, and those the Connection field names. fasthttp
// keeps Connection and Transfer-Encoding out of its header map and writes them itself, so
// deleting them here changes only what it would copy.
func removeHopHeaders(h header) {
	var buf [128]byte
	// A copy: deleting fields moves the header's bytes that Peek points into.
	if c := append(buf[:0], h.Peek("Connection")...); len(c) > 0 {
		for len(c) > 0 {
			f := c
			if i := bytes.IndexByte(c, ','); i >= 0 {
				f, c = c[:i], c[i+1:]
			} else {
				c = nil
			}
			if f = bytes.TrimSpace(f); len(f) > 0 && !bytes.EqualFold(f, []byte("close")) && !bytes.EqualFold(f, []byte("keep-alive")) {
				h.Del(string(f))
			}
		}
	}
	for _, name := range hopHeaders {
		if len(h.Peek(name)) > 0 {
			h.Del(name)
		}
	}
}

// NewServer serves the proxy's HTTP/1.1 with the limits of the check API: readTimeout to read a
// request's header block, idleTimeout between requests, 64 KiB of header. Bodies stream: up to
// 64 KiB is read before the handler runs, the rest while it is forwarded, so uploads of any size
// pass.
func NewServer(h fasthttp.RequestHandler, log logr.Logger, readTimeout, idleTimeout time.Duration) *fasthttp.Server {
	return &fasthttp.Server{
		Handler:                      h,
		IdleTimeout:                  idleTimeout,
		ReduceMemoryUsage:            true, // an idle connection releases its write buffer; the 64 KiB read buffer stays, as streamed request bodies need it
		ReadTimeout:                  readTimeout,
		ReadBufferSize:               seam.MaxHeaderBytes, // fasthttp's header size limit
		StreamRequestBody:            true,
		MaxRequestBodySize:           64 << 10, // read ahead; the rest streams
		DisablePreParseMultipartForm: true,
		NoDefaultServerHeader:        true,
		NoDefaultContentType:         true,
		Logger:                       fastserve.Logger{Log: log, Server: "proxy"},
		ErrorHandler:                 fastserve.RefuseMalformed,
	}
}
