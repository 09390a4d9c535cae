package enforcer

import (
	"bufio"
	"io"
	"net"
	"net/url"
	"testing"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/fasthttputil"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
)

// BenchmarkProxyRequest is one request through the reverse proxy in-process, with the memory
// store, against a fasthttp upstream on an in-memory listener that answers "ok": what the
// enforcer does per request beside what a bare fasthttp proxy (a HostClient forwarding, as
// bench/ceiling -mode fastproxy) does, without the kernel's part, which bench/proxy.sh measures;
// and between the two, the enforcer's upstream client forwarding alone, without the decision
// and the header rewrites.
//
//	go test -run '^$' -bench ProxyRequest -benchmem -cpu 1 ./enforcer/
func BenchmarkProxyRequest(b *testing.B) {
	up := fasthttputil.NewInmemoryListener()
	srv := &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) { ctx.SetBodyString("ok") }}
	go func() { _ = srv.Serve(up) }()
	b.Cleanup(func() { _ = srv.Shutdown() })
	dial := func(string) (net.Conn, error) { return up.Dial() }

	var tmpl fasthttp.Request
	tmpl.SetRequestURI("/orders/1")
	tmpl.Header.SetHost("api.example")
	tmpl.Header.Set("X-Client", "client-1")
	tmpl.Header.Set("User-Agent", "bench")
	peer := &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 40000}
	// Each request is written out as a server writes it, which reads and closes a streamed
	// body, so that its upstream connection goes back to the pool.
	bw := bufio.NewWriter(io.Discard)
	run := func(b *testing.B, serve func(*fasthttp.RequestCtx)) {
		b.Helper()
		var ctx fasthttp.RequestCtx
		ctx.Init(&fasthttp.Request{}, peer, nil)
		b.ReportAllocs()
		for b.Loop() {
			tmpl.CopyTo(&ctx.Request)
			serve(&ctx)
			if ctx.Response.StatusCode() != fasthttp.StatusOK {
				b.Fatalf("status %d: %s", ctx.Response.StatusCode(), ctx.Response.Body())
			}
			if err := ctx.Response.Write(bw); err != nil {
				b.Fatal(err)
			}
			ctx.Response.Reset()
		}
	}

	b.Run("bare-fasthttp-proxy", func(b *testing.B) {
		hc := &fasthttp.HostClient{Addr: "upstream", Dial: dial, MaxConns: 4096}
		run(b, func(ctx *fasthttp.RequestCtx) {
			if err := hc.Do(&ctx.Request, &ctx.Response); err != nil {
				b.Fatal(err)
			}
		})
	})
	newProxy := func(b *testing.B) *fastProxy {
		b.Helper()
		l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{})})
		l.SetPolicies(poolPolicies(b, 1))
		u, _ := url.Parse("http://upstream")
		p := newFastProxy(l, u, fuzzUpstream, newUpstreamMetrics(prometheus.NewRegistry()), logr.Discard())
		p.client.Dial = dial
		return p
	}
	// The enforcer's upstream client alone (streamed responses, 64 KiB response headers): what
	// its settings cost without the decision and the header rewrites.
	b.Run("enforcer-client-alone", func(b *testing.B) {
		p := newProxy(b)
		run(b, func(ctx *fasthttp.RequestCtx) {
			if err := p.client.Do(&ctx.Request, &ctx.Response); err != nil {
				b.Fatal(err)
			}
		})
	})
	b.Run("enforcer-memory-store", func(b *testing.B) { run(b, newProxy(b).serve) })
}
