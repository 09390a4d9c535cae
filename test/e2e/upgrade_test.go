package e2e_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// upgradeFrom is the release the upgrade test installs first: the last commit whose manager
// rendered a policy's own enforcer in the policy's reconciler, before every policy was served by
// a pool.
const upgradeFrom = "95208e4"

// An upgrade of the manager under traffic: the manager and enforcers of upgradeFrom serve a
// policy with its own enforcer on Redis and a policy in a pool, and clients send to both; then
// this manager replaces the old one. No request is dropped, none is counted twice (each client
// gets exactly its limit, the upstream sees exactly the requests that passed, and the replicas'
// decisions are exactly the answers), no enforcer pod is created again (their UIDs stay, and no
// Deployment's generation moves), and both policies stay Ready, while the new manager shows it
// runs them: it writes their status and puts back a hand edit of their Services.
func TestManagerWhenUpgradedUnderTrafficThenNothingRollsNothingIsDroppedOrCountedTwice(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	k8s := c.env.Client
	oldManager, oldEnforcer := buildAt(t, upgradeFrom)
	redis := redistest.NewServer(t)
	logs := newProcessLog(t)
	flags := []string{"--enforcer-image=sluice-enforcer:upgrade", "--report-interval=500ms"}
	old, err := local.StartManager(ctx, c.env, oldManager, c.kubeconfig, logs, flags...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(old.Stop)
	var passed atomic.Int64 // requests the upstream received
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		passed.Add(1)
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(upstream.Close)
	ns := makeNamespace(t, k8s, "upgrade-")
	kubelet, err := local.StartKubelet(ctx, k8s, c.env.Config, oldEnforcer, local.KubeletOptions{Namespace: ns, Upstream: upstream.URL, Dir: t.TempDir(), Log: logs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kubelet.Stop)
	own, pooled, pool := upgradePolicies(t, k8s, ns, redis.Addr())
	for _, p := range []*v1alpha1.RateLimitPolicy{own, pooled} {
		waitReady(t, k8s, client.ObjectKeyFromObject(p), 90*time.Second)
	}
	before := snapshot(t, k8s, ns)
	changes := watchReady(t, c, ns)

	traffic := startTraffic(t, k8s, ns, pool)
	// The hot clients pass their limit through the old manager's enforcers, the others through the
	// new one's.
	traffic.waitFor(t, 2*upgradeHot*(upgradeLimit+1)+upgradeClients)
	old.Stop()
	switched := time.Now()
	mgr, err := local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, logs, flags...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mgr.Stop)
	newManagerRuns(t, k8s, ns, []string{"sluice-" + own.Name, render.PoolName(pool)}, switched)
	traffic.waitFor(t, max(traffic.sent()+200, 2*(upgradeClients-upgradeHot)*(upgradeLimit+1)))
	traffic.stop()

	traffic.check(t, ns, &passed)
	if after := snapshot(t, k8s, ns); after != before {
		t.Errorf("the upgrade re-created or rolled objects:\nbefore %s\nafter  %s", before, after)
	}
	if notReady := changes(); len(notReady) > 0 {
		t.Errorf("status left Ready during the upgrade: %v", notReady)
	}
}

// buildAt builds the manager and the enforcer of the commit rev, from the repository's own
// history (git archive), as the release users ran before.
func buildAt(t *testing.T, rev string) (manager, enforcer string) {
	t.Helper()
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		t.Fatal(err)
	}
	archive := exec.Command("sh", "-c", "git archive --format=tar "+rev+" | tar -x -C "+src)
	archive.Dir = testenv.RepoRoot()
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("git archive %s: %v\n%s", rev, err, out)
	}
	for _, name := range []string{"manager", "enforcer"} {
		build := local.GoBuild(context.Background(), src, "-o", filepath.Join(dir, name), "./cmd/"+name)
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("build %s at %s: %v\n%s", name, rev, err, out)
		}
	}
	return filepath.Join(dir, "manager"), filepath.Join(dir, "enforcer")
}

// upgradeLimit is what each client may send in an hour, to either policy.
const upgradeLimit = 30

// upgradePolicies creates a policy with two enforcers of its own on Redis, and a pool of two on
// Redis with a policy that joins it, each limiting every client to upgradeLimit an hour.
func upgradePolicies(t *testing.T, k8s client.Client, ns, redis string) (own, pooled *v1alpha1.RateLimitPolicy, pool *v1alpha1.EnforcerPool) {
	t.Helper()
	ctx := context.Background()
	for _, name := range []string{"own", "pooled"} {
		if err := k8s.Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 8080}}}}); err != nil {
			t.Fatal(err)
		}
	}
	// A generous timeout: with the race detector on two loaded cores, a call may pass the default
	// 50 ms, and a decision that fails open would pass beyond the limit.
	store := &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redis)}, Timeout: ptr.To[v1alpha1.Duration]("5s")}}
	rules := []v1alpha1.Rule{{Name: "per-client", FailureMode: v1alpha1.FailClosed,
		Key:         []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("X-Client")}},
		FixedWindow: &v1alpha1.Window{Limit: upgradeLimit, Window: "1h"}}}
	pool = &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "shared"},
		Spec: v1alpha1.EnforcerPoolSpec{Replicas: ptr.To[int32](2), Storage: store}}
	own = &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "own"}, Spec: v1alpha1.RateLimitPolicySpec{
		TargetRef: v1alpha1.TargetRef{Name: "own", Port: 8080}, Rules: rules, Storage: store,
		Enforcer: &v1alpha1.EnforcerSpec{Replicas: ptr.To[int32](2)}}}
	pooled = &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pooled"}, Spec: v1alpha1.RateLimitPolicySpec{
		TargetRef: v1alpha1.TargetRef{Name: "pooled", Port: 8080}, Rules: rules,
		Enforcer: &v1alpha1.EnforcerSpec{PoolRef: &v1alpha1.PoolRef{Name: "shared"}}}}
	for _, o := range []client.Object{pool, own, pooled} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), pool) })
	return own, pooled, pool
}

// snapshot names every pod and every object of the manager's in the namespace, with its UID and
// generation, and the resourceVersion of those that have no status: what an upgrade that
// re-creates, rolls or rewrites anything changes.
func snapshot(t *testing.T, k8s client.Client, ns string) string {
	t.Helper()
	var out []string
	for _, list := range []struct {
		list client.ObjectList
		rv   bool
	}{
		{&corev1.PodList{}, false}, {&appsv1.ReplicaSetList{}, false}, {&appsv1.DeploymentList{}, false}, {&corev1.ServiceList{}, false},
		{&policyv1.PodDisruptionBudgetList{}, false}, {&corev1.ConfigMapList{}, true}, {&corev1.ServiceAccountList{}, true},
		{&rbacv1.RoleList{}, true}, {&rbacv1.RoleBindingList{}, true}, {&networkingv1.NetworkPolicyList{}, true},
	} {
		if err := k8s.List(context.Background(), list.list, client.InNamespace(ns)); err != nil {
			t.Fatal(err)
		}
		items, err := meta.ExtractList(list.list)
		if err != nil {
			t.Fatal(err)
		}
		for _, item := range items {
			o := item.(client.Object)
			if metav1.GetControllerOf(o) == nil {
				continue // not the manager's, nor made from what it renders
			}
			s := fmt.Sprintf("%T/%s=%s@%d", o, o.GetName(), o.GetUID(), o.GetGeneration())
			if list.rv {
				s += "/" + o.GetResourceVersion()
			}
			out = append(out, s)
		}
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

// watchReady watches the policies and the pool of the namespace from now on, and returns a
// function that says every status that was not Ready at its generation, and when.
func watchReady(t *testing.T, c *cluster, ns string) func() []string {
	t.Helper()
	var mu sync.Mutex
	var notReady []string
	for _, list := range []client.ObjectList{&v1alpha1.RateLimitPolicyList{}, &v1alpha1.EnforcerPoolList{}} {
		w, err := c.unthrottled(t).Watch(context.Background(), list, client.InNamespace(ns))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(w.Stop)
		go func() {
			for ev := range w.ResultChan() {
				o, ok := ev.Object.(client.Object)
				if !ok || ev.Type != watch.Modified {
					continue
				}
				var conds []metav1.Condition
				switch x := o.(type) {
				case *v1alpha1.RateLimitPolicy:
					conds = x.Status.Conditions
				case *v1alpha1.EnforcerPool:
					conds = x.Status.Conditions
				}
				if r := meta.FindStatusCondition(conds, v1alpha1.ConditionReady); r == nil || r.Status != metav1.ConditionTrue || r.ObservedGeneration != o.GetGeneration() {
					mu.Lock()
					notReady = append(notReady, fmt.Sprintf("%s at %s: %+v", o.GetName(), time.Now().Format("15:04:05.000"), r))
					mu.Unlock()
				}
			}
		}()
	}
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(notReady)
	}
}

// newManagerRuns waits until the new manager shows it runs the policies and their pools: it
// wrote the status of each policy after it started, and put back a label of each enforcer Service
// changed by hand (the old manager has stopped). The label is not in the Services' selectors: no
// request notices it.
func newManagerRuns(t *testing.T, k8s client.Client, ns string, services []string, since time.Time) {
	t.Helper()
	ctx := context.Background()
	for _, name := range services {
		patch := []byte(`{"metadata":{"labels":{"app.kubernetes.io/managed-by":"someone-else"}}}`)
		svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
		if err := k8s.Patch(ctx, svc, client.RawPatch(types.MergePatchType, patch)); err != nil {
			t.Fatal(err)
		}
	}
	written := map[string]string{}
	poll.WaitFor(t, 60*time.Second, func() error {
		for _, name := range services {
			svc := &corev1.Service{}
			if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, svc); err != nil {
				return err
			}
			if svc.Labels["app.kubernetes.io/managed-by"] != "sluice" {
				return fmt.Errorf("the label of Service %s is not put back: %v", name, svc.Labels)
			}
		}
		var policies v1alpha1.RateLimitPolicyList
		if err := k8s.List(ctx, &policies, client.InNamespace(ns)); err != nil {
			return err
		}
		for _, p := range policies.Items {
			for _, f := range p.ManagedFields {
				if f.Subresource == "status" && f.Time != nil && f.Time.After(since) {
					written["status "+p.Name] = f.Time.String()
				}
			}
		}
		if len(written) < 2 {
			return fmt.Errorf("the new manager wrote the status of %v; want each policy's", written)
		}
		return nil
	})
}

// traffic is clients that ask both policies, until stopped: the own policy's enforcers through
// their proxy, the pool's through the check API. Every answer is recorded.
type traffic struct {
	mu      sync.Mutex
	answers map[string]map[int]int // "<policy>/<client>" -> status -> count
	failed  []string
	done    chan struct{}
	wg      sync.WaitGroup
	n       atomic.Int64
	k8s     client.Client
}

// upgradeClients send one after the other: the first upgradeHot of them every other request, so
// that they pass their limit early, and the others in turn between them.
const upgradeClients, upgradeHot = 48, 4

// upgradeClient is the client of the ith request.
func upgradeClient(i int) string {
	if i%2 == 0 {
		return fmt.Sprintf("client-%d", i/2%upgradeHot)
	}
	return fmt.Sprintf("client-%d", upgradeHot+i/2%(upgradeClients-upgradeHot))
}

// startTraffic starts the clients, bounded to 3 minutes whatever the test does.
func startTraffic(t *testing.T, k8s client.Client, ns string, pool *v1alpha1.EnforcerPool) *traffic {
	t.Helper()
	tr := &traffic{answers: map[string]map[int]int{}, done: make(chan struct{}), k8s: k8s}
	pods := func(labels map[string]string) []corev1.Pod {
		var list corev1.PodList
		if err := k8s.List(context.Background(), &list, client.InNamespace(ns), client.MatchingLabels(labels)); err != nil || len(list.Items) != 2 {
			t.Fatalf("pods %v: %d (%v), want 2", labels, len(list.Items), err)
		}
		return list.Items
	}
	own := pods(render.PodLabels(&v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Name: "own"}}))
	pooled := pods(render.PoolPodLabels(pool))
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}, Timeout: 10 * time.Second}
	tr.wg.Go(func() {
		deadline := time.Now().Add(3 * time.Minute)
		for i := 0; time.Now().Before(deadline); i++ {
			select {
			case <-tr.done:
				return
			default:
			}
			who := upgradeClient(i)
			tr.ask(hc, "own/"+who, local.PodURL(&own[i%2], "proxy")+"/", who)
			tr.ask(hc, "pooled/"+who, local.PodURL(&pooled[i%2], "check")+"/policies/"+ns+"/pooled"+enforcer.ForwardAuthPath, who)
			tr.n.Add(1)
			time.Sleep(5 * time.Millisecond) // the clients' pace, not an order of events
		}
	})
	t.Cleanup(tr.stop)
	return tr
}

// ask sends one request of a client and records its answer.
func (tr *traffic) ask(hc *http.Client, key, url, who string) {
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	req.Header.Set("X-Client", who)
	req.Header.Set("X-Forwarded-Method", "GET")
	req.Header.Set("X-Forwarded-Uri", "/")
	resp, err := hc.Do(req)
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if err != nil {
		tr.failed = append(tr.failed, key+": "+err.Error())
		return
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if tr.answers[key] == nil {
		tr.answers[key] = map[int]int{}
	}
	tr.answers[key][resp.StatusCode]++
}

func (tr *traffic) sent() int64 { return tr.n.Load() }

// waitFor waits until the clients have sent n rounds.
func (tr *traffic) waitFor(t *testing.T, n int64) {
	t.Helper()
	poll.WaitFor(t, 2*time.Minute, func() error {
		if got := tr.sent(); got < n {
			return fmt.Errorf("%d rounds sent, want %d", got, n)
		}
		return nil
	})
}

func (tr *traffic) stop() {
	select {
	case <-tr.done:
	default:
		close(tr.done)
	}
	tr.wg.Wait()
}

// check says what was dropped or counted twice: a request that got no answer, or another than
// 200 or 429; a client that passed more or less than its limit, once it sent more; a request the
// upstream received other than those that passed; and decisions the replicas report other than
// the answers.
func (tr *traffic) check(t *testing.T, ns string, upstream *atomic.Int64) {
	t.Helper()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.failed) > 0 {
		t.Errorf("%d requests got no answer, the first: %s", len(tr.failed), tr.failed[0])
	}
	passed := map[string]int{}
	limited := map[string]int{}
	for key, answers := range tr.answers {
		policy, _, _ := strings.Cut(key, "/")
		sent := 0
		for status, n := range answers {
			sent += n
			if status != http.StatusOK && status != http.StatusTooManyRequests {
				t.Errorf("%s: %d answers %d", key, n, status)
			}
		}
		if want := min(sent, upgradeLimit); answers[http.StatusOK] != want {
			t.Errorf("%s: %d of %d passed, want exactly %d", key, answers[http.StatusOK], sent, want)
		}
		passed[policy] += answers[http.StatusOK]
		limited[policy] += answers[http.StatusTooManyRequests]
	}
	if got := upstream.Load(); got != int64(passed["own"]) {
		t.Errorf("the upstream received %d requests, %d passed the own enforcers", got, passed["own"])
	}
	for policy, labels := range map[string]map[string]string{
		"own":    render.PodLabels(&v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Name: "own"}}),
		"pooled": {render.EnforcerPodLabelKey: render.EnforcerPodLabelValue, "ratelimit.sluice.dev/pool": "shared"},
	} {
		allowed, refused := tr.decided(t, ns, labels, ns+"/"+policy)
		if allowed != passed[policy] || refused != limited[policy] {
			t.Errorf("the %s policy's replicas report %d allowed and %d limited, the clients saw %d and %d", policy, allowed, refused, passed[policy], limited[policy])
		}
	}
	t.Logf("%d rounds: own %d passed, %d limited; pooled %d passed, %d limited", tr.sent(), passed["own"], limited["own"], passed["pooled"], limited["pooled"])
}

// decided sums the decisions of a policy that its replicas report.
func (tr *traffic) decided(t *testing.T, ns string, labels map[string]string, id string) (allowed, limited int) {
	t.Helper()
	var pods corev1.PodList
	if err := tr.k8s.List(context.Background(), &pods, client.InNamespace(ns), client.MatchingLabels(labels)); err != nil {
		t.Fatal(err)
	}
	for i := range pods.Items {
		for _, r := range fetchReport(t, &pods.Items[i]).Rules {
			if r.Policy == id {
				allowed += int(r.Allowed)
				limited += int(r.Limited)
			}
		}
	}
	return allowed, limited
}
