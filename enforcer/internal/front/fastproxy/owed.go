package fastproxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/conns"
	"github.com/sluice-dev/sluice/enforcer/internal/fastserve"
	"github.com/sluice-dev/sluice/enforcer/internal/seam"
)

// forwardOwing forwards a request that owes the charges of its response, on the pooled client,
// through an upstream response of its own, whose body stream the client's response reads
// through owedBody: fasthttp closes that stream once its last byte is written to the client, or
// once writing to the client fails, and the request ends then (Owed.End), with the response's
// status and fields, trailers included. A response without a body ends it at once. A pooled
// request cannot be cancelled: one whose client left is charged by the response the upstream
// gives all the same. Requests that hold slots go by forwardHeld.
func (p *Proxy) forwardOwing(ctx *fasthttp.RequestCtx, req *fasthttp.Request, v seam.Owed) {
	up := fasthttp.AcquireResponse()
	if err := p.client.Do(req, up); err != nil {
		fasthttp.ReleaseResponse(up)
		ctx.Response.Reset()
		status := p.metrics.Failed(err)
		ctx.SetStatusCode(status)
		p.log.V(1).Info("Upstream request failed", "error", err.Error())
		v.End(status, nil)
		return
	}
	up.Header.CopyTo(&ctx.Response.Header)
	if up.BodyStream() == nil {
		ctx.Response.SetBody(up.Body())
		v.End(up.StatusCode(), fastFields(&up.Header))
		fasthttp.ReleaseResponse(up)
		return
	}
	ctx.Response.SetBodyStream(&owedBody{up: up, client: &ctx.Response.Header, v: v}, up.Header.ContentLength())
}

// forwardHeld forwards a request that holds a concurrency slot on an upstream connection of its
// own, which the pooled client cannot give, so that the request's work at the upstream ends
// when its client leaves: from the moment the request is sent to the end of its response, the
// client's connection is watched (conns.WatchClient), and a client that leaves closes the upstream
// connection, ending the request there, and its slot is freed at once. The response is relayed
// as forwardOwing relays it. A request that holds a slot is one of a few in flight, so a
// connection of its own costs little.
func (p *Proxy) forwardHeld(ctx *fasthttp.RequestCtx, req *fasthttp.Request, o seam.Owed) {
	// The upstream connection is this request's alone: Connection: close on it, but not on the
	// client's, which the server reads to keep the client's connection alive.
	closes := req.Header.ConnectionClose()
	req.SetConnectionClose()
	conn := p.sendOwn(ctx, req, o)
	if !closes {
		req.Header.ResetConnectionClose()
	}
	if conn == nil {
		return
	}
	watch := conns.WatchClient(ctx.Conn(), conn)
	up := fasthttp.AcquireResponse()
	up.StreamBody, up.SkipBody = true, req.Header.IsHead()
	if p.headerTimeout > 0 {
		_ = conn.SetReadDeadline(time.Now().Add(p.headerTimeout))
	}
	if err := up.Read(bufio.NewReaderSize(conn, seam.MaxHeaderBytes)); err != nil { // the buffer bounds the header block
		gone := watch.Stop()
		_ = conn.Close()
		fasthttp.ReleaseResponse(up)
		if gone {
			p.limiter.Left()
			fastserve.Abandon(ctx)
			o.End(0, nil)
			return
		}
		status := p.metrics.Failed(err)
		ctx.SetStatusCode(status)
		p.log.V(1).Info("Upstream request failed", "error", err.Error())
		o.End(status, nil)
		return
	}
	_ = conn.SetReadDeadline(time.Time{}) // a streamed response may last any time
	up.Header.CopyTo(&ctx.Response.Header)
	if up.BodyStream() == nil {
		watch.Stop()
		_ = conn.Close()
		o.End(up.StatusCode(), fastFields(&up.Header))
		fasthttp.ReleaseResponse(up)
		return
	}
	ctx.Response.SetBodyStream(&owedBody{up: up, client: &ctx.Response.Header, v: o, conn: conn, watch: watch}, up.Header.ContentLength())
}

// owedBody relays an upstream response's body to the client's response, and its trailers once
// it ends, and ends the request when fasthttp closes it; with forwardHeld, it stops watching
// the client then, and closes the request's own upstream connection.
type owedBody struct {
	up     *fasthttp.Response
	client *fasthttp.ResponseHeader
	v      seam.Owed
	conn   net.Conn
	watch  *conns.Watch
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
		b.watch.Stop() // before the server reads the client's next request
	}
	if b.ended {
		b.v.End(b.up.StatusCode(), fastFields(&b.up.Header))
	} else {
		b.v.Cut(b.up.StatusCode(), fastFields(&b.up.Header)) // its client left, or the upstream broke off
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

// sendOwn sends req to the upstream on a connection of its own, which it returns; or, when the
// upstream cannot be reached or written to, answers the failure, ends the request and returns
// nil.
func (p *Proxy) sendOwn(ctx *fasthttp.RequestCtx, req *fasthttp.Request, o seam.Owed) net.Conn {
	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := p.dial(dctx)
	if err != nil {
		status := p.metrics.Failed(err)
		ctx.SetStatusCode(status)
		o.End(status, nil)
		return nil
	}
	bw := bufio.NewWriter(conn)
	if err := req.Write(bw); err != nil || bw.Flush() != nil {
		_ = conn.Close()
		ctx.SetStatusCode(http.StatusBadGateway)
		o.End(http.StatusBadGateway, nil)
		return nil
	}
	return conn
}
