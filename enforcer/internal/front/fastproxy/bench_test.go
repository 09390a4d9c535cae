package fastproxy

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

	"github.com/sluice-dev/sluice/enforcer/internal/config"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/panics"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
	"github.com/sluice-dev/sluice/internal/settings"
)

// defaultUpstream are the default upstream options.
var defaultUpstream = upstream.Options{Connect: settings.Defaults().UpstreamConnectTimeout,
	ResponseHeader: settings.Defaults().UpstreamResponseHeaderTimeout, Idle: settings.Defaults().UpstreamIdleTimeout}

// benchPolicy counts each client, by X-Client, to a limit the benchmark never reaches.
const benchPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p0, namespace: bench}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: per-client
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: 1000000000, window: 1h}
`

// BenchmarkProxyRequest is one request through the reverse proxy in-process, with the memory
// store, against a fasthttp upstream on an in-memory listener that answers "ok": what the
// enforcer does per request beside what a bare fasthttp proxy (a HostClient forwarding, as
// bench/ceiling -mode fastproxy) does, without the kernel's part, which bench/proxy.sh measures;
// and between the two, the enforcer's upstream client forwarding alone, without the decision
// and the header rewrites.
//
//	go test -run '^$' -bench ProxyRequest -benchmem -cpu 1 ./enforcer/internal/front/fastproxy/
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
	newProxy := func(b *testing.B) *Proxy {
		b.Helper()
		l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{})})
		ps, _, err := config.Load([]byte(benchPolicy))
		if err != nil {
			b.Fatal(err)
		}
		l.SetPolicies(ps)
		u, _ := url.Parse("http://upstream")
		p, err := New(l, u, defaultUpstream, upstream.NewMetrics(prometheus.NewRegistry()), panics.New(prometheus.NewRegistry(), logr.Discard()), logr.Discard())
		if err != nil {
			b.Fatal(err)
		}
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
	b.Run("enforcer-memory-store", func(b *testing.B) { run(b, newProxy(b).Serve) })
}
