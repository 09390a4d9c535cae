// Package fastserve is what the front ends on fasthttp (the proxy's HTTP/1.1 and the check API)
// share: reading a request's fields for the seam, answering a request fasthttp could not read,
// and leaving a client seen to have left unanswered.
package fastserve

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"unsafe"

	"github.com/go-logr/logr"
	"github.com/valyala/fasthttp"
)

// Header reads fasthttp's request header as a policy.Header.
type Header struct{ H *fasthttp.RequestHeader }

// Values implements policy.Header.
func (f Header) Values(name string) []string {
	var values []string
	for _, v := range f.H.PeekAll(name) {
		values = append(values, string(v))
	}
	return values
}

// Peer is the address of a request's TCP peer.
func Peer(ctx *fasthttp.RequestCtx) netip.Addr {
	if a, ok := ctx.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// B2S is a string that shares a byte slice's memory, for reading fasthttp's request fields
// during the request, which owns them: nothing may keep it past the handler.
func B2S(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// Abandon closes the connection of a client seen to have left (conns.Hold, conns.WatchClient)
// without answering its request. fasthttp would otherwise write the response as it stands, a 200
// with no body; and the end of the stream that MSG_PEEK sees is also what a client sends that
// only half-closed its connection once its request was sent, which reads on: it must not read a
// 200 that no upstream gave. nginx does the same with a client it sees leave (its 499).
func Abandon(ctx *fasthttp.RequestCtx) {
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(func(net.Conn) {}) // fasthttp closes the connection once this returns
}

// RefuseMalformed answers a request the check API or the proxy could not read with the status
// that says why: fasthttp's servers' ErrorHandler.
func RefuseMalformed(ctx *fasthttp.RequestCtx, err error) {
	var small *fasthttp.ErrSmallBuffer
	var netErr net.Error
	switch {
	case errors.As(err, &small):
		ctx.Error("request header over 64 KiB", http.StatusRequestHeaderFieldsTooLarge)
	case errors.Is(err, fasthttp.ErrBodyTooLarge): // the check API's only: the proxy streams bodies
		ctx.Error("request body over 64 KiB: the check API needs none", http.StatusRequestEntityTooLarge)
	case errors.As(err, &netErr) && netErr.Timeout():
		ctx.Error("request not read in time", http.StatusRequestTimeout)
	default:
		ctx.Error("malformed request", http.StatusBadRequest)
	}
}

// Logger sends a fasthttp server's connection errors to the structured log, at debug level: they
// are clients' faults (timeouts, malformed requests), one per bad connection.
type Logger struct {
	Log    logr.Logger
	Server string
}

// Printf implements fasthttp.Logger.
func (l Logger) Printf(format string, args ...any) {
	l.Log.V(1).Info("Connection error", "server", l.Server, "error", fmt.Sprintf(format, args...))
}
