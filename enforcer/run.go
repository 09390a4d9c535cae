package enforcer

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	grpchealth "google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/buildinfo"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/settings"
)

// Config is everything the enforcer needs. cmd/enforcer fills it from flags and environment.
type Config struct {
	// PolicyFile holds one or more RateLimitPolicy documents. It is watched: a valid change
	// takes effect within ReloadInterval; an invalid one is logged and the last good one stays.
	PolicyFile string
	// ConfigMap, when set, is watched through the API server, and its policy file is applied
	// as it changes; PolicyFile then serves at start and while the watch fails.
	ConfigMap *ConfigMapSource
	// Pool, when set, makes the enforcer a replica of an EnforcerPool: it serves the policies
	// of the pool's ConfigMaps, each loaded apart, and no PolicyFile (see PoolSource).
	Pool *PoolSource
	// Upstream receives the requests that pass. Nil serves no proxy (check API only).
	Upstream *url.URL
	// Listen, CheckListen and AdminListen are the proxy, check API and admin addresses, and
	// RLSListen Envoy's rate limit service's (gRPC); empty disables the server.
	Listen, CheckListen, AdminListen, RLSListen string
	// Redis, when set, is the store; otherwise the memory store, exact for one replica only.
	Redis *store.RedisOptions
	// UpstreamTLS is the client TLS of an https upstream: its roots, the name its certificate
	// must hold, and a client certificate. Nil trusts the system roots and names the URL's host.
	UpstreamTLS *tls.Config
	// Pprof serves Go's profiles under /debug/pprof/ on the admin address.
	Pprof bool
	// Now is the enforcer's clock: the memory store's time and the refusal cache's. Default
	// time.Now. The Redis store never reads it: its decisions use Redis TIME.
	Now func() time.Time
	Log logr.Logger
	// Enforcer holds the timeouts and bounds; a field left zero takes its default
	// (settings.Defaults), but ShutdownDelay, whose zero stops at once. Every request accepted
	// before the drain is answered within ShutdownTimeout, leaky-bucket requests held in their
	// queue included; the admin listener has connection bounds of its own; neither a streamed
	// body nor an upgraded connection nor a gRPC call counts against
	// UpstreamResponseHeaderTimeout.
	settings.Enforcer
}

// RedisOptions configure the Redis store of Config.Redis: its topology, addresses, credentials,
// TLS and the deadline of each call.
type RedisOptions = store.RedisOptions

// Enforcer is a running enforcer.
type Enforcer struct {
	// ProxyAddr, CheckAddr, AdminAddr and RLSAddr are the addresses the servers listen on.
	ProxyAddr, CheckAddr, AdminAddr, RLSAddr string

	cfg     Config
	limiter *limiter.Limiter
	store   store.Store
	// shutdowns stop the proxy and check servers, draining in-flight requests; adminShutdown
	// stops the admin server last, so /readyz and /metrics answer throughout the drain.
	shutdowns     []func(context.Context) error
	adminShutdown func(context.Context) error
	wg            sync.WaitGroup
	errs          chan error
	reloads       *prometheus.CounterVec
	// stopping is set when the stop begins: /readyz fails from then on.
	stopping atomic.Bool
	// started is when Start began; served is the config in force, health the store's as the
	// last ping found it; watching is true while the ConfigMap watch delivers.
	started  time.Time
	served   atomic.Pointer[served]
	health   atomic.Pointer[report.Store]
	watching atomic.Bool
	applyMu  sync.Mutex
	// pool follows the pool's ConfigMaps, with Config.Pool.
	pool *poolWatch
	// done closes when the enforcer has stopped; err is why, if anything failed.
	done chan struct{}
	err  error
	// panics contains the request paths' panics; conns counts the listeners' connections.
	panics *panics
	conns  *connMetrics
}

// Run starts the enforcer and serves until ctx is done, then stops as Wait describes.
func Run(ctx context.Context, cfg Config) error {
	e, err := Start(ctx, cfg)
	if err != nil {
		return err
	}
	return e.Wait()
}

// Start loads the policies, opens the store, and starts the servers. When ctx is done, or a
// server fails, the enforcer stops: /readyz fails at once, the servers keep serving for
// ShutdownDelay, then stop accepting and drain the requests in flight for up to ShutdownTimeout,
// and only then is the store closed.
func Start(ctx context.Context, cfg Config) (*Enforcer, error) {
	cfg.Enforcer = cfg.WithDefaults()
	var data []byte
	var policies []*policy.Policy
	if cfg.Pool == nil {
		var err error
		if data, policies, err = loadFile(cfg); err != nil {
			return nil, err
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildinfo.Read().Collector())
	opts, err := limiterOptions(cfg, reg)
	if err != nil {
		return nil, err
	}
	e := &Enforcer{cfg: cfg, store: opts.Store, limiter: limiter.New(opts), errs: make(chan error, 3), done: make(chan struct{}),
		panics: newPanics(reg, cfg.Log), conns: newConnMetrics(reg), reloads: newReloads(reg)}
	e.started = e.now()
	if cfg.Pool != nil {
		e.pool = newPoolWatch(e)
	}
	e.limiter.SetPolicies(policies)
	if cfg.Pool == nil {
		e.served.Store(&served{Revision: report.Revision(data), Since: e.started, Source: report.SourceFile})
	} else {
		e.served.Store(&served{Since: e.started, Source: report.SourceAPI})
	}
	// The report tells the store's health from the start: a first ping, at most a second long.
	e.checkedStore(e.ping(ctx))
	servers := []server{
		{"proxy", &e.ProxyAddr, cfg.Listen, e.proxy(reg)},
		{"check", &e.CheckAddr, cfg.CheckListen, e.serveCheck(&check{limiter: e.limiter, pool: cfg.Pool != nil})},
		{"rls", &e.RLSAddr, cfg.RLSListen, e.serveRLS(&rls{limiter: e.limiter})},
		{"admin", &e.AdminAddr, cfg.AdminListen, e.serveHTTP(e.panics.http("admin", e.admin(reg)))},
	}
	if err := e.listenAndServe(servers); err != nil {
		e.stop(0)
		return nil, err
	}
	if err := e.follow(ctx); err != nil {
		e.stop(0)
		return nil, err
	}
	kv := []any{"proxy", e.ProxyAddr, "check", e.CheckAddr, "admin", e.AdminAddr, "rls", e.RLSAddr, "store", storeName(cfg)}
	if cfg.Pool != nil {
		kv = append(kv, "pool", cfg.Pool.Namespace+"/"+cfg.Pool.Name)
	} else {
		kv = append(kv, "policies", len(policies))
	}
	cfg.Log.Info("Enforcer started", kv...)
	return e, nil
}

// loadFile reads and loads the policy file the enforcer starts with.
func loadFile(cfg Config) ([]byte, []*policy.Policy, error) {
	data, err := os.ReadFile(cfg.PolicyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("load %s: %w", cfg.PolicyFile, err)
	}
	policies, warnings, err := Load(data)
	if err != nil {
		return nil, nil, fmt.Errorf("load %s: %w", cfg.PolicyFile, err)
	}
	for _, w := range warnings {
		cfg.Log.Info("Policy file: "+w, "file", cfg.PolicyFile)
	}
	return data, policies, nil
}

// limiterOptions opens the store: Redis, behind a breaker and a refusal cache, or memory.
func limiterOptions(cfg Config, reg *prometheus.Registry) (limiter.Options, error) {
	opts := limiter.Options{Metrics: limiter.NewMetrics(reg), Log: cfg.Log, Now: cfg.Now}
	if cfg.Redis == nil {
		opts.Store = store.NewMemory(store.MemoryOptions{MaxKeys: cfg.MemoryMaxKeys, MaxBytes: cfg.MemoryMaxBytes, Now: cfg.Now})
		return opts, nil
	}
	rs, err := store.NewRedis(*cfg.Redis)
	if err != nil {
		return opts, err
	}
	opts.Store = rs
	opts.BreakerFailures, opts.BreakerOpen = 3, time.Second
	opts.RefusalCache = true
	return opts, nil
}

func newReloads(reg *prometheus.Registry) *prometheus.CounterVec {
	reloads := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_config_reloads_total", Help: "Policy file reloads by result (applied, refused).",
	}, []string{"result"})
	for _, result := range []string{"applied", "refused"} {
		reloads.WithLabelValues(result) // at zero from the start: the first refusal is an increase
	}
	reg.MustRegister(reloads)
	return reloads
}

// admin is the admin server's handler: metrics, probes, the report, /keys and, when asked for,
// Go's profiles.
func (e *Enforcer) admin(reg *prometheus.Registry) http.Handler {
	live := func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }
	ready := func(w http.ResponseWriter, r *http.Request) {
		if e.stopping.Load() {
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		}
		if e.pool != nil && !e.pool.synced.Load() {
			// A replica that has not loaded the pool's policies would refuse their requests.
			http.Error(w, "loading the pool's policies", http.StatusServiceUnavailable)
			return
		}
		live(w, r)
	}
	admin := http.NewServeMux()
	admin.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	admin.HandleFunc("/healthz", live)
	admin.HandleFunc("/readyz", ready)
	admin.HandleFunc(report.Path, e.serveReport)
	admin.HandleFunc(KeysPath, e.serveKeys)
	if e.cfg.Pprof {
		admin.HandleFunc("/debug/pprof/", pprof.Index)
		admin.HandleFunc("/debug/pprof/profile", pprof.Profile)
		admin.HandleFunc("/debug/pprof/trace", pprof.Trace)
		admin.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		admin.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	}
	return admin
}

// proxy serves the reverse proxy, or nil without an upstream: fasthttp in front of a plain
// HTTP/1.1 upstream (and net/http for h2c clients beside it), net/http alone in front of TLS
// and HTTP/2 upstreams.
func (e *Enforcer) proxy(reg *prometheus.Registry) func(net.Listener) func(context.Context) error {
	cfg := e.cfg
	if cfg.Upstream == nil {
		return nil
	}
	um := newUpstreamMetrics(reg)
	o := upstreamOptions{tls: cfg.UpstreamTLS, connect: cfg.UpstreamConnectTimeout, responseHeader: cfg.UpstreamResponseHeaderTimeout, idle: cfg.UpstreamIdleTimeout}
	h2 := e.panics.http("proxy", newProxy(e.limiter, cfg.Upstream, newTransport(cfg.Upstream, o), cfg.WriteTimeout, um, cfg.Log))
	if cfg.Upstream.Scheme != "http" {
		return e.serveHTTP(h2)
	}
	fast := newFastProxy(e.limiter, cfg.Upstream, o, um, cfg.Log)
	fast.panics = e.panics
	return e.serveProxy(fast, h2)
}

// follow starts what runs beside the servers: the policy file's and the ConfigMap's watches, the
// store's pings, and the stop, when ctx is done or a server fails.
func (e *Enforcer) follow(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	if e.cfg.Pool != nil {
		if err := e.watchPool(ctx); err != nil {
			cancel()
			return err
		}
	} else {
		e.wg.Go(func() { e.watchFile(ctx) })
	}
	e.wg.Go(func() { e.pingStore(ctx) })
	if e.cfg.ConfigMap != nil {
		if err := e.watchConfigMap(ctx); err != nil {
			cancel()
			return err
		}
	}
	go func() {
		delay := e.cfg.ShutdownDelay
		select {
		case <-ctx.Done():
		case err := <-e.errs: // a server failed: stop the rest at once
			e.err, delay = err, 0
		}
		cancel()
		e.stop(delay)
	}()
	return nil
}

// server is one of the enforcer's listeners: its name, where its address is reported, the
// address to listen on (none: not served) and how it serves.
type server struct {
	name   string
	addr   *string
	listen string
	serve  func(net.Listener) func(context.Context) error
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
	traffic := newConnBudget(e.cfg.MaxConns, e.cfg.MaxConnsPerClient)
	for i, s := range servers {
		if lns[i] == nil {
			continue
		}
		budget := traffic
		if s.name == "admin" {
			budget = newConnBudget(adminMaxConns, adminMaxConnsPerClient)
		}
		ln := newGuardListener(lns[i], s.name, connLimits{budget: budget, writeTimeout: e.cfg.WriteTimeout, http: s.name != "rls"}, e.conns)
		if shutdown := s.serve(ln); s.name == "admin" {
			e.adminShutdown = shutdown
		} else {
			e.shutdowns = append(e.shutdowns, shutdown)
		}
	}
	return nil
}

func storeName(cfg Config) string {
	if cfg.Redis == nil {
		return report.StoreKind(false, "")
	}
	return report.StoreKind(true, cfg.Redis.Mode)
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
			HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: maxStreams},
			ConnContext:       withConn,
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
func (e *Enforcer) serveProxy(fast *fastProxy, h2 http.Handler) func(net.Listener) func(context.Context) error {
	return func(ln net.Listener) func(context.Context) error {
		split := newSplitListener(ln, e.cfg.ReadTimeout)
		srv := newProxyServer(e.panics.fast("proxy", fast.serve), e.cfg.Log, e.cfg.ReadTimeout, e.cfg.IdleTimeout)
		shutdownH1 := e.run(func() error {
			if err := srv.Serve(split.h1); !errors.Is(err, net.ErrClosed) {
				return err
			}
			return nil
		}, srv.ShutdownWithContext)
		shutdownH2 := e.serveHTTP(h2)(split.h2)
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

// maxStreams bounds the concurrent streams of one HTTP/2 connection (h2c and gRPC).
const maxStreams = 100

// maxHeaderBytes makes net/http answer 431 to a request line and header block over 64 KiB, as
// the check API does: it reads MaxHeaderBytes plus 4096 bytes of slack, and with h2c on it
// reads the first bytes of a connection, as long as "PRI * HTTP/2.0", to sniff for the HTTP/2
// preface before it starts counting.
const maxHeaderBytes = MaxHeaderBytes - 4096 - len("PRI * HTTP/2.0")

// serveCheck returns a function that runs the check API's server and returns its shutdown.
func (e *Enforcer) serveCheck(c *check) func(net.Listener) func(context.Context) error {
	return func(ln net.Listener) func(context.Context) error {
		srv := newCheckServer(e.panics.fast("check", c.serve), e.cfg.Log, e.cfg.ReadTimeout, e.cfg.IdleTimeout)
		var shutdown atomic.Bool
		serve := func() error {
			err := srv.Serve(ln)
			if shutdown.Load() {
				return nil
			}
			return err
		}
		// fasthttp's shutdown knows only a listener that Serve has begun to accept on: one that
		// came before would leave Serve accepting for ever. Closing the listener after it ends
		// Serve however the two interleave.
		return e.run(serve, func(ctx context.Context) error {
			shutdown.Store(true)
			err := srv.ShutdownWithContext(ctx)
			_ = ln.Close()
			return err
		})
	}
}

// serveRLS returns a function that serves Envoy's rate limit service over gRPC, with the
// standard gRPC health service, and returns its shutdown: in-flight calls finish, within the
// drain's deadline.
func (e *Enforcer) serveRLS(s *rls) func(net.Listener) func(context.Context) error {
	return func(ln net.Listener) func(context.Context) error {
		srv := grpc.NewServer(append(e.panics.grpc(),
			grpc.MaxRecvMsgSize(MaxRLSMessageBytes),
			grpc.MaxConcurrentStreams(maxStreams),
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

// stop is the enforcer's end, in the order that loses no request: fail /readyz; keep serving for
// ShutdownDelay while endpoints drop the pod; stop accepting and drain what is in flight; stop
// the admin server; once every server and the policy watch have returned, close the store the
// drained requests were decided by; report done.
func (e *Enforcer) stop(delay time.Duration) {
	defer close(e.done)
	e.stopping.Store(true)
	if delay > 0 {
		e.cfg.Log.Info("Stopping: /readyz fails; serving on until the shutdown delay ends", "delay", delay)
		time.Sleep(delay)
	}
	drain, cancel := context.WithTimeout(context.Background(), e.cfg.ShutdownTimeout)
	defer cancel()
	errs := make([]error, len(e.shutdowns))
	var wg sync.WaitGroup
	for i, shutdown := range e.shutdowns {
		wg.Go(func() { errs[i] = shutdown(drain) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		e.err = errors.Join(e.err, fmt.Errorf("drain in-flight requests within %v: %w", e.cfg.ShutdownTimeout, err))
	}
	if e.adminShutdown != nil {
		_ = e.adminShutdown(drain)
	}
	e.wg.Wait()                 // the servers and the policy watch have returned
	_ = e.limiter.Settle(drain) // the drained requests' ends (leases, response charges) reach the store
	e.err = errors.Join(e.err, e.store.Close())
	e.cfg.Log.Info("Stopped")
}

// Wait blocks until the enforcer has stopped: every request it accepted answered, the store
// closed. It returns what went wrong, if anything: a server that failed, a drain that ran out
// of time.
func (e *Enforcer) Wait() error {
	<-e.done
	return e.err
}
