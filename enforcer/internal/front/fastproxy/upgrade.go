package fastproxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/conns"
	"github.com/sluice-dev/sluice/enforcer/internal/seam"
)

// upgrade forwards a request that asks to switch protocols on a connection of its own, and once
// the upstream answers, splices the two connections both ways until either side ends; the
// request ends then (Owed.End), an upgraded connection holding its concurrency slot to its end.
func (p *Proxy) upgrade(ctx *fasthttp.RequestCtx, protocol string, v seam.Owed) {
	req := &ctx.Request
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", protocol)
	up := p.sendOwn(ctx, req, v)
	if up == nil {
		return
	}
	// The connection belongs to the two ends once the upstream switches protocols; until then it
	// is HTTP, and an upstream that answers anything but 101 gets its answer relayed and the
	// connection closed, so that no later request on it bypasses the limits.
	ctx.HijackSetNoResponse(true)
	// The request ends when the function ends: fasthttp runs it once the handler returns (it
	// would not only if it could not clear the connection's deadlines, a connection it closed
	// itself; the lease then lasts to its timeout).
	ctx.Hijack(func(client net.Conn) { p.splice(client, up, v) })
}

// splice relays the upstream's answer to an upgrade on the client's hijacked connection and, once
// the upstream switches protocols, copies both ways until either side ends; then the request
// ends, with the status the upstream answered.
func (p *Proxy) splice(client, up net.Conn, v seam.Owed) {
	status, fields := 0, (func(string) []string)(nil)
	defer func() { v.End(status, fields) }()
	defer p.panics.Goroutine("proxy")
	defer func() { _ = up.Close() }()
	br := bufio.NewReader(up)
	if p.headerTimeout > 0 {
		_ = up.SetReadDeadline(time.Now().Add(p.headerTimeout))
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		if status = p.metrics.Failed(err); status == http.StatusGatewayTimeout {
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
		conns.CloseWrite(up)
	})
	_, _ = io.Copy(client, br) // what the upstream sent after its 101 first
	conns.CloseWrite(client)
	wg.Wait()
}
