package enforcer

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/go-logr/logr"
	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
)

// fastProxy is the reverse proxy for HTTP/1.1, on fasthttp: it decides each request, holds
// leaky-bucket requests for their wait (releasing one whose client leaves), and forwards what
// passes to the upstream with both bodies streamed, as httputil.ReverseProxy would: hop-by-hop
// fields removed, X-Forwarded-For, -Host and -Proto set, upgrades (WebSocket) spliced both ways.
// Cleartext HTTP/2 goes to the net/http proxy (h2Proxy) instead; see serveProxy.
type fastProxy struct {
	limiter  *limiter.Limiter
	upstream *url.URL
	client   *fasthttp.HostClient
	// dialUpgrade opens a connection to the upstream for an upgraded request.
	dialUpgrade func(ctx context.Context) (net.Conn, error)
	log         logr.Logger
	// panics contains those of an upgraded connection's splice, which runs beside the server.
	panics *panics
	// headerTimeout bounds the wait for an upgraded request's response, as the pool's
	// connections bound every other's; metrics counts the upstream's failures.
	headerTimeout time.Duration
	metrics       *upstreamMetrics
}

func newFastProxy(l *limiter.Limiter, upstream *url.URL, o upstreamOptions, m *upstreamMetrics, log logr.Logger) *fastProxy {
	tlsUp := upstream.Scheme == "https"
	addr := upstream.Host
	if upstream.Port() == "" {
		addr = net.JoinHostPort(upstream.Hostname(), map[bool]string{true: "443", false: "80"}[tlsUp])
	}
	p := &fastProxy{limiter: l, upstream: upstream, log: log, headerTimeout: o.responseHeader, metrics: m}
	d := &net.Dialer{Timeout: o.connect, KeepAlive: 30 * time.Second}
	p.client = &fasthttp.HostClient{
		Addr:  addr,
		IsTLS: tlsUp,
		// As many connections as requests in flight: a proxy must not queue behind its pool.
		MaxConns:            1 << 16,
		MaxIdleConnDuration: o.idle,
		// Streamed both ways: a response is relayed as the upstream writes it.
		StreamResponseBody:            true,
		DisablePathNormalizing:        true,
		DisableHeaderNamesNormalizing: true,
		NoDefaultUserAgentHeader:      true,
		Dial: func(addr string) (net.Conn, error) {
			c, err := d.Dial("tcp", addr)
			if err != nil || o.responseHeader <= 0 {
				return c, err
			}
			return &headerDeadlineConn{Conn: c, timeout: o.responseHeader}, nil
		},
		RetryIfErr: retryOnce,
	}
	p.dialUpgrade = func(ctx context.Context) (net.Conn, error) {
		if tlsUp {
			return (&tls.Dialer{NetDialer: d, Config: &tls.Config{ServerName: upstream.Hostname(), MinVersion: tls.VersionTLS12}}).DialContext(ctx, "tcp", addr)
		}
		return d.DialContext(ctx, "tcp", addr)
	}
	return p
}

func (p *fastProxy) serve(ctx *fasthttp.RequestCtx) {
	req := &ctx.Request
	resp := &ctx.Response.Header
	if req.Header.IsConnect() {
		ctx.SetStatusCode(http.StatusMethodNotAllowed) // a tunnel, whose traffic nothing would decide
		return
	}
	upgrade := upgradeType(&req.Header)
	if upgrade != "" && !strings.EqualFold(upgrade, "websocket") {
		// A spliced connection carries requests nothing decides: only WebSocket, one request
		// for its whole life, is spliced. h2c upgrades are deprecated (RFC 9113, 3.1); HTTP/2
		// without TLS is served with prior knowledge.
		ctx.SetStatusCode(http.StatusBadRequest)
		ctx.SetBody(malformed(resp.Set, http.StatusBadRequest, "upgrade to "+strconv.Quote(abbreviate(upgrade))+" refused: only websocket is proxied; speak HTTP/2 with prior knowledge"))
		ctx.SetConnectionClose()
		return
	}
	// Decided on what the upstream will read: a field the client names in Connection is removed
	// before it is forwarded, so it is removed before it is decided too.
	removeHopHeaders(&req.Header)
	v := decide(p.limiter, &input{
		method: b2s(req.Header.Method()),
		target: b2s(req.Header.RequestURI()),
		header: fastHeader{&req.Header},
		peer:   remoteAddr(ctx),
	})
	if v.status != http.StatusOK {
		ctx.SetStatusCode(v.status)
		ctx.SetBody(v.write(resp.Set))
		return
	}
	if !holdConn(ctx.Conn(), v.Wait) {
		p.limiter.Left()
		ctx.SetConnectionClose() // the client has gone: nobody reads an answer
		return
	}
	p.rewrite(ctx, req)
	if upgrade != "" {
		p.upgrade(ctx, upgrade)
		return
	}
	// The body of a long upload arrives while the request is forwarded, past the deadline the
	// server set for reading the request.
	if req.IsBodyStream() {
		_ = ctx.Conn().SetReadDeadline(time.Time{})
	}
	if err := p.client.Do(req, &ctx.Response); err != nil {
		ctx.Response.Reset()
		ctx.SetStatusCode(p.metrics.failed(err))
		p.log.V(1).Info("Upstream request failed", "error", err.Error())
	}
	removeHopHeaders(&ctx.Response.Header)
	// After the upstream's fields, which the response now holds.
	v.write(ctx.Response.Header.Set)
	if len(req.Header.RawHeaders()) > maxIdleHeaderBytes {
		// fasthttp keeps a connection's request buffers at their largest while it idles: a
		// connection that carried a large header block is closed, not kept holding them.
		ctx.SetConnectionClose()
	}
}

// maxIdleHeaderBytes is the largest header block after which a proxy connection is kept alive.
const maxIdleHeaderBytes = 8 << 10

// b2s is a string that shares a byte slice's memory, for reading fasthttp's request fields
// during the request, which owns them: nothing may keep it past the handler.
func b2s(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// rewrite turns the client's request into the upstream's, as httputil.ReverseProxy's Rewrite
// with SetURL and SetXForwarded: the upstream's scheme and address, the client's Host kept, and
// the forwarded fields set (forwarded.go): X-Forwarded-For (a trusted peer's chain plus the
// peer), -Host, -Proto and Forwarded. serve has removed the hop-by-hop fields already, before
// the decision.
func (p *fastProxy) rewrite(ctx *fasthttp.RequestCtx, req *fasthttp.Request) {
	h := &req.Header
	// Copies, on the stack while they are short: setting fields moves the bytes Peek points into.
	var hostBuf, xffBuf, fwdBuf [128]byte
	host := append(hostBuf[:0], h.Host()...)
	if len(host) == 0 {
		host = append(host, p.upstream.Host...) // an HTTP/1.0 client sent none
	}
	peer := remoteAddr(ctx)
	xff, fwd := xffBuf[:0], fwdBuf[:0]
	xfh, xfp := host, []byte("http")
	if trusts(p.limiter, peer) {
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
		fh, fp, ok := forwardedFirst(b2s(prior))
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
	fwd = appendForwardedElement(fwd, peer, host)
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

// upgradeType is the protocol a request asks to switch to, "" if none.
func upgradeType(h *fasthttp.RequestHeader) string {
	if !h.ConnectionUpgrade() {
		return ""
	}
	return string(h.Peek("Upgrade"))
}

// upgrade forwards a request that asks to switch protocols on a connection of its own, and once
// the upstream answers, splices the two connections both ways until either side ends.
func (p *fastProxy) upgrade(ctx *fasthttp.RequestCtx, protocol string) {
	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	up, err := p.dialUpgrade(dctx)
	if err != nil {
		ctx.SetStatusCode(p.metrics.failed(err))
		return
	}
	req := &ctx.Request
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", protocol)
	bw := bufio.NewWriter(up)
	if err := req.Write(bw); err != nil || bw.Flush() != nil {
		_ = up.Close()
		ctx.SetStatusCode(http.StatusBadGateway)
		return
	}
	// The connection belongs to the two ends once the upstream switches protocols; until then it
	// is HTTP, and an upstream that answers anything but 101 gets its answer relayed and the
	// connection closed, so that no later request on it bypasses the limits.
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(func(client net.Conn) {
		defer p.panics.goroutine("proxy")
		defer func() { _ = up.Close() }()
		br := bufio.NewReader(up)
		if p.headerTimeout > 0 {
			_ = up.SetReadDeadline(time.Now().Add(p.headerTimeout))
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			if status := p.metrics.failed(err); status == http.StatusGatewayTimeout {
				_, _ = io.WriteString(client, "HTTP/1.1 504 Gateway Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			}
			return
		}
		_ = up.SetReadDeadline(time.Time{}) // the upgraded connection may idle any time
		defer func() { _ = resp.Body.Close() }()
		if resp.StatusCode != http.StatusSwitchingProtocols {
			resp.Close = true
			_ = resp.Write(client)
			return
		}
		head := bufio.NewWriter(client)
		_, _ = head.WriteString("HTTP/1.1 101 Switching Protocols\r\n")
		_ = resp.Header.Write(head)
		_, _ = head.WriteString("\r\n")
		if head.Flush() != nil {
			return
		}
		var wg sync.WaitGroup
		wg.Go(func() {
			_, _ = io.Copy(up, client)
			closeWrite(up)
		})
		_, _ = io.Copy(client, br) // what the upstream sent after its 101 first
		closeWrite(client)
		wg.Wait()
	})
}

// closeWrite half-closes a connection, so the other end sees the end of the stream and still
// sends what it has.
func closeWrite(c net.Conn) {
	type closeWriter interface{ CloseWrite() error }
	for {
		switch v := c.(type) {
		case closeWriter:
			_ = v.CloseWrite()
			return
		case interface{ NetConn() net.Conn }:
			c = v.NetConn()
			continue
		}
		_ = c.Close()
		return
	}
}

// newProxyServer serves the proxy's HTTP/1.1 with the limits of the check API: readTimeout to read
// a request's header block, idleTimeout between requests, 64 KiB of header. Bodies stream: up to
// 64 KiB is read before the handler runs, the rest while it is forwarded, so uploads of any size
// pass.
func newProxyServer(h fasthttp.RequestHandler, log logr.Logger, readTimeout, idleTimeout time.Duration) *fasthttp.Server {
	return &fasthttp.Server{
		Handler:                      h,
		IdleTimeout:                  idleTimeout,
		ReduceMemoryUsage:            true, // an idle connection releases its write buffer; the 64 KiB read buffer stays, as streamed request bodies need it
		ReadTimeout:                  readTimeout,
		ReadBufferSize:               64 << 10, // fasthttp's header size limit
		StreamRequestBody:            true,
		MaxRequestBodySize:           64 << 10, // read ahead; the rest streams
		DisablePreParseMultipartForm: true,
		NoDefaultServerHeader:        true,
		NoDefaultContentType:         true,
		Logger:                       fastLogger{log},
		ErrorHandler:                 refuseMalformed,
	}
}
