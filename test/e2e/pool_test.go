package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// A pool beside a policy with its own enforcer, through the manager and enforcer binaries, the
// webhook and the real Deployment controller, on one Redis: both Ready; the pool's three
// replicas, asked at once through the check API and the rate limit service, admit exactly 100 of
// 1,000 requests of one client against a limit of 100; and a changed limit is decided by every
// replica of the pool within a second of the manager's write of it.
func TestPoolWhenThreeReplicasShareOneRedisThenExactly100Of1000PassAndChangesReachEveryReplica(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	k8s := c.env.Client
	redis := redistest.NewServer(t)
	logs := newProcessLog(t)
	mgr, err := local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, logs, "--enforcer-image=sluice-enforcer:e2e", "--report-interval=500ms")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mgr.Stop)
	upstream := okUpstream(t)
	ns := makeNamespace(t, k8s, "pool-")
	c.runPods(t, ns, upstream.URL, logs)
	for _, name := range []string{"pooled", "own"} {
		if err := k8s.Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 8080}}}}); err != nil {
			t.Fatal(err)
		}
	}
	// A generous timeout: with the race detector on two loaded cores, a call may pass the default
	// 50 ms, and a decision that fails open passes (101 of 1,000 once).
	store := &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redis.Addr())}, Timeout: ptr.To[v1alpha1.Duration]("5s")}}
	pool := &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "shared"},
		Spec: v1alpha1.EnforcerPoolSpec{Replicas: ptr.To[int32](3), Storage: store}}
	byClient := []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("X-Client")}}
	pooled := &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pooled"},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "pooled", Port: 8080},
			Rules:     []v1alpha1.Rule{{Name: "hundred", Key: byClient, FixedWindow: &v1alpha1.Window{Limit: 100, Window: "1h"}}},
			Enforcer:  &v1alpha1.EnforcerSpec{PoolRef: &v1alpha1.PoolRef{Name: "shared"}},
		}}
	own := &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "own"},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "own", Port: 8080},
			Rules:     []v1alpha1.Rule{{Name: "five", Key: byClient, FixedWindow: &v1alpha1.Window{Limit: 5, Window: "1h"}}},
			Storage:   store,
		}}
	for _, o := range []client.Object{pool, pooled, own} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	pooled = waitReady(t, k8s, client.ObjectKeyFromObject(pooled), 90*time.Second)
	waitReady(t, k8s, client.ObjectKeyFromObject(own), 90*time.Second)
	if e := pooled.Status.Enforcer; e.Ready != "3/3" || e.Pool != ns+"/shared" {
		t.Errorf("pooled status.enforcer %+v, want 3/3 of the pool", e)
	}
	poll.WaitFor(t, 30*time.Second, func() error {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
			return err
		}
		if !meta.IsStatusConditionTrue(pool.Status.Conditions, v1alpha1.ConditionReady) || pool.Status.Policies == nil || pool.Status.Policies.Served != 1 {
			return fmt.Errorf("pool %+v", pool.Status)
		}
		return nil
	})

	var podList corev1.PodList
	if err := k8s.List(ctx, &podList, client.InNamespace(ns), client.MatchingLabels(render.PoolPodLabels(pool))); err != nil || len(podList.Items) != 3 {
		t.Fatalf("pool pods: %d, %v; want 3", len(podList.Items), err)
	}
	pods := podList.Items
	checkPath := "/policies/" + ns + "/pooled" + enforcer.ForwardAuthPath
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 10 * time.Second}
	// ask returns the check API's status and headers for one request of clientKey.
	ask := func(pod *corev1.Pod, clientKey string) (int, http.Header, error) {
		req, _ := http.NewRequest(http.MethodGet, local.PodURL(pod, "check")+checkPath, nil)
		req.Header.Set("X-Forwarded-Method", "GET")
		req.Header.Set("X-Forwarded-Uri", "/")
		req.Header.Set("X-Client", clientKey)
		resp, err := hc.Do(req)
		if err != nil {
			return 0, nil, err
		}
		_ = resp.Body.Close()
		return resp.StatusCode, resp.Header, nil
	}

	t.Run("when 1,000 requests of one client reach the three replicas at once then exactly 100 pass", func(t *testing.T) {
		conns := make([]rlsv3.RateLimitServiceClient, len(pods))
		for i := range pods {
			conn, err := grpc.NewClient(strings.TrimPrefix(local.PodURL(&pods[i], "rls"), "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = conn.Close() })
			conns[i] = rlsv3.NewRateLimitServiceClient(conn)
		}
		var allowed, refused, failed atomic.Int64
		var wg sync.WaitGroup
		work := make(chan int, 1000)
		for i := range 1000 {
			work <- i
		}
		close(work)
		for range 50 {
			wg.Go(func() {
				for i := range work {
					pod := i % len(pods)
					if i%2 == 0 {
						status, _, err := ask(&pods[pod], "exact")
						switch {
						case err != nil:
							failed.Add(1)
						case status == http.StatusOK:
							allowed.Add(1)
						case status == http.StatusTooManyRequests:
							refused.Add(1)
						default:
							failed.Add(1)
						}
						continue
					}
					resp, err := conns[pod].ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: ns + "/pooled",
						Descriptors: []*rlv3.RateLimitDescriptor{{Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "x-client", Value: "exact"}}}}})
					switch {
					case err != nil:
						failed.Add(1)
					case resp.GetOverallCode() == rlsv3.RateLimitResponse_OK:
						allowed.Add(1)
					default:
						refused.Add(1)
					}
				}
			})
		}
		wg.Wait()
		if allowed.Load() != 100 || refused.Load() != 900 || failed.Load() != 0 {
			t.Errorf("%d allowed, %d refused, %d failed of 1,000 across 3 replicas; want exactly 100, 900, 0", allowed.Load(), refused.Load(), failed.Load())
		}
	})

	t.Run("when the limit changes then every replica of the pool decides under it within a second of its ConfigMap", func(t *testing.T) {
		// config is the policy file the manager wrote for the pooled policy into the pool's
		// namespace: what the replicas watch.
		config := func() (string, error) {
			var cms corev1.ConfigMapList
			if err := k8s.List(ctx, &cms, client.InNamespace(ns), client.MatchingLabels{report.PoolLabel: report.LabelValue(pool.Name)}); err != nil {
				return "", err
			}
			for _, cm := range cms.Items {
				if cm.Annotations[report.PolicyAnnotation] == ns+"/pooled" {
					return cm.Data[report.PolicyFileKey], nil
				}
			}
			return "", fmt.Errorf("no ConfigMap of policy %s/pooled among %d of the pool", ns, len(cms.Items))
		}
		before, err := config()
		if err != nil {
			t.Fatal(err)
		}
		update(t, k8s, client.ObjectKeyFromObject(pooled), func(p *v1alpha1.RateLimitPolicy) { p.Spec.Rules[0].FixedWindow.Limit = 7 })
		updated := time.Now()
		// The manager's part, through the API server twice (its watch, its write): timed, not
		// bounded here. BenchmarkPoolPoliciesReachReady measures the whole change, at the 99th
		// percentile of a hundred, against its target of a second (docs/benchmarks.md).
		poll.WaitFor(t, 30*time.Second, func() error {
			now, err := config()
			if err == nil && now == before {
				err = errors.New("the pooled policy's ConfigMap still holds its old config")
			}
			return err
		})
		written := time.Now()
		// The replicas' part: one watch event each and one ConfigMap to load, in batches at
		// most 250 ms apart (enforcer/internal/config/watcher.go). A second is four of those
		// waits; a replica later than that was not woken by the event. A probe answered under
		// the old limit was sent before its replica decided under the new one, so the bound
		// holds the last such probe's sending, not the probes' pace or their time. Each replica
		// is probed apart, at once.
		const bound = time.Second
		var wg sync.WaitGroup
		for i := range pods {
			wg.Go(func() {
				var stale time.Time // the last probe answered under the old limit, when sent
				n := 0
				err := poll.Every(5*time.Millisecond, 30*time.Second, func() error {
					n++
					sent := time.Now()
					_, header, err := ask(&pods[i], fmt.Sprintf("probe-%d-%d", i, n))
					if err != nil {
						return err
					}
					if p := header.Get("RateLimit-Policy"); !strings.Contains(p, `"hundred";q=7;`) {
						stale = sent
						return fmt.Errorf("pod %s decides under RateLimit-Policy %s", pods[i].Name, p)
					}
					return nil
				})
				if err != nil {
					t.Error(err)
					return
				}
				t.Logf("pod %s decided under the new limit %v after its ConfigMap was seen written, %v after the update",
					pods[i].Name, time.Since(written).Round(time.Millisecond), time.Since(updated).Round(time.Millisecond))
				if late := stale.Sub(written); late > bound {
					t.Errorf("pod %s decided under the old limit %v after its ConfigMap was written, want within %v", pods[i].Name, late, bound)
				}
			})
		}
		wg.Wait()
		t.Logf("the manager wrote the new config %v after the update", written.Sub(updated).Round(time.Millisecond))
		waitReady(t, k8s, client.ObjectKeyFromObject(pooled), 10*time.Second)
	})
}
