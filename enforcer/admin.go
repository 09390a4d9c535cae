package enforcer

import (
	"net/http"
	"net/http/pprof"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sluice-dev/sluice/internal/report"
)

// admin is the admin server's handler: metrics, probes, the report, /keys and, when asked for,
// Go's profiles.
func (e *Enforcer) admin(reg *prometheus.Registry) http.Handler {
	live := func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }
	ready := func(w http.ResponseWriter, r *http.Request) {
		if e.stopping.Load() {
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		}
		if !e.watcher.Synced() {
			// A replica that has not loaded the pool's policies would refuse their requests.
			// (The policy file is loaded before anything listens.)
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
