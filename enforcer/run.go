package enforcer

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/client-go/rest"

	"github.com/sluice-dev/sluice/enforcer/internal/config"
	"github.com/sluice-dev/sluice/enforcer/internal/conns"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/panics"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/buildinfo"
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

// ConfigMapSource names the ConfigMap that holds the enforcer's policy file: the controller's
// rendering of the policy, which the kubelet also mounts at PolicyFile. Watching it through the
// API server takes a change to every replica in well under a second, where the kubelet's refresh
// of the mounted file takes up to about a minute.
type ConfigMapSource struct {
	Namespace, Name string
	// Key is the ConfigMap's key of the policy file.
	Key string
	// Kube reaches the API server. The enforcer's service account needs get, list and watch on
	// this one ConfigMap by name, and nothing else.
	Kube *rest.Config
}

// PoolSource makes the enforcer a replica of an EnforcerPool: it serves the policies whose
// ConfigMaps the manager writes into the pool's namespace, one per policy, labelled with the
// pool (report.PoolLabel). Each is loaded apart: one that does not load is refused alone, and
// reported, while the others are served. No object holds every policy, so a pool has no bound
// but the API server's on the number of ConfigMaps.
type PoolSource struct {
	Namespace, Name string
	// Kube reaches the API server. The enforcer's service account needs list and watch on the
	// ConfigMaps of Namespace, and nothing else.
	Kube *rest.Config
}

// sources are where the enforcer's policies come from, in order of preference: a pool's
// ConfigMaps; or its policy file, behind its ConfigMap through the API server if it has one.
func sources(cfg Config) []config.Source {
	if p := cfg.Pool; p != nil {
		return []config.Source{&config.APIServer{Namespace: p.Namespace, Pool: p.Name, Key: report.PolicyFileKey, Kube: p.Kube}}
	}
	var s []config.Source
	if c := cfg.ConfigMap; c != nil {
		s = append(s, &config.APIServer{Namespace: c.Namespace, Name: c.Name, Key: c.Key, Kube: c.Kube})
	}
	return append(s, &config.File{Path: cfg.PolicyFile, Interval: cfg.ReloadInterval})
}

// Enforcer is a running enforcer.
type Enforcer struct {
	// ProxyAddr, CheckAddr, AdminAddr and RLSAddr are the addresses the servers listen on.
	ProxyAddr, CheckAddr, AdminAddr, RLSAddr string

	cfg     Config
	limiter *limiter.Limiter
	store   store.Store
	// watcher puts the policies of the config sources in force.
	watcher *config.Watcher
	// shutdowns stop the proxy and check servers, draining in-flight requests; adminShutdown
	// stops the admin server last, so /readyz and /metrics answer throughout the drain.
	shutdowns     []func(context.Context) error
	adminShutdown func(context.Context) error
	wg            sync.WaitGroup
	errs          chan error
	// stopping is set when the stop begins: /readyz fails from then on.
	stopping atomic.Bool
	// started is when Start began; health is the store's as the last ping found it.
	started time.Time
	health  atomic.Pointer[report.Store]
	// done closes when the enforcer has stopped; err is why, if anything failed.
	done chan struct{}
	err  error
	// panics contains the request paths' panics; conns counts the listeners' connections.
	panics *panics.Panics
	conns  *conns.Metrics
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
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildinfo.Read().Collector())
	opts, err := limiterOptions(cfg, reg)
	if err != nil {
		return nil, err
	}
	e := &Enforcer{cfg: cfg, store: opts.Store, limiter: limiter.New(opts), errs: make(chan error, 3), done: make(chan struct{}),
		panics: panics.New(reg, cfg.Log), conns: conns.NewMetrics(reg)}
	e.started = e.now()
	e.watcher = config.NewWatcher(config.Options{Limiter: e.limiter, Registry: reg, Log: cfg.Log, Now: e.now, Started: e.started}, sources(cfg)...)
	if err := e.watcher.Open(); err != nil {
		_ = e.store.Close()
		return nil, err
	}
	// The report tells the store's health from the start: a first ping, at most a second long.
	e.checkedStore(e.ping(ctx))
	servers, err := e.servers(reg)
	if err == nil {
		err = e.listenAndServe(servers)
	}
	if err != nil {
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
		kv = append(kv, "policies", len(e.limiter.Policies()))
	}
	cfg.Log.Info("Enforcer started", kv...)
	return e, nil
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

// follow starts what runs beside the servers: the config sources' watches, the store's pings,
// and the stop, when ctx is done or a server fails.
func (e *Enforcer) follow(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	if err := e.watcher.Follow(ctx, &e.wg); err != nil {
		cancel()
		return err
	}
	e.wg.Go(func() { e.pingStore(ctx) })
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

func storeName(cfg Config) string {
	if cfg.Redis == nil {
		return report.StoreKind(false, "")
	}
	return report.StoreKind(true, cfg.Redis.Mode)
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
