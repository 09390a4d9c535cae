// Command manager runs the Sluice controller manager: it reconciles RateLimitPolicy objects into
// enforcers and serves the admission webhook. Flags, scheme and wiring only.
package main

import (
	"flag"
	"os"

	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers"
	"github.com/sluice-dev/sluice/controllers/render"
)

func main() {
	var (
		metricsAddr, probeAddr string
		leaderElect            bool
		defaults               render.Defaults
		workers                int
		qps                    float64
		burst                  int
	)
	flag.StringVar(&metricsAddr, "metrics-bind-address", ":8080", "Address of the metrics endpoint; 0 disables it.")
	flag.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "Address of the health probe endpoint.")
	flag.BoolVar(&leaderElect, "leader-elect", false, "Elect a leader so that only one manager replica reconciles.")
	flag.StringVar(&defaults.EnforcerImage, "enforcer-image", "ghcr.io/sluice-dev/sluice-enforcer:latest", "Enforcer image of policies that do not set spec.enforcer.image.")
	flag.StringVar(&defaults.RedisImage, "redis-image", "redis:7.4-alpine", "Redis image of policies with storage.managedRedis that do not set an image.")
	flag.IntVar(&workers, "workers", 4, "Policies reconciled at once.")
	flag.Float64Var(&qps, "kube-api-qps", 50, "Requests per second the manager may send to the API server.")
	flag.IntVar(&burst, "kube-api-burst", 100, "Burst of requests the manager may send to the API server.")
	opts := zap.Options{}
	opts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))
	log := ctrl.Log.WithName("setup")

	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(v1alpha1.AddToScheme(scheme))

	cfg := ctrl.GetConfigOrDie()
	cfg.QPS, cfg.Burst = float32(qps), burst
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: metricsAddr},
		HealthProbeBindAddress: probeAddr,
		LeaderElection:         leaderElect,
		LeaderElectionID:       "manager.ratelimit.sluice.dev",
	})
	if err != nil {
		log.Error(err, "Unable to create the manager")
		os.Exit(1)
	}
	ctx := ctrl.SetupSignalHandler()
	if err := (&controllers.RateLimitPolicyReconciler{
		Client:   mgr.GetClient(),
		Scheme:   mgr.GetScheme(),
		Recorder: mgr.GetEventRecorder("sluice"),
		Defaults: defaults,
		Workers:  workers,
	}).SetupWithManager(ctx, mgr); err != nil {
		log.Error(err, "Unable to set up the RateLimitPolicy controller")
		os.Exit(1)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		log.Error(err, "Unable to add the health check")
		os.Exit(1)
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		log.Error(err, "Unable to add the readiness check")
		os.Exit(1)
	}
	log.Info("Starting the manager")
	if err := mgr.Start(ctx); err != nil {
		log.Error(err, "The manager stopped")
		os.Exit(1)
	}
}
