// Command manager runs the Sluice controller manager: it reconciles RateLimitPolicy objects into
// enforcers and serves the admission webhook. Flags, scheme and wiring only.
package main

import (
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	ctrlwebhook "sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/cmd/internal/termination"
	"github.com/sluice-dev/sluice/controllers"
	"github.com/sluice-dev/sluice/internal/buildinfo"
	"github.com/sluice-dev/sluice/internal/certs"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/webhook"
)

func main() {
	var (
		metricsAddr, probeAddr string
		pprofAddr              string
		leaderElect            bool
		defaults               render.Defaults
		workers                int
		qps                    float64
		burst                  int
		wh                     webhookFlags
		probeInterval          time.Duration
		reportInterval         time.Duration
		lease                  leaseFlags
		showVersion            bool
		netpol                 networkPolicyFlags
	)
	flag.StringVar(&metricsAddr, "metrics-bind-address", ":8080", "Address of the metrics endpoint; 0 disables it.")
	flag.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "Address of the health probe endpoint.")
	flag.StringVar(&pprofAddr, "pprof-bind-address", "", "Address of the Go profiler's /debug/pprof endpoints; empty disables them.")
	flag.BoolVar(&leaderElect, "leader-elect", false, "Elect a leader so that only one manager replica reconciles; every replica serves the webhook.")
	flag.DurationVar(&lease.duration, "leader-elect-lease-duration", 15*time.Second, "How long a replica waits, after the leader last renewed its lease, before it takes over.")
	flag.DurationVar(&lease.renew, "leader-elect-renew-deadline", 10*time.Second, "How long the leader tries to renew its lease before it gives up leading.")
	flag.DurationVar(&lease.retry, "leader-elect-retry-period", 2*time.Second, "How often replicas try to acquire or renew the lease.")
	flag.StringVar(&defaults.EnforcerImage, "enforcer-image", "ghcr.io/sluice-dev/sluice-enforcer:"+buildinfo.Release, "Enforcer image of policies that do not set spec.enforcer.image.")
	flag.StringVar(&defaults.RedisImage, "redis-image", "redis:7.4-alpine", "Redis image of policies with storage.managedRedis that do not set an image.")
	flag.IntVar(&workers, "workers", 16, "Policies reconciled at once.")
	// A thousand new policies are about 7,000 writes: at 50 a second, over two minutes before the
	// last is Programmed. The API server's priority and fairness protects it from a busy client.
	flag.Float64Var(&qps, "kube-api-qps", 400, "Requests per second the manager may send to the API server.")
	flag.IntVar(&burst, "kube-api-burst", 800, "Burst of requests the manager may send to the API server.")
	flag.DurationVar(&probeInterval, "redis-probe-interval", time.Minute, "How often the manager checks, for a policy none of whose enforcer replicas reports, that its storage.redis accepts connections, "+
		"and reports Degraded RedisUnreachable when not; 0 disables the probe. Policies naming the same Redis share a probe's result for half the interval, at most 10s.")
	flag.DurationVar(&reportInterval, "report-interval", 10*time.Second, "How often each policy's enforcer replicas are asked for their reports (served revision, store health, "+
		"counters), and the least time between two status writes that only move counts or messages.")
	flag.BoolVar(&showVersion, "version", false, "Print the version, commit and Go version, and exit.")
	wh.bind(flag.CommandLine)
	netpol.bind(flag.CommandLine)
	opts := zap.Options{}
	opts.BindFlags(flag.CommandLine)
	flag.Parse() // --help exits 0, a flag it cannot parse 2
	if showVersion {
		fmt.Println("manager", buildinfo.Read())
		os.Exit(0)
	}
	if err := checkFlags(flag.CommandLine); err != nil {
		for _, line := range strings.Split(err.Error(), "\n") {
			fmt.Fprintln(os.Stderr, "manager:", line)
		}
		_ = termination.Write(termination.Path, err.Error())
		os.Exit(2)
	}
	metrics.Registry.MustRegister(buildinfo.Read().Collector())
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))
	log := ctrl.Log.WithName("setup")

	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(v1alpha1.AddToScheme(scheme))

	var err error
	if defaults.NetworkPolicy, err = netpol.defaults(wh.namespace); err != nil {
		fail(log, err, "Invalid NetworkPolicy flags")
	}

	cfg := ctrl.GetConfigOrDie()
	cfg.QPS, cfg.Burst = float32(qps), burst
	server, rotator, err := wh.server(cfg, scheme)
	if err != nil {
		fail(log, err, "Unable to set up the webhook server")
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 scheme,
		Cache:                  cache.Options{ByObject: controllers.CacheByObject()},
		WebhookServer:          server,
		Metrics:                metricsserver.Options{BindAddress: metricsAddr},
		HealthProbeBindAddress: probeAddr,
		PprofBindAddress:       pprofAddr,
		LeaderElection:         leaderElect,
		LeaderElectionID:       "manager.ratelimit.sluice.dev",
		// The lease lives beside the certificate Secret, in the manager's namespace; outside a
		// cluster there is no service-account namespace to default to.
		LeaderElectionNamespace: wh.namespace,
		LeaseDuration:           &lease.duration,
		RenewDeadline:           &lease.renew,
		RetryPeriod:             &lease.retry,
		// The manager exits right after it stops leading, so handing the lease over at once on
		// SIGTERM is safe, and spares a rollout the wait for the lease to expire.
		LeaderElectionReleaseOnCancel: true,
	})
	if err != nil {
		fail(log, err, "Unable to create the manager")
	}
	ctx := ctrl.SetupSignalHandler()
	reconciler := &controllers.RateLimitPolicyReconciler{
		Client:         mgr.GetClient(),
		Scheme:         mgr.GetScheme(),
		Recorder:       mgr.GetEventRecorder("sluice"),
		Defaults:       defaults,
		Workers:        workers,
		ProbeInterval:  probeInterval,
		ReportInterval: reportInterval,
	}
	if probeInterval > 0 {
		reconciler.ProbeRedis = controllers.SharedProbe(controllers.DialRedis, min(probeInterval/2, 10*time.Second), clock.RealClock{})
	}
	if err := reconciler.SetupWithManager(ctx, mgr); err != nil {
		fail(log, err, "Unable to set up the RateLimitPolicy controller")
	}
	if err := webhook.Setup(mgr); err != nil {
		fail(log, err, "Unable to set up the RateLimitPolicy webhook")
	}
	if err := mgr.Add(webhook.RemoveObsolete{Client: mgr.GetClient(), Name: webhook.ObsoleteDefaultingWebhook}); err != nil {
		fail(log, err, "Unable to add the removal of the obsolete defaulting webhook")
	}
	readyz := mgr.GetWebhookServer().StartedChecker()
	if rotator != nil {
		if err := mgr.Add(rotator); err != nil {
			fail(log, err, "Unable to add the certificate rotator")
		}
		started := readyz
		readyz = func(req *http.Request) error { return errors.Join(rotator.Ready(req), started(req)) }
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		fail(log, err, "Unable to add the health check")
	}
	if err := mgr.AddReadyzCheck("readyz", readyz); err != nil {
		fail(log, err, "Unable to add the readiness check")
	}
	log.Info("Starting the manager")
	if err := mgr.Start(ctx); err != nil {
		fail(log, err, "The manager stopped")
	}
}

// networkPolicyFlags say whether each enforcer gets a NetworkPolicy and whom it admits.
type networkPolicyFlags struct {
	enabled                  bool
	monitoring, check, proxy string
}

func (f *networkPolicyFlags) bind(fs *flag.FlagSet) {
	fs.BoolVar(&f.enabled, "enforcer-network-policy", true, "Render a NetworkPolicy for each policy's enforcer pods that admits the admin port only from --namespace and "+
		"--monitoring-namespaces, the check and RLS ports only from the policy's namespace and --check-namespaces, and the proxy port from --proxy-namespaces "+
		"or from anywhere. Takes effect only with a network plugin that enforces NetworkPolicy.")
	fs.StringVar(&f.monitoring, "monitoring-namespaces", "", "Comma-separated namespaces that may reach the enforcers' admin port (/metrics, /report), besides the manager's.")
	fs.StringVar(&f.check, "check-namespaces", "", "Comma-separated namespaces that may reach the enforcers' check and RLS ports (the gateways that ask for decisions), "+
		"besides each policy's own.")
	fs.StringVar(&f.proxy, "proxy-namespaces", "", "Comma-separated namespaces that alone may reach the enforcers' proxy port; empty means any source, in or outside the cluster.")
}

// defaults are the NetworkPolicy defaults the flags give, nil when disabled, or an error naming
// the flag whose list holds something that is not a namespace name.
func (f *networkPolicyFlags) defaults(managerNamespace string) (*render.NetworkPolicyDefaults, error) {
	if !f.enabled {
		return nil, nil
	}
	d := &render.NetworkPolicyDefaults{ManagerNamespace: managerNamespace}
	for _, l := range []struct {
		flag, value string
		into        *[]string
	}{{"monitoring-namespaces", f.monitoring, &d.MonitoringNamespaces}, {"check-namespaces", f.check, &d.CheckNamespaces}, {"proxy-namespaces", f.proxy, &d.ProxyNamespaces}} {
		for name := range strings.SplitSeq(l.value, ",") {
			if name = strings.TrimSpace(name); name == "" {
				continue
			}
			if errs := validation.IsDNS1123Label(name); len(errs) > 0 {
				return nil, fmt.Errorf("--%s: %q is not a namespace name: %s", l.flag, name, strings.Join(errs, "; "))
			}
			*l.into = append(*l.into, name)
		}
	}
	return d, nil
}

// leaseFlags time leader election.
type leaseFlags struct{ duration, renew, retry time.Duration }

// webhookFlags say where the webhook listens and where its certificate comes from.
type webhookFlags struct {
	host, certDir, namespace, secret, hosts, validating string
	port                                                int
	caValidity, certValidity, interval                  time.Duration
}

func (f *webhookFlags) bind(fs *flag.FlagSet) {
	fs.StringVar(&f.host, "webhook-host", "", "Address the webhook server listens on; empty means all.")
	fs.IntVar(&f.port, "webhook-port", 9443, "Port of the webhook server.")
	fs.StringVar(&f.certDir, "webhook-cert-dir", "", "Directory with tls.crt and tls.key, such as a cert-manager Secret mounted into the pod; "+
		"reloaded when they change. Empty means built-in certificates: the manager makes and rotates its own and keeps the webhook configurations' caBundle.")
	fs.StringVar(&f.namespace, "namespace", os.Getenv("POD_NAMESPACE"), "Namespace of the manager (built-in certificates). Defaults to $POD_NAMESPACE.")
	fs.StringVar(&f.secret, "webhook-secret", "sluice-webhook-certs", "Secret in --namespace that holds the built-in certificates.")
	fs.StringVar(&f.hosts, "webhook-cert-hosts", "", "Comma-separated DNS names and IPs of the built-in certificate. "+
		"Empty means sluice-webhook-service.<namespace>.svc and its cluster.local form.")
	fs.StringVar(&f.validating, "validating-webhook-configuration", "sluice-validating-webhook-configuration", "ValidatingWebhookConfiguration whose caBundle the built-in certificates keep.")
	fs.DurationVar(&f.caValidity, "webhook-ca-validity", 10*365*24*time.Hour, "Lifetime of a built-in CA; renewed with a third left.")
	fs.DurationVar(&f.certValidity, "webhook-cert-validity", 90*24*time.Hour, "Lifetime of a built-in serving certificate; renewed with a third left.")
	fs.DurationVar(&f.interval, "webhook-cert-check-interval", time.Minute, "How often the built-in certificates are checked.")
}

// server returns the webhook server and, in built-in mode, the rotator that feeds it.
func (f *webhookFlags) server(cfg *rest.Config, scheme *runtime.Scheme) (ctrlwebhook.Server, *certs.Rotator, error) {
	opts := ctrlwebhook.Options{Host: f.host, Port: f.port, CertDir: f.certDir}
	if f.certDir != "" {
		return ctrlwebhook.NewServer(opts), nil, nil
	}
	if f.namespace == "" {
		return nil, nil, fmt.Errorf("built-in webhook certificates need --namespace or $POD_NAMESPACE")
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return nil, nil, err
	}
	hosts := []string{"sluice-webhook-service." + f.namespace + ".svc", "sluice-webhook-service." + f.namespace + ".svc.cluster.local"}
	if f.hosts != "" {
		hosts = strings.Split(f.hosts, ",")
	}
	r := &certs.Rotator{
		Client:             c,
		Secret:             types.NamespacedName{Namespace: f.namespace, Name: f.secret},
		Hosts:              hosts,
		ValidatingWebhooks: []string{f.validating},
		CAValidity:         f.caValidity,
		CertValidity:       f.certValidity,
		Interval:           f.interval,
	}
	opts.TLSOpts = []func(*tls.Config){func(c *tls.Config) { c.GetCertificate = r.GetCertificate }}
	return ctrlwebhook.NewServer(opts), r, nil
}

// fail logs err and why the manager cannot go on, writes both as the container's termination
// message (which the pod's status and kubectl describe show), and exits 1.
func fail(log logr.Logger, err error, msg string) {
	log.Error(err, msg)
	_ = termination.Write(termination.Path, msg+": "+err.Error())
	os.Exit(1)
}
