// Command demo runs Sluice on this machine with no cluster (`make demo`): the test control plane
// with the real kube-controller-manager, a Redis, the manager with its webhook, the policy of
// config/samples/demo.yaml in front of a small demo upstream, and the enforcer pods the
// ReplicaSet controller creates, run as local processes by test/local's kubelet stand-in. It waits
// until the enforcers report Ready, sends a burst of traffic, shows the status the enforcers'
// reports produce, and keeps everything running until Ctrl-C.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

const namespace = "default"

func main() {
	dir := flag.String("dir", filepath.Join(testenv.RepoRoot(), "bin", "demo"), "Directory for the kubeconfig, logs and the enforcer's files.")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, *dir)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dir string) error {
	dir, err := filepath.Abs(dir)
	if err == nil {
		err = os.MkdirAll(dir, 0o755)
	}
	if err != nil {
		return err
	}
	step("Building the manager and the enforcer")
	managerBin, enforcerBin, err := local.Build(ctx, dir)
	if err != nil {
		return err
	}

	step("Starting the control plane (kube-apiserver, etcd, kube-controller-manager) with the RateLimitPolicy CRD")
	env, err := testenv.Start(testenv.WithWebhooks(), testenv.WithControllers())
	if err != nil {
		return err
	}
	defer func() { _ = env.Stop() }()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig); err != nil {
		return err
	}

	step("Starting Redis")
	redis, err := redistest.StartServer()
	if err != nil {
		return err
	}
	defer redis.Stop()
	detail("redis-server on %s", redis.Addr())

	step("Starting the manager: controller and admission webhook, with its own certificates")
	logFile, err := os.Create(filepath.Join(dir, "logs.txt"))
	if err != nil {
		return err
	}
	defer func() { _ = logFile.Close() }()
	mgr, err := local.StartManager(ctx, env, managerBin, kubeconfig, logFile, "--report-interval=2s")
	if err != nil {
		return err
	}
	defer mgr.Stop()
	detail("logs of the manager and the enforcer: %s", logFile.Name())

	upstream, err := startUpstream()
	if err != nil {
		return err
	}
	defer func() { _ = upstream.Close() }()
	detail("demo upstream on http://%s", upstream.Addr)

	step("Applying config/samples/demo.yaml")
	policy, err := apply(ctx, env.Client, redis.Addr())
	if err != nil {
		return err
	}
	if err := waitProgrammed(ctx, env.Client, policy); err != nil {
		return err
	}
	detail("accepted by the webhook; stored as written, with the schema's defaults (defaultFailureMode %s, redis timeout %s)",
		policy.Spec.DefaultFailureMode, *policy.Spec.Storage.Redis.Timeout)
	detail("programmed by the controller: enforcer image %s, %d replicas (status.enforcer)", policy.Status.Enforcer.Image, policy.Status.Enforcer.Replicas)

	step("Running the enforcer pods (no kubelet here: a local stand-in runs each pod as a process)")
	kubelet, err := local.StartKubelet(ctx, env.Client, env.Config, enforcerBin, local.KubeletOptions{
		Namespace: namespace, Upstream: "http://" + upstream.Addr, Dir: filepath.Join(dir, "pods"), Log: logFile})
	if err != nil {
		return err
	}
	defer kubelet.Stop()
	if err := waitStatus(ctx, env.Client, policy, "Ready", func(p *v1alpha1.RateLimitPolicy) bool {
		return meta.IsStatusConditionTrue(p.Status.Conditions, v1alpha1.ConditionReady)
	}); err != nil {
		return err
	}
	detail("%s", meta.FindStatusCondition(policy.Status.Conditions, v1alpha1.ConditionReady).Message)
	pods, err := local.EnforcerPods(ctx, env.Client, namespace, policy.Name)
	if err != nil || len(pods) == 0 {
		return fmt.Errorf("no enforcer pod runs: %w", err)
	}
	for _, pod := range pods {
		detail("pod %s at %s", pod.Name, pod.Status.PodIP)
	}
	proxy := local.PodURL(&pods[0], "proxy")

	step("Sending a burst of 8 requests from one client (X-Client: demo-user) to pod " + pods[0].Name)
	if err := burst(ctx, proxy, 8); err != nil {
		return err
	}

	step("The policy's status, from the enforcers' reports")
	if err := waitStatus(ctx, env.Client, policy, "the burst counted", func(p *v1alpha1.RateLimitPolicy) bool {
		return len(p.Status.Rules) > 0 && p.Status.Rules[0].Limited > 0
	}); err != nil {
		return err
	}
	printConditions(policy)
	for _, r := range policy.Status.Rules {
		detail("rule %s over the last minute: %d allowed, %d limited (%s), %d failed", r.Name, r.Allowed, r.Limited, r.LimitedShare, r.Failed)
	}
	detail("kubectl get rlp: READY %s, LIMITED %s", policy.Status.Enforcer.Ready, policy.Status.Limited)

	fmt.Printf(`
Sluice is running. Try:
  export KUBECONFIG=%s
  kubectl get rlp -o wide    # or: kubectl get ratelimitpolicies -o yaml
  curl -i -H 'X-Client: me' %s/
  kubectl delete rlp %s && kubectl get all,cm,sa  # the garbage collector removes its objects

Ctrl-C stops everything.
`, kubeconfig, proxy, policy.Name)
	<-ctx.Done()
	step("Stopping")
	return nil
}

func step(s string) { fmt.Printf("\n==> %s\n", s) }

func detail(format string, args ...any) { fmt.Printf("    "+format+"\n", args...) }

type upstream struct {
	*http.Server
	Addr string
}

// startUpstream serves the demo upstream: it greets every request that the enforcer lets through.
func startUpstream() (*upstream, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = fmt.Fprintf(w, "hello from the demo upstream: %s %s\n", r.Method, r.URL.Path)
	})}
	go func() { _ = srv.Serve(l) }()
	return &upstream{Server: srv, Addr: l.Addr().String()}, nil
}

// apply creates the objects of config/samples/demo.yaml, with the policy's Redis address pointed
// at the Redis the demo started.
func apply(ctx context.Context, k8s client.Client, redisAddr string) (*v1alpha1.RateLimitPolicy, error) {
	objs, err := testenv.DecodeFile(filepath.Join(testenv.RepoRoot(), "config", "samples", "demo.yaml"))
	if err != nil {
		return nil, err
	}
	var policy *v1alpha1.RateLimitPolicy
	for _, u := range objs {
		u.SetNamespace(namespace)
		if u.GroupVersionKind() == testenv.GVK {
			if err := unstructured.SetNestedStringSlice(u.Object, []string{redisAddr}, "spec", "storage", "redis", "addresses"); err != nil {
				return nil, err
			}
			detail("spec.storage.redis.addresses set to [%s]", redisAddr)
		}
		if err := k8s.Create(ctx, u); err != nil {
			return nil, fmt.Errorf("create %s %s: %w", u.GetKind(), u.GetName(), err)
		}
		detail("%s/%s created", strings.ToLower(u.GetKind()), u.GetName())
		if u.GroupVersionKind() == testenv.GVK {
			policy = &v1alpha1.RateLimitPolicy{}
			policy.Namespace, policy.Name = u.GetNamespace(), u.GetName()
		}
	}
	if policy == nil {
		return nil, fmt.Errorf("config/samples/demo.yaml has no RateLimitPolicy")
	}
	return policy, nil
}

func waitProgrammed(ctx context.Context, k8s client.Client, p *v1alpha1.RateLimitPolicy) error {
	return waitStatus(ctx, k8s, p, "Programmed", func(p *v1alpha1.RateLimitPolicy) bool {
		return meta.IsStatusConditionTrue(p.Status.Conditions, v1alpha1.ConditionProgrammed)
	})
}

// waitStatus waits up to a minute until the policy's status satisfies done.
func waitStatus(ctx context.Context, k8s client.Client, p *v1alpha1.RateLimitPolicy, what string, done func(*v1alpha1.RateLimitPolicy) bool) error {
	deadline := time.Now().Add(time.Minute)
	for {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(p), p); err != nil {
			return err
		}
		if done(p) {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			printConditions(p)
			return fmt.Errorf("the policy was not %s within a minute", what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// burst sends n requests at once from one client and prints what each got back.
func burst(ctx context.Context, proxyURL string, n int) error {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	_, _ = fmt.Fprintln(w, "    #\tSTATUS\tRETRY-AFTER\tRATELIMIT\tRATELIMIT-POLICY")
	passed := 0
	for i := 1; i <= n; i++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, proxyURL+"/orders", nil)
		req.Header.Set("X-Client", "demo-user")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		_ = resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			passed++
		}
		retry := resp.Header.Get("Retry-After")
		if retry == "" {
			retry = "-"
		}
		_, _ = fmt.Fprintf(w, "    %d\t%s\t%s\t%s\t%s\n", i, resp.Status, retry, resp.Header.Get("RateLimit"), resp.Header.Get("RateLimit-Policy"))
	}
	_ = w.Flush()
	detail("%d passed, %d refused: the bucket holds 5 and refills 1 per second; a refused request costs nothing", passed, n-passed)
	return nil
}

func printConditions(p *v1alpha1.RateLimitPolicy) {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	_, _ = fmt.Fprintln(w, "    TYPE\tSTATUS\tREASON\tMESSAGE")
	for _, c := range p.Status.Conditions {
		_, _ = fmt.Fprintf(w, "    %s\t%s\t%s\t%s\n", c.Type, c.Status, c.Reason, c.Message)
	}
	_ = w.Flush()
}
