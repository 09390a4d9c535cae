// Command ceiling measures what Go's HTTP servers allow on this machine, to put the enforcer's
// proxy numbers in context: run one mode, point wrk at -listen.
//
//	hello          a net/http handler that answers 200 ok: the server alone
//	proxy          the leanest net/http HTTP/1.1 proxy: the server, and one pooled upstream
//	               connection written and read by the handler's own goroutine
//	reverseproxy   httputil.ReverseProxy with http.Transport (MaxIdleConnsPerHost 4096)
//	fasthello      a fasthttp handler that answers 200 ok
//	fastproxy      a fasthttp server forwarding each request with a fasthttp.HostClient: the
//	               fastest Go HTTP/1.1 proxy of the field's libraries, without any decision
//	fastproxy-redis  fastproxy that first runs one trivial script (return 1) per request against
//	               -redis, in pipelines as the enforcer's Redis store sends them (4 dispatchers,
//	               each taking every waiting request, at most 64): the Redis proxy's ceiling
//	fastcheck-redis  a fasthttp server that runs the same script per request and answers 200:
//	               the check API's ceiling on Redis
//	rls            a grpc-go server of Envoy's rate limit service that answers every call OK
//	               without deciding anything: measure it with bench/rlsload
//
// It is a measuring tool, not a proxy: no hop-by-hop headers, bodies, upgrades or timeouts.
package main

import (
	"bufio"
	"context"
	"flag"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"github.com/valyala/fasthttp"
	"google.golang.org/grpc"
)

type upstreamConn struct {
	net.Conn
	r *bufio.Reader
	w *bufio.Writer
}

func main() {
	mode := flag.String("mode", "hello", "hello, proxy, reverseproxy, fasthello, fastproxy, fastproxy-redis, fastcheck-redis or rls")
	listen := flag.String("listen", "127.0.0.1:18290", "address to serve")
	upstream := flag.String("upstream", "127.0.0.1:18180", "upstream host:port (proxy modes)")
	redisAddr := flag.String("redis", "127.0.0.1:18185", "Redis host:port (the -redis modes)")
	flag.Parse()

	var h http.Handler
	switch *mode {
	case "rls":
		ln, err := net.Listen("tcp", *listen)
		if err != nil {
			log.Fatal(err)
		}
		srv := grpc.NewServer()
		rlsv3.RegisterRateLimitServiceServer(srv, okRLS{})
		log.Fatal(srv.Serve(ln))
	case "fasthello":
		log.Fatal(fasthttp.ListenAndServe(*listen, func(ctx *fasthttp.RequestCtx) { ctx.SetBodyString("ok\n") }))
	case "fastproxy":
		hc := &fasthttp.HostClient{Addr: *upstream, MaxConns: 4096}
		log.Fatal(fasthttp.ListenAndServe(*listen, func(ctx *fasthttp.RequestCtx) {
			if err := hc.Do(&ctx.Request, &ctx.Response); err != nil {
				ctx.Error(err.Error(), fasthttp.StatusBadGateway)
			}
		}))
	case "fastproxy-redis", "fastcheck-redis":
		p := newPipeliner(*redisAddr)
		hc := &fasthttp.HostClient{Addr: *upstream, MaxConns: 4096}
		forward := *mode == "fastproxy-redis"
		log.Fatal(fasthttp.ListenAndServe(*listen, func(ctx *fasthttp.RequestCtx) {
			if err := p.run(ctx.Request.Header.Peek("X-Client")); err != nil {
				ctx.Error(err.Error(), fasthttp.StatusServiceUnavailable)
				return
			}
			if !forward {
				ctx.SetBodyString("ok\n")
				return
			}
			if err := hc.Do(&ctx.Request, &ctx.Response); err != nil {
				ctx.Error(err.Error(), fasthttp.StatusBadGateway)
			}
		}))
	case "hello":
		h = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	case "reverseproxy":
		rp := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: "http", Host: *upstream})
		rp.Transport = &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096}
		h = rp
	case "proxy":
		idle := make(chan *upstreamConn, 4096)
		h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var c *upstreamConn
			select {
			case c = <-idle:
			default:
				nc, err := net.Dial("tcp", *upstream)
				if err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				c = &upstreamConn{Conn: nc, r: bufio.NewReader(nc), w: bufio.NewWriter(nc)}
			}
			out := r.Clone(r.Context())
			out.RequestURI, out.URL.Scheme, out.URL.Host = "", "http", *upstream
			err := out.Write(c.w)
			if err == nil {
				err = c.w.Flush()
			}
			var resp *http.Response
			if err == nil {
				resp, err = http.ReadResponse(c.r, out)
			}
			if err != nil {
				_ = c.Close()
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			for k, v := range resp.Header {
				w.Header()[k] = v
			}
			w.WriteHeader(resp.StatusCode)
			_, err = io.Copy(w, resp.Body)
			_ = resp.Body.Close()
			if err != nil {
				_ = c.Close()
				return
			}
			select {
			case idle <- c:
			default:
				_ = c.Close()
			}
		})
	default:
		log.Fatalf("unknown mode %q", *mode)
	}
	log.Fatal(http.ListenAndServe(*listen, h)) //nolint:gosec // a benchmark on loopback
}

// pipeliner runs one trivial script per call, the calls waiting at once in one pipeline: the
// enforcer's Redis store (its batcher) without the decision or its script's work in Redis.
type pipeliner struct {
	client *redis.Client
	script *redis.Script
	calls  chan *call
}

type call struct {
	key  string
	err  error
	done chan struct{}
}

func newPipeliner(addr string) *pipeliner {
	p := &pipeliner{
		client: redis.NewClient(&redis.Options{Addr: addr}),
		script: redis.NewScript("return 1"),
		calls:  make(chan *call, 256),
	}
	for range 4 {
		go p.dispatch()
	}
	return p
}

func (p *pipeliner) run(client []byte) error {
	c := &call{key: "ceiling{" + string(client) + "}", done: make(chan struct{})}
	p.calls <- c
	<-c.done
	return c.err
}

func (p *pipeliner) dispatch() {
	ctx := context.Background()
	batch := make([]*call, 0, 64)
	cmds := make([]*redis.Cmd, 0, 64)
	for {
		batch = append(batch[:0], <-p.calls)
	more:
		for len(batch) < cap(batch) {
			select {
			case c := <-p.calls:
				batch = append(batch, c)
			default:
				break more
			}
		}
		pipe := p.client.Pipeline()
		cmds = cmds[:0]
		for _, c := range batch {
			cmds = append(cmds, p.script.EvalSha(ctx, pipe, []string{c.key}))
		}
		_, _ = pipe.Exec(ctx)
		for i, c := range batch {
			c.err = cmds[i].Err()
			if c.err != nil && redis.HasErrorPrefix(c.err, "NOSCRIPT") {
				c.err = p.script.Eval(ctx, p.client, []string{c.key}).Err()
			}
			close(c.done)
		}
	}
}

// okRLS answers every ShouldRateLimit OK, one status per descriptor, as a service that decides
// nothing would.
type okRLS struct {
	rlsv3.UnimplementedRateLimitServiceServer
}

func (okRLS) ShouldRateLimit(_ context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK}
	for range req.GetDescriptors() {
		resp.Statuses = append(resp.Statuses, &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK})
	}
	return resp, nil
}
