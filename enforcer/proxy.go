package enforcer

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
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
		// The response header's limit: fasthttp's default, 4 KiB, made an upstream's larger
		// cookies a 502. Held per request in flight, not per idle connection.
		ReadBufferSize: MaxHeaderBytes,
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
		method:       b2s(req.Header.Method()),
		target:       b2s(req.Header.RequestURI()),
		header:       fastHeader{&req.Header},
		peer:         remoteAddr(ctx),
		seesResponse: true,
	})
	if v.status != http.StatusOK {
		ctx.SetStatusCode(v.status)
		ctx.SetBody(v.write(resp.Set))
		return
	}
	if o := v.owed(); o.owes() {
		// Every path below ends the request once, some of them after the handler returns; a
		// panic on the way ends it here, before the panic is answered 500.
		defer func() {
			if r := recover(); r != nil {
				o.end(0, nil)
				panic(r)
			}
		}()
	}
	if !holdConn(ctx.Conn(), v.Wait) {
		p.limiter.Left()
		v.owed().drop()
		abandon(ctx)
		return
	}
	p.rewrite(ctx, req)
	if upgrade != "" {
		p.upgrade(ctx, upgrade, v.owed())
		return
	}
	// The body of a long upload arrives while the request is forwarded, past the deadline the
	// server set for reading the request.
	if req.IsBodyStream() {
		_ = ctx.Conn().SetReadDeadline(time.Time{})
	}
	if o := v.owed(); o.holds() {
		p.forwardHeld(ctx, req, o)
	} else if o.owes() {
		p.forwardOwing(ctx, req, o)
	} else if err := p.client.Do(req, &ctx.Response); err != nil {
		ctx.Response.Reset()
		ctx.SetStatusCode(p.metrics.failed(err))
		p.log.V(1).Info("Upstream request failed", "error", err.Error())
	}
	removeHopHeaders(&ctx.Response.Header)
	// After the upstream's fields, which the response now holds.
	v.write(ctx.Response.Header.Set)
	if len(req.Header.RawHeaders()) > maxIdleHeaderBytes || largeHeader(&ctx.Response.Header) {
		// fasthttp keeps a connection's request and response buffers at their largest while it
		// idles: a connection that carried a large header block, either way, is closed, not
		// kept holding them.
		ctx.SetConnectionClose()
	}
}

// forwardOwing forwards a request that owes the charges of its response, on the pooled client,
// through an upstream response of its own, whose body stream the client's response reads
// through owedBody: fasthttp closes that stream once its last byte is written to the client, or
// once writing to the client fails, and the request ends then (owed.end), with the response's
// status and fields, trailers included. A response without a body ends it at once. A pooled
// request cannot be cancelled: one whose client left is charged by the response the upstream
// gives all the same. Requests that hold slots go by forwardHeld.
func (p *fastProxy) forwardOwing(ctx *fasthttp.RequestCtx, req *fasthttp.Request, v owed) {
	up := fasthttp.AcquireResponse()
	if err := p.client.Do(req, up); err != nil {
		fasthttp.ReleaseResponse(up)
		ctx.Response.Reset()
		status := p.metrics.failed(err)
		ctx.SetStatusCode(status)
		p.log.V(1).Info("Upstream request failed", "error", err.Error())
		v.end(status, nil)
		return
	}
	up.Header.CopyTo(&ctx.Response.Header)
	if up.BodyStream() == nil {
		ctx.Response.SetBody(up.Body())
		v.end(up.StatusCode(), fastFields(&up.Header))
		fasthttp.ReleaseResponse(up)
		return
	}
	ctx.Response.SetBodyStream(&owedBody{up: up, client: &ctx.Response.Header, v: v}, up.Header.ContentLength())
}

// forwardHeld forwards a request that holds a concurrency slot on an upstream connection of its
// own, which the pooled client cannot give, so that the request's work at the upstream ends
// when its client leaves: from the moment the request is sent to the end of its response, the
// client's connection is watched (clientWatch), and a client that leaves closes the upstream
// connection, ending the request there, and its slot is freed at once. The response is relayed
// as forwardOwing relays it. A request that holds a slot is one of a few in flight, so a
// connection of its own costs little.
func (p *fastProxy) forwardHeld(ctx *fasthttp.RequestCtx, req *fasthttp.Request, o owed) {
	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := p.dialUpgrade(dctx)
	if err != nil {
		status := p.metrics.failed(err)
		ctx.SetStatusCode(status)
		o.end(status, nil)
		return
	}
	// The upstream connection is this request's alone: Connection: close on it, but not on the
	// client's, which the server reads to keep the client's connection alive.
	closes := req.Header.ConnectionClose()
	req.SetConnectionClose()
	bw := bufio.NewWriter(conn)
	err = req.Write(bw)
	if err == nil {
		err = bw.Flush()
	}
	if !closes {
		req.Header.ResetConnectionClose()
	}
	if err != nil {
		_ = conn.Close()
		ctx.SetStatusCode(http.StatusBadGateway)
		o.end(http.StatusBadGateway, nil)
		return
	}
	watch := watchClient(ctx.Conn(), conn)
	up := fasthttp.AcquireResponse()
	up.StreamBody, up.SkipBody = true, req.Header.IsHead()
	if p.headerTimeout > 0 {
		_ = conn.SetReadDeadline(time.Now().Add(p.headerTimeout))
	}
	if err := up.Read(bufio.NewReaderSize(conn, MaxHeaderBytes)); err != nil { // the buffer bounds the header block
		gone := watch.stop()
		_ = conn.Close()
		fasthttp.ReleaseResponse(up)
		if gone {
			p.limiter.Left()
			abandon(ctx)
			o.end(0, nil)
			return
		}
		status := p.metrics.failed(err)
		ctx.SetStatusCode(status)
		p.log.V(1).Info("Upstream request failed", "error", err.Error())
		o.end(status, nil)
		return
	}
	_ = conn.SetReadDeadline(time.Time{}) // a streamed response may last any time
	up.Header.CopyTo(&ctx.Response.Header)
	if up.BodyStream() == nil {
		watch.stop()
		_ = conn.Close()
		o.end(up.StatusCode(), fastFields(&up.Header))
		fasthttp.ReleaseResponse(up)
		return
	}
	ctx.Response.SetBodyStream(&owedBody{up: up, client: &ctx.Response.Header, v: o, conn: conn, watch: watch}, up.Header.ContentLength())
}

// abandon closes the connection of a client seen to have left (holdConn, clientWatch) without
// answering its request. fasthttp would otherwise write the response as it stands, a 200 with
// no body; and the end of the stream that MSG_PEEK sees is also what a client sends that only
// half-closed its connection once its request was sent, which reads on: it must not read a 200
// that no upstream gave. nginx does the same with a client it sees leave (its 499).
func abandon(ctx *fasthttp.RequestCtx) {
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(func(net.Conn) {}) // fasthttp closes the connection once this returns
}

// owedBody relays an upstream response's body to the client's response, and its trailers once
// it ends, and ends the request when fasthttp closes it; with forwardHeld, it stops watching
// the client then, and closes the request's own upstream connection.
type owedBody struct {
	up     *fasthttp.Response
	client *fasthttp.ResponseHeader
	v      owed
	conn   net.Conn
	watch  *clientWatch
	// ended is set once the upstream's body has been read to its end, trailers included.
	ended bool
}

func (b *owedBody) Read(buf []byte) (int, error) {
	n, err := b.up.BodyStream().Read(buf)
	if errors.Is(err, io.EOF) {
		b.ended = true
		// The upstream's trailers have been read into its header: the client's response
		// announced them (the copied header), and writes them after the body.
		for name := range b.up.Header.Trailers() {
			for i, value := range b.up.Header.PeekAll(string(name)) {
				if i == 0 {
					b.client.SetBytesKV(name, value)
				} else {
					b.client.AddBytesKV(name, value)
				}
			}
		}
	}
	return n, err
}

// CloseWithError is how fasthttp closes the stream, with the error that stopped its write to
// the client, if any.
func (b *owedBody) CloseWithError(err error) error {
	if b.watch != nil {
		b.watch.stop() // before the server reads the client's next request
	}
	if b.ended {
		b.v.end(b.up.StatusCode(), fastFields(&b.up.Header))
	} else {
		b.v.cut(b.up.StatusCode(), fastFields(&b.up.Header)) // its client left, or the upstream broke off
	}
	var cerr error
	if s, ok := b.up.BodyStream().(fasthttp.ReadCloserWithError); ok {
		cerr = s.CloseWithError(err)
	} else {
		cerr = b.up.CloseBodyStream()
	}
	if b.conn != nil {
		_ = b.conn.Close()
	}
	fasthttp.ReleaseResponse(b.up)
	return cerr
}

// fastFields reads a response field's values from a fasthttp response header, trailers
// included, as copies.
func fastFields(h *fasthttp.ResponseHeader) func(name string) []string {
	return func(name string) []string {
		var values []string
		for _, v := range h.PeekAll(name) {
			values = append(values, string(v))
		}
		return values
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
// the upstream answers, splices the two connections both ways until either side ends; the
// request ends then (v.end), an upgraded connection holding its concurrency slot to its end.
func (p *fastProxy) upgrade(ctx *fasthttp.RequestCtx, protocol string, v owed) {
	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	up, err := p.dialUpgrade(dctx)
	if err != nil {
		status := p.metrics.failed(err)
		ctx.SetStatusCode(status)
		v.end(status, nil)
		return
	}
	req := &ctx.Request
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", protocol)
	bw := bufio.NewWriter(up)
	if err := req.Write(bw); err != nil || bw.Flush() != nil {
		_ = up.Close()
		ctx.SetStatusCode(http.StatusBadGateway)
		v.end(http.StatusBadGateway, nil)
		return
	}
	// The connection belongs to the two ends once the upstream switches protocols; until then it
	// is HTTP, and an upstream that answers anything but 101 gets its answer relayed and the
	// connection closed, so that no later request on it bypasses the limits.
	ctx.HijackSetNoResponse(true)
	// The request ends when the function ends: fasthttp runs it once the handler returns (it
	// would not only if it could not clear the connection's deadlines, a connection it closed
	// itself; the lease then lasts to its timeout).
	status, fields := 0, (func(string) []string)(nil)
	ctx.Hijack(func(client net.Conn) {
		defer func() { v.end(status, fields) }()
		defer p.panics.goroutine("proxy")
		defer func() { _ = up.Close() }()
		br := bufio.NewReader(up)
		if p.headerTimeout > 0 {
			_ = up.SetReadDeadline(time.Now().Add(p.headerTimeout))
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			if status = p.metrics.failed(err); status == http.StatusGatewayTimeout {
				_, _ = io.WriteString(client, "HTTP/1.1 504 Gateway Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			}
			return
		}
		status, fields = resp.StatusCode, resp.Header.Values
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
		ReadBufferSize:               MaxHeaderBytes, // fasthttp's header size limit
		StreamRequestBody:            true,
		MaxRequestBodySize:           64 << 10, // read ahead; the rest streams
		DisablePreParseMultipartForm: true,
		NoDefaultServerHeader:        true,
		NoDefaultContentType:         true,
		Logger:                       fastLogger{log},
		ErrorHandler:                 refuseMalformed,
	}
}
