package e2e_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// BenchmarkProgrammedAgainstItsCeiling measures how far the manager is from the fastest the test
// control plane can program SLUICE_BENCH_POLICIES policies (default 100), side by side in one
// run, on control planes started alike (API server, etcd, kube-controller-manager, no kubelet):
//
//   - ceiling-apply: no manager; 64 workers of a bare, unthrottled client create each policy's
//     Service and policy, then server-side apply the objects the controller renders for it
//     (its config and its pool of one, as render makes them with the manager's default
//     NetworkPolicy, with the manager's field owner) and write its Programmed condition: the
//     manager's writes with none of its reads, caches, queue or webhook;
//
//   - ceiling-create: the same with a create for each object instead of an apply, the cheaper
//     write for the API server;
//
//   - manager: the real manager binary with its webhook served, the policies and Services
//     created by as many workers as the ceilings have, until every one is Programmed;
//     manager-all-created is when the last policy was admitted. (With the 8 creating workers
//     of the other benchmarks, the manager programs each policy within a second of its
//     creation: those runs measure the creation.)
//
//     SLUICE_BENCH_POLICIES=1000 go test -run '^$' -bench ProgrammedAgainstItsCeiling -benchtime 1x -timeout 60m ./test/e2e/
func BenchmarkProgrammedAgainstItsCeiling(b *testing.B) {
	n := 100
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_POLICIES")); err == nil {
		n = v
	}
	logf.SetLogger(logr.Discard()) // the bare clients' warnings, which no one reads here
	for b.Loop() {
		for _, create := range []bool{false, true} {
			env, err := testenv.Start(testenv.WithControllers())
			if err != nil {
				b.Fatal(err)
			}
			k8s := unthrottledClient(b, env.Config)
			ns := makeNamespace(b, k8s, "ceiling-")
			start := time.Now()
			writes := programBare(b, k8s, ns, n, create)
			took := time.Since(start)
			name := "s-ceiling-apply"
			if create {
				name = "s-ceiling-create"
			}
			b.ReportMetric(took.Seconds(), name)
			b.ReportMetric(float64(writes)/took.Seconds(), name[2:]+"-writes/s")
			_ = env.Stop()
		}

		c := startCluster(b)
		args := append([]string{"--enforcer-image=sluice-enforcer:bench"}, strings.Fields(os.Getenv("SLUICE_BENCH_MANAGER_FLAGS"))...)
		mgr, err := local.StartManager(context.Background(), c.env, c.managerBin, c.kubeconfig, &local.Output{}, args...)
		if err != nil {
			b.Fatal(err)
		}
		k8s := c.unthrottled(b)
		ns := makeNamespace(b, k8s, "manager-")
		start := time.Now()
		populateWith(b, k8s, ns, n, bareWorkers)
		created := time.Since(start)
		poll.WaitFor(b, 30*time.Minute, func() error { return allProgrammed(k8s, ns, n) })
		b.ReportMetric(time.Since(start).Seconds(), "s-manager")
		b.ReportMetric(created.Seconds(), "s-manager-all-created")
		mgr.Stop()
	}
}

// programBare does by hand, with bareWorkers workers, what the manager does to program n new policies
// (see BenchmarkProgrammedAgainstItsCeiling), and returns the writes it sent.
func programBare(b *testing.B, k8s client.Client, ns string, n int, create bool) int64 {
	b.Helper()
	ctx := context.Background()
	var writes atomic.Int64
	var wg sync.WaitGroup
	for w := range bareWorkers {
		wg.Go(func() {
			for i := w; i < n; i += bareWorkers {
				svc, p := benchPolicy(ns, i)
				if err := k8s.Create(ctx, svc); err != nil {
					b.Error(err)
					return
				}
				if err := k8s.Create(ctx, p); err != nil {
					b.Error(err)
					return
				}
				d := render.Defaults{EnforcerImage: "sluice-enforcer:bench", RedisImage: "redis:bench",
					NetworkPolicy: &render.NetworkPolicyDefaults{ManagerNamespace: local.Namespace}}
				pool := render.OneOf(p, d)
				cm, _, err := pool.Config(p, svc)
				if err != nil {
					b.Error(err)
					return
				}
				objs, err := pool.Objects(d, svc)
				if err != nil {
					b.Error(err)
					return
				}
				for _, o := range append([]client.Object{cm}, objs.All()...) {
					if err := writeBare(ctx, k8s, o, create); err != nil {
						b.Error(err)
						return
					}
					writes.Add(1)
				}
				meta.SetStatusCondition(&p.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionProgrammed, Status: metav1.ConditionTrue,
					Reason: "Programmed", Message: "bench", ObservedGeneration: p.Generation})
				p.Status.ObservedGeneration = p.Generation
				if err := k8s.Status().Update(ctx, p); err != nil {
					b.Error(err)
					return
				}
				writes.Add(3) // the Service, the policy and its status
			}
		})
	}
	wg.Wait()
	return writes.Load()
}

// writeBare sends one rendered object as the manager would (an apply with its field owner), or as
// a create.
func writeBare(ctx context.Context, k8s client.Client, o client.Object, create bool) error {
	if create {
		return k8s.Create(ctx, o)
	}
	gvk, err := apiutil.GVKForObject(o, clientgoscheme.Scheme)
	if err != nil {
		return err
	}
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(o)
	if err != nil {
		return err
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetGroupVersionKind(gvk)
	unstructured.RemoveNestedField(u.Object, "metadata", "creationTimestamp")
	unstructured.RemoveNestedField(u.Object, "status")
	return k8s.Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(controllers.FieldOwner), client.ForceOwnership)
}

// unthrottledClient is cluster.unthrottled for a control plane started without the manager.
func unthrottledClient(t testing.TB, cfg *rest.Config) client.Client {
	t.Helper()
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = -1, 0
	k8s, err := client.New(cfg, client.Options{Scheme: clientgoscheme.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	return k8s
}

// allProgrammed reports an error until the n policies of ns are all Programmed.
func allProgrammed(k8s client.Client, ns string, n int) error {
	var list v1alpha1.RateLimitPolicyList
	if err := k8s.List(context.Background(), &list, client.InNamespace(ns)); err != nil {
		return err
	}
	done := 0
	for _, p := range list.Items {
		if meta.IsStatusConditionTrue(p.Status.Conditions, v1alpha1.ConditionProgrammed) {
			done++
		}
	}
	if done != n {
		return fmt.Errorf("%d of %d Programmed", done, n)
	}
	return nil
}

// bareWorkers is how many policies programBare programs at once: enough writes in flight to
// keep the API server busy (the manager has up to 16 workers of up to 4 concurrent applies).
const bareWorkers = 64

// BenchmarkEnforcersStartCeiling measures the floor under BenchmarkPoliciesReachReady's
// s-to-all-ready on this machine: how long SLUICE_BENCH_POLICIES enforcers (default 100) take to
// start and become ready with the stand-in kubelet alone, no manager. On a control plane with
// kube-controller-manager and no webhook, bareWorkers workers of a bare, unthrottled client create
// each policy and its Service and apply the objects the controller renders for it (as
// ceiling-apply does); kube-controller-manager makes the ReplicaSets and pods, and the stand-in
// kubelet runs one enforcer process per pod, as in BenchmarkPoliciesReachReady. Reported: when
// every object was written (s-written), when every pod was Ready (s-to-all-pods-ready), and when
// the Deployment controller counted every Deployment available (s-to-all-available), which a
// policy's Ready condition waits for too; all from the first create. Issue 27 holds Ready to this
// ceiling plus 20 s. With SLUICE_BENCH_PROFILE=<dir> it writes the API server's metrics at the end
// into dir (apiserver-metrics.txt), as BenchmarkPoliciesReachReady does.
//
//	SLUICE_BENCH_POLICIES=1000 go test -run '^$' -bench EnforcersStartCeiling -benchtime 1x -timeout 60m ./test/e2e/
func BenchmarkEnforcersStartCeiling(b *testing.B) {
	n := 100
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_POLICIES")); err == nil {
		n = v
	}
	logf.SetLogger(logr.Discard())
	for b.Loop() {
		ctx := context.Background()
		env, err := testenv.Start(testenv.WithControllers())
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = env.Stop() })
		enforcerBin, err := local.BuildCmd(ctx, b.TempDir(), "enforcer")
		if err != nil {
			b.Fatal(err)
		}
		k8s := unthrottledClient(b, env.Config)
		ns := makeNamespace(b, k8s, "start-")
		upstream := okUpstream(b)
		kubelet, err := local.StartKubelet(ctx, env.Client, env.Config, enforcerBin,
			local.KubeletOptions{Namespace: ns, Upstream: upstream.URL, Dir: b.TempDir(), Log: &local.Output{}})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(kubelet.Stop)
		start := time.Now()
		programBare(b, k8s, ns, n, false)
		written := time.Since(start)
		poll.WaitFor(b, 30*time.Minute, func() error { return allPodsReady(k8s, ns, n) })
		podsReady := time.Since(start)
		poll.WaitFor(b, 30*time.Minute, func() error { return allAvailable(k8s, ns, n) })
		if dir := os.Getenv("SLUICE_BENCH_PROFILE"); dir != "" {
			saveAPIServerMetrics(b, env.Config, filepath.Join(dir, "apiserver-metrics.txt"))
		}
		b.ReportMetric(written.Seconds(), "s-written")
		b.ReportMetric(podsReady.Seconds(), "s-to-all-pods-ready")
		b.ReportMetric(time.Since(start).Seconds(), "s-to-all-available")
	}
}

// allAvailable reports an error until ns holds n Deployments that the Deployment controller
// counts rolled out and available, as a policy's Ready condition asks.
func allAvailable(k8s client.Client, ns string, n int) error {
	var deps appsv1.DeploymentList
	if err := k8s.List(context.Background(), &deps, client.InNamespace(ns)); err != nil {
		return err
	}
	done := 0
	for _, d := range deps.Items {
		want := ptr.Deref(d.Spec.Replicas, 1)
		if d.Status.ObservedGeneration >= d.Generation && d.Status.UpdatedReplicas == want && d.Status.AvailableReplicas >= want && d.Status.Replicas == want {
			done++
		}
	}
	if done != n {
		return fmt.Errorf("%d of %d Deployments available", done, n)
	}
	return nil
}

// allPodsReady reports an error until ns holds n enforcer pods, all Ready.
func allPodsReady(k8s client.Client, ns string, n int) error {
	var pods corev1.PodList
	if err := k8s.List(context.Background(), &pods, client.InNamespace(ns),
		client.MatchingLabels{render.EnforcerPodLabelKey: render.EnforcerPodLabelValue}); err != nil {
		return err
	}
	ready := 0
	for _, p := range pods.Items {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue && p.DeletionTimestamp == nil {
				ready++
			}
		}
	}
	if ready != n {
		return fmt.Errorf("%d of %d enforcer pods Ready", ready, n)
	}
	return nil
}

// BenchmarkPoolReadyCeiling is the floor under BenchmarkPoolPoliciesReachReady's time from the
// first create to every policy Ready: no manager, webhook or enforcers; bareWorkers workers of a
// bare, unthrottled client write, for each of SLUICE_BENCH_POLICIES pooled policies (default
// 1,000), what any controller of a pool must: the policy's Service and the policy (as the
// benchmark creates them), the policy's ConfigMap that the pool's replicas read
// (render.PoolConfigMap), and one status write with Accepted, Programmed and Ready, which a
// manager that hears from the enforcers writes in two. Run it in the same go test beside the
// pool's benchmark with as many creators:
//
//	SLUICE_BENCH_POLICIES=1000 SLUICE_BENCH_CREATORS=64 go test -run '^$' -bench 'PoolReadyCeiling|PoolPoliciesReachReady' -benchtime 1x -timeout 60m ./test/e2e/
func BenchmarkPoolReadyCeiling(b *testing.B) {
	n := 1000
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_POLICIES")); err == nil {
		n = v
	}
	logf.SetLogger(logr.Discard())
	for b.Loop() {
		env, err := testenv.Start(testenv.WithControllers())
		if err != nil {
			b.Fatal(err)
		}
		k8s := unthrottledClient(b, env.Config)
		ns := makeNamespace(b, k8s, "pool-ceiling-")
		pool := &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "shared"}}
		if err := k8s.Create(context.Background(), pool); err != nil {
			b.Fatal(err)
		}
		ctx := context.Background()
		var writes atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		for w := range bareWorkers {
			wg.Go(func() {
				for i := w; i < n; i += bareWorkers {
					svc, p := benchPolicy(ns, i)
					p.Spec.Enforcer = &v1alpha1.EnforcerSpec{PoolRef: &v1alpha1.PoolRef{Name: pool.Name}}
					for _, o := range []client.Object{svc, p} {
						if err := k8s.Create(ctx, o); err != nil {
							b.Error(err)
							return
						}
					}
					cm, _, err := render.PoolConfigMap(p, pool)
					if err == nil {
						err = k8s.Create(ctx, cm)
					}
					if err != nil {
						b.Error(err)
						return
					}
					for _, c := range []string{v1alpha1.ConditionAccepted, v1alpha1.ConditionProgrammed, v1alpha1.ConditionReady} {
						meta.SetStatusCondition(&p.Status.Conditions, metav1.Condition{Type: c, Status: metav1.ConditionTrue,
							Reason: c, Message: "bench", ObservedGeneration: p.Generation})
					}
					p.Status.ObservedGeneration = p.Generation
					if err := k8s.Status().Update(ctx, p); err != nil {
						b.Error(err)
						return
					}
					writes.Add(4)
				}
			})
		}
		wg.Wait()
		took := time.Since(start)
		b.ReportMetric(took.Seconds(), "s-ceiling-all-ready")
		b.ReportMetric(float64(writes.Load())/took.Seconds(), "ceiling-writes/s")
		_ = env.Stop()
	}
}
