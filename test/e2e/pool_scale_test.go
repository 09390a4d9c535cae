package e2e_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// populatePooled creates n policies that join pool, each in front of a Service of its own (as
// benchPolicy's), workers at a time.
func populatePooled(t testing.TB, k8s client.Client, ns string, n, workers int, pool string) {
	t.Helper()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < n; i += workers {
				svc, p := benchPolicy(ns, i)
				p.Spec.Enforcer = &v1alpha1.EnforcerSpec{PoolRef: &v1alpha1.PoolRef{Name: pool}}
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

// metric reads one sample of an enforcer's /metrics.
func metric(t testing.TB, base, name string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	s := bufio.NewScanner(resp.Body)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), name+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

// BenchmarkPoolPoliciesReachReady is BenchmarkPoliciesReachReady for a pool, side by side: an
// EnforcerPool of two replicas on Redis, then SLUICE_BENCH_POLICIES policies (default 1,000)
// created at once by SLUICE_BENCH_CREATORS clients (default 8) that join it, with the manager
// binary at its defaults and kube-controller-manager. It reports the time until every policy is
// Ready (every pool replica reports serving its revision) from the first create, and the
// longest any one policy waited from its creation; the pool's enforcers' resident memory and Go
// heap with every policy loaded; at steady state the writes per second and the manager's CPU
// over a minute; and, with every policy loaded, how long a changed policy takes to be decided
// under on every replica, from the update to the first decision under it (SLUICE_BENCH_CHANGES
// updates, default 100, one at a time: p50, p99 and max over both replicas). With
// SLUICE_BENCH_PROFILE=<dir> it writes CPU profiles of the manager (rollout, steady) and of the
// API server (the rollout's first 30 s) into dir.
//
//	SLUICE_BENCH_POLICIES=10000 go test -run '^$' -bench PoolPoliciesReachReady -benchtime 1x -timeout 60m ./test/e2e/
func BenchmarkPoolPoliciesReachReady(b *testing.B) {
	n, creators, changes := 1000, 8, 100
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_POLICIES")); err == nil {
		n = v
	}
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_CREATORS")); err == nil && v > 0 {
		creators = v
	}
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_CHANGES")); err == nil && v > 0 {
		changes = v
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
		redis := redistest.NewServer(b)
		upstream := okUpstream(b)
		k8s := c.unthrottled(b)
		ns := makeNamespace(b, k8s, "pool-bench-")
		c.runPods(b, ns, upstream.URL, logs)
		pool := &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "shared"},
			Spec: v1alpha1.EnforcerPoolSpec{Replicas: ptr.To[int32](2),
				Storage: &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redis.Addr())}}}}}
		if err := k8s.Create(ctx, pool); err != nil {
			b.Fatal(err)
		}
		poll.WaitFor(b, 2*time.Minute, func() error {
			if err := k8s.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
				return err
			}
			if !meta.IsStatusConditionTrue(pool.Status.Conditions, v1alpha1.ConditionReady) {
				return fmt.Errorf("pool not Ready: %+v", pool.Status.Conditions)
			}
			return nil
		})

		var profiling sync.WaitGroup
		profile := func(file, path string) {
			if profiles != "" {
				profiling.Go(func() { saveProfile(b, filepath.Join(profiles, file), "http://"+pprofAddr+path) })
			}
		}
		// Ready is counted from a watch: listing thousands of policies each second would load the
		// API server whose work is measured.
		w, err := k8s.Watch(ctx, &v1alpha1.RateLimitPolicyList{}, client.InNamespace(ns))
		if err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		allReady := make(chan time.Duration, 1)
		go func() {
			defer w.Stop()
			defer close(allReady)
			isReady, count := map[string]bool{}, 0
			for ev := range w.ResultChan() {
				p, ok := ev.Object.(*v1alpha1.RateLimitPolicy)
				if !ok {
					continue
				}
				now := ev.Type != watch.Deleted && meta.IsStatusConditionTrue(p.Status.Conditions, v1alpha1.ConditionReady)
				if now != isReady[p.Name] {
					isReady[p.Name] = now
					count += map[bool]int{true: 1, false: -1}[now]
				}
				if count == n {
					allReady <- time.Since(start)
					return
				}
			}
		}()
		profile("pool-rollout.pprof", "/debug/pprof/profile?seconds=60")
		if profiles != "" {
			profiling.Go(func() {
				saveFromAPIServer(b, c.env.Config, "/debug/pprof/profile?seconds=30", filepath.Join(profiles, "apiserver-pool-rollout.pprof"))
			})
		}
		populatePooled(b, k8s, ns, n, creators, pool.Name)
		created := time.Since(start)
		var ready time.Duration
		select {
		case d, ok := <-allReady:
			if !ok {
				b.Fatal("the watch of the policies ended before every one was Ready")
			}
			ready = d
		case <-time.After(30 * time.Minute):
			b.Fatalf("after 30 minutes, not every one of %d policies is Ready", n)
		}
		var list v1alpha1.RateLimitPolicyList
		if err := k8s.List(ctx, &list, client.InNamespace(ns)); err != nil {
			b.Fatal(err)
		}
		var toReady time.Duration
		for _, pol := range list.Items {
			toReady = max(toReady, meta.FindStatusCondition(pol.Status.Conditions, v1alpha1.ConditionReady).LastTransitionTime.Sub(pol.CreationTimestamp.Time))
		}
		var pods corev1.PodList
		if err := k8s.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(render.PoolPodLabels(pool))); err != nil || len(pods.Items) != 2 {
			b.Fatalf("pool pods: %d, %v", len(pods.Items), err)
		}
		var rss, heap float64
		for i := range pods.Items {
			admin := local.PodURL(&pods.Items[i], "admin")
			rss = max(rss, metric(b, admin, "process_resident_memory_bytes"))
			heap = max(heap, metric(b, admin, "go_memstats_heap_inuse_bytes"))
		}

		quietFor(b, k8s, 10*time.Minute)
		cpuBefore, _ := mgr.Usage()
		profile("pool-steady.pprof", "/debug/pprof/profile?seconds=55")
		writes := countWrites(b, k8s, time.Minute)
		profiling.Wait()
		cpuSteady, _ := mgr.Usage()
		total := 0
		for _, w := range writes {
			total += w
		}

		// Changes, one at a time: from the update to the first decision under it, on each replica.
		var lat []time.Duration
		hc := &http.Client{Timeout: 5 * time.Second}
		for k := range changes {
			i := rand.IntN(n)
			key := client.ObjectKey{Namespace: ns, Name: "p" + strconv.Itoa(i)}
			limit := int64(1000 + k)
			updated := time.Now()
			if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
				p := &v1alpha1.RateLimitPolicy{}
				if err := k8s.Get(ctx, key, p); err != nil {
					return err
				}
				p.Spec.Rules[0].FixedWindow.Limit = limit
				return k8s.Update(ctx, p)
			}); err != nil {
				b.Fatal(err)
			}
			want := fmt.Sprintf(`"per-client";q=%d;`, limit)
			for j := range pods.Items {
				url := local.PodURL(&pods.Items[j], "check") + "/policies/" + ns + "/" + key.Name + enforcer.ForwardAuthPath
				try := 0
				// A probe every millisecond: the latency's resolution.
				if err := poll.Every(time.Millisecond, time.Until(updated.Add(30*time.Second)), func() error {
					try++
					req, _ := http.NewRequest(http.MethodGet, url, nil)
					req.Header.Set("X-Forwarded-Method", "GET")
					req.Header.Set("X-Forwarded-Uri", "/")
					req.Header.Set("X-Client", fmt.Sprintf("probe-%d-%d", k, try))
					resp, err := hc.Do(req)
					if err != nil {
						return err
					}
					_ = resp.Body.Close()
					if p := resp.Header.Get("RateLimit-Policy"); !strings.Contains(p, want) {
						return fmt.Errorf("RateLimit-Policy %s, want %s", p, want)
					}
					return nil
				}); err != nil {
					b.Fatalf("change %d (%s) not decided under by %s: %v", k, key.Name, pods.Items[j].Name, err)
				}
				lat = append(lat, time.Since(updated))
			}
		}
		slices.Sort(lat)
		pct := func(q float64) time.Duration { return lat[min(len(lat)-1, int(q*float64(len(lat))))] }

		cpu, mgrRSS := mgr.Usage()
		b.ReportMetric(created.Seconds(), "s-all-created")
		b.ReportMetric(ready.Seconds(), "s-to-all-ready")
		b.ReportMetric(toReady.Seconds(), "s-max-created-to-ready")
		b.ReportMetric(rss/(1<<20), "pool-enforcer-MiB-RSS")
		b.ReportMetric(heap/(1<<20), "pool-enforcer-MiB-heap-inuse")
		b.ReportMetric(float64(total)/60, "writes/s-steady")
		b.ReportMetric(100*(cpuSteady-cpuBefore).Seconds()/60, "manager-cpu-%-steady")
		b.ReportMetric(cpu.Seconds(), "manager-cpu-s")
		b.ReportMetric(mgrRSS/(1<<20), "manager-MiB-peak-RSS")
		b.ReportMetric(float64(pct(0.5).Milliseconds()), "ms-change-p50")
		b.ReportMetric(float64(pct(0.99).Milliseconds()), "ms-change-p99")
		b.ReportMetric(float64(lat[len(lat)-1].Milliseconds()), "ms-change-max")
		if total > 0 {
			b.Logf("steady writes: %v", writes)
		}
	}
}
