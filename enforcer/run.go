package enforcer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"net/url"
	"os"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sluice-dev/sluice/enforcer/limiter"
	"github.com/sluice-dev/sluice/enforcer/store"
)

// Config is everything the enforcer needs. cmd/enforcer fills it from flags and environment.
type Config struct {
	// PolicyFile holds one or more RateLimitPolicy documents. It is watched: a valid change
	// takes effect within ReloadInterval; an invalid one is logged and the last good one stays.
	PolicyFile     string
	ReloadInterval time.Duration
	// Upstream receives the requests that pass. Nil serves no proxy (check API only).
	Upstream *url.URL
	// Listen, CheckListen and AdminListen are the proxy, check API and admin addresses; empty
	// disables the server.
	Listen, CheckListen, AdminListen string
	// Redis, when set, is the store; otherwise the memory store, exact for one replica only.
	Redis *store.RedisOptions
	// MemoryMaxKeys bounds the memory store's keys. Default 1,000,000.
	MemoryMaxKeys int
	// ShutdownTimeout bounds the drain of in-flight requests at shutdown.
	ShutdownTimeout time.Duration
	// Pprof serves Go's profiles under /debug/pprof/ on the admin address.
	Pprof bool
	Log   logr.Logger
}

// Enforcer is a running enforcer.
type Enforcer struct {
	// ProxyAddr, CheckAddr and AdminAddr are the addresses the servers listen on.
	ProxyAddr, CheckAddr, AdminAddr string

	cfg     Config
	limiter *limiter.Limiter
	store   store.Store
	// shutdowns stop the servers, draining in-flight requests.
	shutdowns []func(context.Context) error
	wg        sync.WaitGroup
	errs      chan error
	reloads   *prometheus.CounterVec
}

// Run starts the enforcer and serves until ctx is done, then drains in-flight requests.
func Run(ctx context.Context, cfg Config) error {
	e, err := Start(ctx, cfg)
	if err != nil {
		return err
	}
	return e.Wait()
}

// Start loads the policies, opens the store, and starts the servers. They stop when ctx is done.
func Start(ctx context.Context, cfg Config) (*Enforcer, error) {
	if cfg.ReloadInterval <= 0 {
		cfg.ReloadInterval = time.Second
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 30 * time.Second
	}
	policies, err := LoadFile(cfg.PolicyFile)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", cfg.PolicyFile, err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	opts := limiter.Options{Metrics: limiter.NewMetrics(reg)}
	if cfg.Redis != nil {
		rs, err := store.NewRedis(*cfg.Redis)
		if err != nil {
			return nil, err
		}
		opts.Store = rs
		opts.BreakerFailures, opts.BreakerOpen = 3, time.Second
		opts.RefusalCache = true
	} else {
		opts.Store = store.NewMemory(store.MemoryOptions{MaxKeys: cfg.MemoryMaxKeys})
	}
	e := &Enforcer{cfg: cfg, store: opts.Store, limiter: limiter.New(opts), errs: make(chan error, 3)}
	e.limiter.SetPolicies(policies)
	e.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_config_reloads_total", Help: "Policy file reloads by result (applied, refused).",
	}, []string{"result"})
	reg.MustRegister(e.reloads)

	ready := func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }
	admin := http.NewServeMux()
	admin.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	admin.HandleFunc("/healthz", ready)
	admin.HandleFunc("/readyz", ready)
	if cfg.Pprof {
		admin.HandleFunc("/debug/pprof/", pprof.Index)
		admin.HandleFunc("/debug/pprof/profile", pprof.Profile)
		admin.HandleFunc("/debug/pprof/trace", pprof.Trace)
		admin.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		admin.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	}

	var transport http.RoundTripper = &http.Transport{
		DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          4096,
		MaxIdleConnsPerHost:   4096,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		ForceAttemptHTTP2:     true,
	}
	var proxyHandler http.Handler
	if cfg.Upstream != nil {
		proxyHandler = newProxy(e.limiter, cfg.Upstream, transport)
	}
	servers := []struct {
		addr   *string
		listen string
		serve  func(net.Listener)
	}{
		{&e.ProxyAddr, cfg.Listen, e.serveHTTP(proxyHandler)},
		{&e.CheckAddr, cfg.CheckListen, e.serveCheck(&check{limiter: e.limiter})},
		{&e.AdminAddr, cfg.AdminListen, e.serveHTTP(admin)},
	}
	for _, s := range servers {
		if s.listen == "" || s.serve == nil {
			continue
		}
		ln, err := net.Listen("tcp", s.listen)
		if err != nil {
			e.shutdown()
			return nil, fmt.Errorf("listen on %s: %w", s.listen, err)
		}
		*s.addr = ln.Addr().String()
		s.serve(ln)
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		e.watch(ctx)
	}()
	go func() {
		<-ctx.Done()
		e.shutdown()
	}()
	cfg.Log.Info("Enforcer started", "proxy", e.ProxyAddr, "check", e.CheckAddr, "admin", e.AdminAddr,
		"policies", len(policies), "store", storeName(cfg))
	return e, nil
}

func storeName(cfg Config) string {
	if cfg.Redis == nil {
		return "memory"
	}
	return "redis-" + string(cfg.Redis.Mode)
}

// serveHTTP returns a function that runs a net/http server for h with limits against slow and
// oversized clients, cleartext HTTP/2 (h2c) beside HTTP/1.1. Nil for a nil handler.
func (e *Enforcer) serveHTTP(h http.Handler) func(net.Listener) {
	if h == nil {
		return nil
	}
	return func(ln net.Listener) {
		var protocols http.Protocols
		protocols.SetHTTP1(true)
		protocols.SetUnencryptedHTTP2(true)
		srv := &http.Server{
			Handler:           h,
			ReadHeaderTimeout: 10 * time.Second,
			IdleTimeout:       120 * time.Second,
			MaxHeaderBytes:    64 << 10,
			Protocols:         &protocols,
		}
		e.run(func() error {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		}, srv.Shutdown)
	}
}

// serveCheck returns a function that runs the check API's server.
func (e *Enforcer) serveCheck(c *check) func(net.Listener) {
	return func(ln net.Listener) {
		srv := newCheckServer(c, e.cfg.Log)
		e.run(func() error { return srv.Serve(ln) }, srv.ShutdownWithContext)
	}
}

// run serves in the background until shutdown is called.
func (e *Enforcer) run(serve func() error, shutdown func(context.Context) error) {
	e.shutdowns = append(e.shutdowns, shutdown)
	e.wg.Go(func() {
		if err := serve(); err != nil {
			e.errs <- err
		}
	})
}

// shutdown stops accepting requests and drains the ones in flight.
func (e *Enforcer) shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.ShutdownTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for _, shutdown := range e.shutdowns {
		wg.Go(func() { _ = shutdown(ctx) })
	}
	wg.Wait()
}

// Wait blocks until every server stopped, then closes the store.
func (e *Enforcer) Wait() error {
	e.wg.Wait()
	close(e.errs)
	err := errors.Join(func() (errs []error) {
		for err := range e.errs {
			errs = append(errs, err)
		}
		return errs
	}()...)
	return errors.Join(err, e.store.Close())
}

// Limiter is the enforcer's limiter.
func (e *Enforcer) Limiter() *limiter.Limiter { return e.limiter }

// watch polls the policy file and applies valid changes. Polling, rather than inotify, follows
// the symlink swaps with which the kubelet updates mounted ConfigMaps.
func (e *Enforcer) watch(ctx context.Context) {
	last, _ := os.ReadFile(e.cfg.PolicyFile)
	t := time.NewTicker(e.cfg.ReloadInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		data, err := os.ReadFile(e.cfg.PolicyFile)
		if err != nil || bytes.Equal(data, last) {
			continue
		}
		last = data
		policies, err := Load(data)
		if err != nil {
			e.reloads.WithLabelValues("refused").Inc()
			e.cfg.Log.Error(err, "Refused the changed policy file; the last good policies stay", "file", e.cfg.PolicyFile)
			continue
		}
		e.limiter.SetPolicies(policies)
		e.reloads.WithLabelValues("applied").Inc()
		e.cfg.Log.Info("Applied the changed policy file", "file", e.cfg.PolicyFile, "policies", len(policies))
	}
}
