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
	"github.com/valyala/fasthttp"
	"google.golang.org/grpc"
)

type upstreamConn struct {
	net.Conn
	r *bufio.Reader
	w *bufio.Writer
}

func main() {
	mode := flag.String("mode", "hello", "hello, proxy, reverseproxy, fasthello, fastproxy or rls")
	listen := flag.String("listen", "127.0.0.1:18290", "address to serve")
	upstream := flag.String("upstream", "127.0.0.1:18180", "upstream host:port (proxy modes)")
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
