package e2e_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
)

// After settling, 200 idle policies cause no writes, no applies and no reconciles: the manager
// reads their replicas' reports every interval (its default, 10s) and brings a policy to the
// reconciler only when a report changed. 190 policies have pods that no kubelet runs, as on a
// cluster short of nodes; 10 have enforcers that run and report. The writes of every kind the
// manager writes are counted through watches for 40 s, four report intervals, and the manager's
// own metrics show it kept reading every report meanwhile, sent no apply, and reconciled fewer
// times than once per policy. The thousand-policy run of the same test is in the benchmark tier
// (make bench).
func TestStatusWhenPoliciesIdleThenNothingIsWrittenOrApplied(t *testing.T) {
	idlePolicies(t, 10, 190, 40*time.Second)
}

// idlePolicies creates running policies whose enforcers run and pending ones whose pods wait for
// a node, waits until they settle, then counts the manager's writes and applies for d: none.
func idlePolicies(t *testing.T, running, pending int, d time.Duration) {
	t.Helper()
	ctx := context.Background()
	c := startCluster(t)
	logs := newProcessLog(t)
	metricsAddr, _ := local.FreeAddr()
	mgr, err := local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, logs, "--enforcer-image=sluice-enforcer:idle",
		"--metrics-bind-address="+metricsAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mgr.Stop)
	upstream := okUpstream(t)
	k8s := c.unthrottled(t)
	runningNS, pendingNS := makeNamespace(t, k8s, "idle-running-"), makeNamespace(t, k8s, "idle-pending-")
	c.runPods(t, runningNS, upstream.URL, logs)
	created := time.Now()
	populate(t, k8s, runningNS, running)
	populate(t, k8s, pendingNS, pending)
	total := running + pending

	// Settled: every policy Programmed at its generation, the running ones Ready, and no policy
	// written for three intervals.
	poll.WaitFor(t, 10*time.Minute, func() error {
		var list v1alpha1.RateLimitPolicyList
		if err := k8s.List(ctx, &list); err != nil {
			return err
		}
		programmed, ready := 0, 0
		for _, p := range list.Items {
			if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionProgrammed); c != nil && c.Status == metav1.ConditionTrue && p.Status.ObservedGeneration == p.Generation {
				programmed++
			}
			if p.Namespace == runningNS && meta.IsStatusConditionTrue(p.Status.Conditions, v1alpha1.ConditionReady) {
				ready++
			}
		}
		if programmed != total || ready != running {
			return fmt.Errorf("%d of %d Programmed, %d of %d running Ready", programmed, total, ready, running)
		}
		return nil
	})
	t.Logf("%d Programmed and the %d running Ready %v after the first create", total, running, time.Since(created).Round(time.Second))
	quietFor(t, k8s, 5*time.Minute)
	t.Logf("settled %v after the first create", time.Since(created).Round(time.Second))

	const reconciles, applies, reads = `controller_runtime_reconcile_total{controller="ratelimitpolicy"`, "sluice_manager_applies_total{",
		"sluice_manager_report_reads_total"
	reconciledBefore, appliedBefore, readBefore := scrapeSum(t, metricsAddr, reconciles), scrapeSum(t, metricsAddr, applies), scrapeSum(t, metricsAddr, reads)
	writes := countWrites(t, k8s, d)
	reconciled, applied := scrapeSum(t, metricsAddr, reconciles)-reconciledBefore, scrapeSum(t, metricsAddr, applies)-appliedBefore
	read := scrapeSum(t, metricsAddr, reads) - readBefore
	if len(writes) > 0 {
		t.Errorf("writes in %v of %d idle policies: %v, want none", d, total, writes)
	}
	if applied > 0 {
		t.Errorf("%v applies in %v of %d idle policies, want none: a report-only tick applied", applied, d, total)
	}
	// Every running replica is read again each interval; at least half the rounds must have run.
	// The pending ones have no address to read.
	rounds := int(d / (10 * time.Second))
	if read < float64(running*rounds/2) {
		t.Errorf("%v report reads in %v, want at least %d: the manager stopped reading reports", read, d, running*rounds/2)
	}
	if reconciled >= float64(total) {
		t.Errorf("%v reconciles in %v of %d idle policies, want fewer than one per policy: report-only ticks reconciled", reconciled, d, total)
	}
	t.Logf("%v of %d idle policies: %v report reads, %v reconciles, 0 writes, 0 applies", d, total, read, reconciled)
}

func makeNamespace(t testing.TB, k8s client.Client, prefix string) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix}}
	if err := k8s.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

// populate creates n memory-storage policies, each in front of a Service of its own, 8 at a time.
func populate(t testing.TB, k8s client.Client, ns string, n int) {
	t.Helper()
	populateWith(t, k8s, ns, n, 8)
}

// benchPolicy is the i-th policy of the benchmarks, with the Service it fronts: memory storage,
// one rule.
func benchPolicy(ns string, i int) (*corev1.Service, *v1alpha1.RateLimitPolicy) {
	name := "p" + strconv.Itoa(i)
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 8080}}}}
	p := &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: name, Port: 8080},
			Rules: []v1alpha1.Rule{{Name: "per-client", Key: []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("X-Client")}},
				FixedWindow: &v1alpha1.Window{Limit: 100, Window: "1m"}}},
		},
	}
	return svc, p
}

// populateWith is populate with workers creating at once.
func populateWith(t testing.TB, k8s client.Client, ns string, n, workers int) {
	t.Helper()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < n; i += workers {
				svc, p := benchPolicy(ns, i)
				for _, o := range []client.Object{svc, p} {
					if err := k8s.Create(context.Background(), o); err != nil {
						t.Error(err)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
}

// watched are the kinds the manager writes, counted by countWrites: the policies' configs, every
// kind render.PoolObjects holds, and the policies' and pools' status.
var watched = []client.ObjectList{&v1alpha1.RateLimitPolicyList{}, &v1alpha1.EnforcerPoolList{}, &corev1.ConfigMapList{}, &corev1.ServiceList{}, &appsv1.DeploymentList{},
	&corev1.ServiceAccountList{}, &rbacv1.RoleList{}, &rbacv1.RoleBindingList{}, &networkingv1.NetworkPolicyList{},
	&policyv1.PodDisruptionBudgetList{}, &corev1.SecretList{}}

// countWrites watches every kind the manager writes for d and returns the writes seen, as
// "<kind> <namespace>/<name> <event>" with their counts.
func countWrites(t testing.TB, k8s client.WithWatch, d time.Duration) map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var mu sync.Mutex
	writes := map[string]int{}
	var wg sync.WaitGroup
	for _, list := range watched {
		// From now: the list's resourceVersion, so no initial events.
		l := list.DeepCopyObject().(client.ObjectList)
		if err := k8s.List(ctx, l, client.Limit(1)); err != nil {
			t.Fatal(err)
		}
		w, err := k8s.Watch(ctx, list.DeepCopyObject().(client.ObjectList), &client.ListOptions{Raw: &metav1.ListOptions{ResourceVersion: l.GetResourceVersion()}})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			defer w.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case ev, ok := <-w.ResultChan():
					if !ok {
						return
					}
					if ev.Type == watch.Bookmark || ev.Type == watch.Error {
						continue
					}
					o := ev.Object.(client.Object)
					mu.Lock()
					writes[fmt.Sprintf("%T %s/%s %s", o, o.GetNamespace(), o.GetName(), ev.Type)]++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	return writes
}

// quietFor waits until no policy is written for 30 s, at most within timeout.
func quietFor(t testing.TB, k8s client.WithWatch, timeout time.Duration) {
	t.Helper()
	const quiet = 30 * time.Second
	poll.WaitFor(t, timeout, func() error {
		var list v1alpha1.RateLimitPolicyList
		if err := k8s.List(context.Background(), &list); err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), quiet)
		defer cancel()
		w, err := k8s.Watch(ctx, &v1alpha1.RateLimitPolicyList{}, &client.ListOptions{Raw: &metav1.ListOptions{ResourceVersion: list.ResourceVersion}})
		if err != nil {
			return err
		}
		n := 0
		for ev := range w.ResultChan() {
			if ev.Type != watch.Bookmark {
				n++
			}
		}
		if n > 0 {
			return fmt.Errorf("policies still written: %d writes in %v", n, quiet)
		}
		return nil
	})
}

// scrapeSum adds up the samples of the manager's metrics whose line starts with prefix.
func scrapeSum(t testing.TB, addr, prefix string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	sum := 0.0
	s := bufio.NewScanner(resp.Body)
	for s.Scan() {
		line := s.Text()
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		fields := strings.Fields(line)
		v, _ := strconv.ParseFloat(fields[len(fields)-1], 64)
		sum += v
	}
	return sum
}

// BenchmarkPoliciesReachReady creates SLUICE_BENCH_POLICIES policies (default 100) at once with
// the manager binary at its defaults (report collection every 10s) and kube-controller-manager,
// the kubelet stand-in running one enforcer process per policy, and measures the time until
// every policy is Programmed and until every one is Ready from its enforcer's report; then, at
// steady state, the status writes per second and the manager's CPU over a minute. It reports the
// manager's CPU time and peak resident memory over the whole run too, and the longest any one
// policy waited from its creation to Programmed and to Ready. Each enforcer process
// holds about 15 MB: a thousand need about 16 GB.
//
// The policies are created by SLUICE_BENCH_CREATORS clients at once (default 8; the ceilings of
// ceiling_test.go use 64), and s-all-created is when the last was admitted.
//
// With SLUICE_BENCH_PROFILE=<dir> it writes the manager's CPU profiles of the first 60 s after
// the first create (rollout.pprof) and of the steady minute (steady.pprof), its heap at steady
// state (heap.pprof), and the API server's metrics then (apiserver-metrics.txt: every request of
// the run by resource and verb), into dir.
//
//	SLUICE_BENCH_POLICIES=1000 go test -run '^$' -bench PoliciesReachReady -benchtime 1x -timeout 60m ./test/e2e/
func BenchmarkPoliciesReachReady(b *testing.B) {
	n := 100
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_POLICIES")); err == nil {
		n = v
	}
	creators := 8
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_CREATORS")); err == nil && v > 0 {
		creators = v
	}
	for b.Loop() {
		ctx := context.Background()
		c := startCluster(b)
		var logs io.Writer = &local.Output{}
		if path := os.Getenv("SLUICE_BENCH_LOG"); path != "" {
			f, err := os.Create(path)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = f.Close() })
			logs = f
		}
		profiles := os.Getenv("SLUICE_BENCH_PROFILE")
		pprofAddr, _ := local.FreeAddr()
		args := []string{"--enforcer-image=sluice-enforcer:bench"}
		if profiles != "" {
			args = append(args, "--pprof-bind-address="+pprofAddr)
		}
		mgr, err := local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, logs, args...)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(mgr.Stop)
		upstream := okUpstream(b)
		k8s := c.unthrottled(b)
		ns := makeNamespace(b, k8s, "bench-")
		c.runPods(b, ns, upstream.URL, logs)

		var profiling sync.WaitGroup
		profile := func(file, path string) {
			if profiles != "" {
				profiling.Go(func() { saveProfile(b, filepath.Join(profiles, file), "http://"+pprofAddr+path) })
			}
		}
		start := time.Now()
		profile("rollout.pprof", "/debug/pprof/profile?seconds=60")
		populateWith(b, k8s, ns, n, creators)
		created := time.Since(start)
		var programmed, ready time.Duration
		err = poll.Every(500*time.Millisecond, 30*time.Minute, func() error {
			var list v1alpha1.RateLimitPolicyList
			if err := k8s.List(ctx, &list, client.InNamespace(ns)); err != nil {
				b.Fatal(err)
			}
			p, r := 0, 0
			for _, pol := range list.Items {
				if meta.IsStatusConditionTrue(pol.Status.Conditions, v1alpha1.ConditionProgrammed) {
					p++
				}
				if meta.IsStatusConditionTrue(pol.Status.Conditions, v1alpha1.ConditionReady) {
					r++
				}
			}
			if p == n && programmed == 0 {
				programmed = time.Since(start)
			}
			if r == n && ready == 0 {
				ready = time.Since(start)
			}
			if programmed == 0 || ready == 0 {
				return fmt.Errorf("%d of %d Programmed, %d Ready", p, n, r)
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
		// Each policy's own latency, from its creation to its condition (both in whole seconds):
		// what a user who applies one policy among a thousand waits for.
		var list v1alpha1.RateLimitPolicyList
		if err := k8s.List(ctx, &list, client.InNamespace(ns)); err != nil {
			b.Fatal(err)
		}
		var toProgrammed, toReady time.Duration
		for _, pol := range list.Items {
			created := pol.CreationTimestamp.Time
			toProgrammed = max(toProgrammed, meta.FindStatusCondition(pol.Status.Conditions, v1alpha1.ConditionProgrammed).LastTransitionTime.Sub(created))
			toReady = max(toReady, meta.FindStatusCondition(pol.Status.Conditions, v1alpha1.ConditionReady).LastTransitionTime.Sub(created))
		}
		quietFor(b, k8s, 10*time.Minute)
		cpuBefore, _ := mgr.Usage()
		profile("steady.pprof", "/debug/pprof/profile?seconds=55")
		writes := countWrites(b, k8s, time.Minute)
		profile("heap.pprof", "/debug/pprof/heap?gc=1")
		profiling.Wait()
		if profiles != "" {
			saveAPIServerMetrics(b, c.env.Config, filepath.Join(profiles, "apiserver-metrics.txt"))
		}
		cpuSteady, _ := mgr.Usage()
		total := 0
		for _, w := range writes {
			total += w
		}
		cpu, rss := mgr.Usage()
		b.ReportMetric(created.Seconds(), "s-all-created")
		b.ReportMetric(programmed.Seconds(), "s-to-all-programmed")
		b.ReportMetric(ready.Seconds(), "s-to-all-ready")
		b.ReportMetric(toProgrammed.Seconds(), "s-max-created-to-programmed")
		b.ReportMetric(toReady.Seconds(), "s-max-created-to-ready")
		b.ReportMetric(float64(total)/60, "writes/s-steady")
		b.ReportMetric(cpu.Seconds(), "manager-cpu-s")
		b.ReportMetric(100*(cpuSteady-cpuBefore).Seconds()/60, "manager-cpu-%-steady")
		b.ReportMetric(rss/(1<<20), "manager-MiB-peak-RSS")
	}
}

// saveAPIServerMetrics writes the API server's own metrics to file: apiserver_request_total
// counts every request of the run by resource, subresource and verb, whoever sent it.
func saveAPIServerMetrics(t testing.TB, cfg *rest.Config, file string) {
	t.Helper()
	saveFromAPIServer(t, cfg, "/metrics", file)
}

// saveFromAPIServer writes what the API server serves at path (its metrics, or a profile under
// /debug/pprof) to file, asked with the test's credentials.
func saveFromAPIServer(t testing.TB, cfg *rest.Config, path, file string) {
	t.Helper()
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		t.Error(err)
		return
	}
	resp, err := hc.Get(strings.TrimSuffix(cfg.Host, "/") + path)
	if err != nil {
		t.Error(err)
		return
	}
	defer func() { _ = resp.Body.Close() }()
	data, err := io.ReadAll(resp.Body)
	if err == nil {
		err = os.WriteFile(file, data, 0o644)
	}
	if err != nil {
		t.Error(err)
	}
}

// saveProfile writes what url serves to file.
func saveProfile(t testing.TB, file, url string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Error(err)
		return
	}
	defer func() { _ = resp.Body.Close() }()
	data, err := io.ReadAll(resp.Body)
	if err == nil {
		err = os.WriteFile(file, data, 0o644)
	}
	if err != nil {
		t.Error(err)
	}
}

// BenchmarkManagerMemory creates SLUICE_BENCH_POLICIES policies (default 100) whose pods no
// kubelet runs, waits until every one is Programmed and no status is written for 30 s, and
// reports the manager's Go heap in use (go_memstats_heap_inuse_bytes, after the manager's own
// GC) and its resident memory then, and its peak resident memory: the state the manager keeps
// per policy, and its caches of every object it owns.
//
//	SLUICE_BENCH_POLICIES=3000 go test -run '^$' -bench ManagerMemory -benchtime 1x -timeout 60m ./test/e2e/
func BenchmarkManagerMemory(b *testing.B) {
	n := 100
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_POLICIES")); err == nil {
		n = v
	}
	for b.Loop() {
		ctx := context.Background()
		c := startCluster(b)
		metricsAddr, _ := local.FreeAddr()
		mgr, err := local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, &local.Output{}, "--enforcer-image=sluice-enforcer:bench",
			"--metrics-bind-address="+metricsAddr)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(mgr.Stop)
		k8s := c.unthrottled(b)
		ns := makeNamespace(b, k8s, "memory-")
		start := time.Now()
		populate(b, k8s, ns, n)
		poll.WaitFor(b, 30*time.Minute, func() error { return allProgrammed(k8s, ns, n) })
		programmed := time.Since(start)
		quietFor(b, k8s, 10*time.Minute)
		heap := scrapeSum(b, metricsAddr, "go_memstats_heap_inuse_bytes")
		_, peak := mgr.Usage()
		b.ReportMetric(programmed.Seconds(), "s-to-all-programmed")
		b.ReportMetric(heap/(1<<20), "manager-MiB-heap-inuse")
		b.ReportMetric(mgr.RSS()/(1<<20), "manager-MiB-RSS")
		b.ReportMetric(peak/(1<<20), "manager-MiB-peak-RSS")
	}
}
