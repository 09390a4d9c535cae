package enforcer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"google.golang.org/grpc"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/sluice-dev/sluice/enforcer/internal/conns"
	"github.com/sluice-dev/sluice/enforcer/internal/front/check"
	"github.com/sluice-dev/sluice/enforcer/internal/front/fastproxy"
	"github.com/sluice-dev/sluice/enforcer/internal/front/netproxy"
	"github.com/sluice-dev/sluice/enforcer/internal/front/rls"
	"github.com/sluice-dev/sluice/enforcer/internal/seam"
	"github.com/sluice-dev/sluice/enforcer/internal/sniff"
	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
)

// The servers: each front end behind its listener, with the limits every listener keeps against
// slow and oversized clients, and a drain at the stop.

// server is one of the enforcer's listeners: its name, where its address is reported, the
// address to listen on (none: not served) and how it serves.
type server struct {
	name   string
	addr   *string
	listen string
	serve  func(net.Listener) func(context.Context) error
}

// servers are the enforcer's listeners: the proxy, the check API, the rate limit service and the
// admin server, the last.
func (e *Enforcer) servers(reg *prometheus.Registry) ([]server, error) {
	cfg := e.cfg
	proxy, err := e.proxy(reg)
	return []server{
		{"proxy", &e.ProxyAddr, cfg.Listen, proxy},
		{"check", &e.CheckAddr, cfg.CheckListen, e.serveCheck(&check.API{Limiter: e.limiter, Pool: cfg.Pool != nil})},
		{"rls", &e.RLSAddr, cfg.RLSListen, e.serveRLS(&rls.Server{Limiter: e.limiter})},
		{"admin", &e.AdminAddr, cfg.AdminListen, e.serveHTTP(e.panics.HTTP("admin", e.admin(reg)))},
	}, err
}

// listenAndServe binds every server's listener before any serves, so that a bind failure starts
// nothing and /readyz (the admin server, last) answers only once every port accepts.
func (e *Enforcer) listenAndServe(servers []server) error {
	lns := make([]net.Listener, len(servers))
	for i, s := range servers {
		if s.listen == "" || s.serve == nil {
			continue
		}
		ln, err := net.Listen("tcp", s.listen)
		if err != nil {
			for _, bound := range lns[:i] {
				if bound != nil {
					_ = bound.Close()
				}
			}
			return fmt.Errorf("listen on %s: %w", s.listen, err)
		}
		*s.addr, lns[i] = ln.Addr().String(), ln
	}
	traffic := conns.NewBudget(e.cfg.MaxConns, e.cfg.MaxConnsPerClient)
	for i, s := range servers {
		if lns[i] == nil {
			continue
		}
		budget := traffic
		if s.name == "admin" {
			budget = conns.NewBudget(conns.AdminMaxConns, conns.AdminMaxConnsPerClient)
		}
		ln := conns.Guard(lns[i], s.name, conns.Limits{Budget: budget, WriteTimeout: e.cfg.WriteTimeout, HTTP: s.name != "rls"}, e.conns)
		if shutdown := s.serve(ln); s.name == "admin" {
			e.adminShutdown = shutdown
		} else {
			e.shutdowns = append(e.shutdowns, shutdown)
		}
	}
	return nil
}

// proxy serves the reverse proxy, or nil without an upstream: fasthttp in front of a plain
// HTTP/1.1 upstream (and net/http for h2c clients beside it), net/http alone in front of TLS
// and HTTP/2 upstreams.
func (e *Enforcer) proxy(reg *prometheus.Registry) (func(net.Listener) func(context.Context) error, error) {
	cfg := e.cfg
	if cfg.Upstream == nil {
		return nil, nil
	}
	um := upstream.NewMetrics(reg)
	o := upstreamOptions(cfg)
	h2 := e.panics.HTTP("proxy", netproxy.New(e.limiter, cfg.Upstream, netproxy.NewTransport(cfg.Upstream, o), cfg.WriteTimeout, um, cfg.Log))
	if cfg.Upstream.Scheme != "http" {
		return e.serveHTTP(h2), nil
	}
	fast, err := fastproxy.New(e.limiter, cfg.Upstream, o, um, e.panics, cfg.Log)
	if err != nil {
		return nil, err
	}
	return e.serveProxy(fast, h2), nil
}

// upstreamOptions are the hop's settings in a Config.
func upstreamOptions(cfg Config) upstream.Options {
	return upstream.Options{TLS: cfg.UpstreamTLS, Connect: cfg.UpstreamConnectTimeout, ResponseHeader: cfg.UpstreamResponseHeaderTimeout, Idle: cfg.UpstreamIdleTimeout}
}

// serveHTTP returns a function that runs a net/http server for h with limits against slow and
// oversized clients, cleartext HTTP/2 (h2c) beside HTTP/1.1, and returns its shutdown. Nil for a
// nil handler.
func (e *Enforcer) serveHTTP(h http.Handler) func(net.Listener) func(context.Context) error {
	if h == nil {
		return nil
	}
	return func(ln net.Listener) func(context.Context) error {
		var protocols http.Protocols
		protocols.SetHTTP1(true)
		protocols.SetUnencryptedHTTP2(true)
		srv := &http.Server{
			Handler:           h,
			ReadHeaderTimeout: e.cfg.ReadTimeout,
			IdleTimeout:       e.cfg.IdleTimeout,
			MaxHeaderBytes:    maxHeaderBytes,
			Protocols:         &protocols,
			HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: seam.MaxStreams},
			ConnContext:       netproxy.WithConn,
		}
		return e.run(func() error {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		}, srv.Shutdown)
	}
}

// serveProxy returns a function that serves the proxy and returns its shutdown: fasthttp serves
// HTTP/1.1 (and upgrades), and the connections that open with the HTTP/2 preface go to a
// net/http server for cleartext HTTP/2 (h2c), which fasthttp does not speak.
func (e *Enforcer) serveProxy(fast *fastproxy.Proxy, h2 http.Handler) func(net.Listener) func(context.Context) error {
	return func(ln net.Listener) func(context.Context) error {
		split := sniff.Split(ln, e.cfg.ReadTimeout)
		srv := fastproxy.NewServer(e.panics.Fast("proxy", fast.Serve), e.cfg.Log, e.cfg.ReadTimeout, e.cfg.IdleTimeout)
		shutdownH1 := e.run(func() error {
			if err := srv.Serve(split.H1()); !errors.Is(err, net.ErrClosed) {
				return err
			}
			return nil
		}, srv.ShutdownWithContext)
		shutdownH2 := e.serveHTTP(h2)(split.H2())
		return func(ctx context.Context) error {
			_ = split.Close() // no new connections, of either kind
			var wg sync.WaitGroup
			var err1, err2 error
			wg.Go(func() { err1 = shutdownH1(ctx) })
			wg.Go(func() { err2 = shutdownH2(ctx) })
			wg.Wait()
			return errors.Join(err1, err2)
		}
	}
}

// maxHeaderBytes makes net/http answer 431 to a request line and header block over 64 KiB, as
// the check API does: it reads MaxHeaderBytes plus 4096 bytes of slack, and with h2c on it
// reads the first bytes of a connection, as long as "PRI * HTTP/2.0", to sniff for the HTTP/2
// preface before it starts counting.
const maxHeaderBytes = seam.MaxHeaderBytes - 4096 - len("PRI * HTTP/2.0")

// serveCheck returns a function that runs the check API's server and returns its shutdown.
func (e *Enforcer) serveCheck(c *check.API) func(net.Listener) func(context.Context) error {
	return func(ln net.Listener) func(context.Context) error {
		srv := check.NewServer(e.panics.Fast("check", c.Serve), e.cfg.Log, e.cfg.ReadTimeout, e.cfg.IdleTimeout)
		return e.serveFast(srv, ln)
	}
}

// serveFast runs a fasthttp server on ln and returns its shutdown.
func (e *Enforcer) serveFast(srv *fasthttp.Server, ln net.Listener) func(context.Context) error {
	var shutdown atomic.Bool
	serve := func() error {
		err := srv.Serve(ln)
		if shutdown.Load() {
			return nil
		}
		return err
	}
	// fasthttp's shutdown knows only a listener that Serve has begun to accept on: one that came
	// before would leave Serve accepting for ever. Closing the listener after it ends Serve
	// however the two interleave.
	return e.run(serve, func(ctx context.Context) error {
		shutdown.Store(true)
		err := srv.ShutdownWithContext(ctx)
		_ = ln.Close()
		return err
	})
}

// serveRLS returns a function that serves Envoy's rate limit service over gRPC, with the
// standard gRPC health service, and returns its shutdown: in-flight calls finish, within the
// drain's deadline.
func (e *Enforcer) serveRLS(s *rls.Server) func(net.Listener) func(context.Context) error {
	return func(ln net.Listener) func(context.Context) error {
		srv := grpc.NewServer(append(e.panics.GRPC(),
			grpc.MaxRecvMsgSize(rls.MaxMessageBytes),
			grpc.MaxConcurrentStreams(seam.MaxStreams),
			grpc.ConnectionTimeout(e.cfg.ReadTimeout),
			grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: e.cfg.IdleTimeout}),
		)...)
		rlsv3.RegisterRateLimitServiceServer(srv, s)
		health := grpchealth.NewServer()
		health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		health.SetServingStatus(rlsv3.RateLimitService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
		healthpb.RegisterHealthServer(srv, health)
		return e.run(func() error { return srv.Serve(ln) }, func(ctx context.Context) error {
			health.Shutdown() // NOT_SERVING: Envoy's health checks stop sending
			done := make(chan struct{})
			go func() {
				srv.GracefulStop()
				close(done)
			}()
			select {
			case <-done:
				return nil
			case <-ctx.Done():
				srv.Stop()
				return ctx.Err()
			}
		})
	}
}

// run serves in the background and returns shutdown.
func (e *Enforcer) run(serve func() error, shutdown func(context.Context) error) func(context.Context) error {
	e.wg.Go(func() {
		if err := serve(); err != nil {
			select {
			case e.errs <- err:
			default: // the enforcer is stopping already
			}
		}
	})
	return shutdown
}
