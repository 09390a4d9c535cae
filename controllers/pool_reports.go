package controllers

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/priorityqueue"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// poolReports reads the reports of every pool's replicas, one read of each replica every
// ReportInterval, or every pendingRead while a policy of the pool waits for its replicas, and
// keeps the latest, indexed by policy: a pool of ten thousand policies costs the manager its
// replicas' reads, not ten thousand. From what changed between two reads of a replica it brings
// the policies whose entry changed to the policy controller, and the pool to the pool controller.
type poolReports struct {
	r *RateLimitPolicyReconciler

	mu sync.Mutex
	// pods are the latest read of each pool pod.
	pods map[types.UID]*poolRead
	// pending are the pools with a policy that waits for its replicas, until when to hurry.
	pending map[types.NamespacedName]time.Time
	// policies and pools are the queues of the two controllers, once their sources start.
	policies, pools workqueue.TypedRateLimitingInterface[reconcile.Request]
	start           sync.Once
}

// poolRead is one read of a pool replica's report.
type poolRead struct {
	pool   types.NamespacedName
	ip     string
	at     time.Time
	report *report.Report
	err    error
	// entries are what the report says of each policy, by ID.
	entries map[string]*poolEntry
}

// poolEntry is what a pool replica says of one policy: the revision it serves, the revision it
// refused and why, and its rules' counters.
type poolEntry struct {
	served  *report.PolicyServed
	refused *report.PolicyRefused
	rules   []report.Rule
}

func (a *poolEntry) equal(b *poolEntry) bool {
	if a == nil || b == nil {
		return a == b
	}
	return ptr.Equal(a.served, b.served) && ptr.Equal(a.refused, b.refused) && slices.Equal(a.rules, b.rules)
}

// Why a pool replica has no report to say anything with.
var (
	errNoIP    = errors.New("the pod has no IP yet")
	errNotRead = errors.New("its report was not read yet")
)

// pendingRead is how often a pool's replicas are read while a policy waits for them.
const pendingRead = 500 * time.Millisecond

// pendingFor is how long a pool stays hurried after a policy last said it waits.
const pendingFor = 30 * time.Second

func newPoolReports(r *RateLimitPolicyReconciler) *poolReports {
	return &poolReports{r: r, pods: map[types.UID]*poolRead{}, pending: map[types.NamespacedName]time.Time{}}
}

// source is the source of one controller: the policies' (pools false) or the pools'.
func (s *poolReports) source(pools bool) source.TypedSource[reconcile.Request] {
	return source.Func(func(ctx context.Context, q workqueue.TypedRateLimitingInterface[reconcile.Request]) error {
		s.mu.Lock()
		if pools {
			s.pools = q
		} else {
			s.policies = q
		}
		s.mu.Unlock()
		s.start.Do(func() { go s.loop(ctx) })
		return nil
	})
}

// wait says that a policy of the pool waits for its replicas: they are read every pendingRead
// for a while.
func (s *poolReports) wait(pool types.NamespacedName) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pending[pool] = time.Now().Add(pendingFor)
}

func (s *poolReports) loop(ctx context.Context) {
	tick := time.NewTicker(min(pendingRead, s.r.reportInterval()))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		s.round(ctx, time.Now())
	}
}

// round reads the replicas that are due and brings what changed to the controllers.
func (s *poolReports) round(ctx context.Context, now time.Time) {
	var pods corev1.PodList
	if err := s.r.List(ctx, &pods, client.HasLabels{report.PoolLabel}, client.UnsafeDisableDeepCopy); err != nil {
		return
	}
	live := map[types.UID]bool{}
	var due []*corev1.Pod
	s.mu.Lock()
	for i := range pods.Items {
		pod := &pods.Items[i]
		pool := render.PoolOfPod(pod)
		if pool == "" || pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			continue
		}
		live[pod.UID] = true
		if pod.Status.PodIP == "" {
			continue
		}
		key := types.NamespacedName{Namespace: pod.Namespace, Name: pool}
		every := s.r.reportInterval()
		if until, ok := s.pending[key]; ok && now.Before(until) {
			every = pendingRead
		}
		if last := s.pods[pod.UID]; last == nil || last.ip != pod.Status.PodIP || now.Sub(last.at) >= every-pendingRead/2 {
			due = append(due, pod)
		}
	}
	for uid := range s.pods {
		if !live[uid] {
			delete(s.pods, uid)
		}
	}
	for pool, until := range s.pending {
		if now.After(until) {
			delete(s.pending, pool)
		}
	}
	s.mu.Unlock()

	policies, pools := map[types.NamespacedName]bool{}, map[types.NamespacedName]bool{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, pod := range due {
		wg.Go(func() {
			changed, pool := s.read(ctx, pod)
			mu.Lock()
			defer mu.Unlock()
			for _, p := range changed {
				policies[p] = true
			}
			if pool {
				pools[types.NamespacedName{Namespace: pod.Namespace, Name: render.PoolOfPod(pod)}] = true
			}
		})
	}
	wg.Wait()
	s.mu.Lock()
	policyQ, poolQ := s.policies, s.pools
	s.mu.Unlock()
	enqueue(policyQ, policies)
	enqueue(poolQ, pools)
}

// read reads a pool replica's report, records it, and returns the policies whose entry changed
// since the replica's previous read, or whose counts still move, and whether what the report
// says of the pool changed.
func (s *poolReports) read(ctx context.Context, pod *corev1.Pod) ([]types.NamespacedName, bool) {
	rd := s.r.readReport(ctx, pod)
	next := &poolRead{pool: types.NamespacedName{Namespace: pod.Namespace, Name: render.PoolOfPod(pod)}, ip: pod.Status.PodIP,
		at: time.Now(), report: rd.report, err: rd.err, entries: entries(rd.report)}
	s.mu.Lock()
	prev := s.pods[pod.UID]
	s.pods[pod.UID] = next
	s.mu.Unlock()
	var changed []types.NamespacedName
	for id, e := range next.entries {
		var old *poolEntry
		if prev != nil {
			old = prev.entries[id]
		}
		key := policyKey(id)
		if !e.equal(old) || s.r.mem.reports.isMoving(key) {
			changed = append(changed, key)
		}
	}
	if prev != nil {
		for id := range prev.entries {
			if _, ok := next.entries[id]; !ok {
				changed = append(changed, policyKey(id))
			}
		}
	}
	return changed, prev == nil || summary(prev) != summary(next)
}

// summary is what the pool's status takes from a replica's read: whether it reports, is
// synced, its store's health, how many policies it serves, and which it refuses.
func summary(rd *poolRead) string {
	if rd.err != nil {
		return "error: " + rd.err.Error()
	}
	r := rd.report
	var b strings.Builder
	fmt.Fprintf(&b, "%v %d %+v", r.Synced, len(r.Policies), r.Store)
	for _, f := range r.Refused {
		b.WriteString(" " + f.Policy + "@" + f.Revision)
	}
	return b.String()
}

// entries indexes a pool replica's report by policy.
func entries(r *report.Report) map[string]*poolEntry {
	if r == nil {
		return nil
	}
	out := make(map[string]*poolEntry, len(r.Policies))
	get := func(id string) *poolEntry {
		e := out[id]
		if e == nil {
			e = &poolEntry{}
			out[id] = e
		}
		return e
	}
	for i := range r.Policies {
		get(r.Policies[i].Policy).served = &r.Policies[i]
	}
	for i := range r.Refused {
		get(r.Refused[i].Policy).refused = &r.Refused[i]
	}
	// The rules come in policy order: each policy's are one run of the list.
	for i := 0; i < len(r.Rules); {
		j := i + 1
		for j < len(r.Rules) && r.Rules[j].Policy == r.Rules[i].Policy {
			j++
		}
		get(r.Rules[i].Policy).rules = r.Rules[i:j:j]
		i = j
	}
	return out
}

// policyKey is the key of a policy by its ID, "<namespace>/<name>".
func policyKey(id string) types.NamespacedName {
	ns, name, _ := strings.Cut(id, "/")
	return types.NamespacedName{Namespace: ns, Name: name}
}

// replicaOf is what a pool's replica says of one policy, for that policy's status: its served
// revision in place of the report's, its refusal, and its rules alone, for its counts.
type replicaOf struct {
	replica
	entry *poolEntry
}

// replicas are the pool's running pods as last read, each with what it says of the policy id
// ("" for none).
func (s *poolReports) replicas(ctx context.Context, pool *v1alpha1.EnforcerPool, id string) ([]replicaOf, error) {
	pods, err := s.r.poolPods(ctx, pool)
	if err != nil {
		return nil, err
	}
	out := make([]replicaOf, 0, len(pods))
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, pod := range pods {
		rep := replicaOf{replica: replica{pod: pod.Name, uid: pod.UID, ready: podReady(pod)}}
		rd := s.pods[pod.UID]
		switch {
		case pod.Status.PodIP == "":
			rep.err = errNoIP
		case rd == nil || rd.ip != pod.Status.PodIP:
			rep.err = errNotRead
		case rd.err != nil:
			rep.err = rd.err
		default:
			rep.report = rd.report
			if id != "" {
				rep.entry = rd.entries[id]
			}
		}
		out = append(out, rep)
	}
	return out, nil
}

// enqueue adds each key to q, at low priority: these reconciles only refresh what replicas say.
func enqueue(q workqueue.TypedRateLimitingInterface[reconcile.Request], keys map[types.NamespacedName]bool) {
	if q == nil {
		return
	}
	for key := range keys {
		if pq, ok := q.(priorityqueue.PriorityQueue[reconcile.Request]); ok {
			pq.AddWithOpts(priorityqueue.AddOpts{Priority: ptr.To(handler.LowPriority)}, reconcile.Request{NamespacedName: key})
		} else {
			q.Add(reconcile.Request{NamespacedName: key})
		}
	}
}
