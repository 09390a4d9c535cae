package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/priorityqueue"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// MaxReportBytes bounds the report read from one pod. A pool replica's report lists every policy
// it serves and every rule's counters, about 300 bytes a one-rule policy: 3 MB at 10,000, which
// the 1 MiB bound of a policy's own enforcer cut off, so no policy of such a pool was ever Ready.
// 64 MiB holds some 200,000 such policies and still bounds what a pod can make the manager hold.
const MaxReportBytes = 64 << 20

// ReportFetcher reads the report of the enforcer in a pod.
type ReportFetcher func(ctx context.Context, pod *corev1.Pod) (*report.Report, error)

// FetchReport is the ReportFetcher of the manager: GET http://<pod IP>:<admin port>/report with
// c, refusing a report of another version.
func FetchReport(c *http.Client) ReportFetcher {
	return func(ctx context.Context, pod *corev1.Pod) (*report.Report, error) {
		port := render.AdminPort
		for _, ctr := range pod.Spec.Containers {
			for _, p := range ctr.Ports {
				if p.Name == "admin" {
					port = int(p.ContainerPort)
				}
			}
		}
		url := "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(port)) + report.Path
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return nil, err
		}
		resp, err := c.Do(req)
		if err != nil {
			return nil, err
		}
		defer func() { _ = resp.Body.Close() }()
		if resp.StatusCode != http.StatusOK {
			return nil, &reportError{reportStatus, fmt.Errorf("GET %s: %s", url, resp.Status)}
		}
		var r report.Report
		if err := json.NewDecoder(io.LimitReader(resp.Body, MaxReportBytes)).Decode(&r); err != nil {
			var ne net.Error
			if errors.As(err, &ne) {
				return nil, fmt.Errorf("GET %s: %w", url, err) // the body was cut off
			}
			return nil, &reportError{reportInvalid, fmt.Errorf("GET %s: %w", url, err)}
		}
		if r.Version != report.Version {
			return nil, &reportError{reportInvalid, fmt.Errorf("GET %s: report version %q, want %q", url, r.Version, report.Version)}
		}
		return &r, nil
	}
}

// countWindow is the span over which status counts decisions.
const countWindow = time.Minute

// history keeps, per policy and enforcer pod, the counters each report gave and when, so that
// status can say how many decisions fell in the last minute. It lives in the manager's memory:
// after a restart the first minute counts from the first reports, or from the pods' start.
type history struct {
	mu       sync.Mutex
	policies map[types.NamespacedName]map[types.UID]*podHistory
}

type podHistory struct {
	started time.Time
	samples []sample
}

type sample struct {
	at    time.Time
	rules map[string]report.Counters
}

// record adds the reports of a policy's pods, read at now, drops the pods that are gone, and
// returns each rule's decisions over the last minute, summed over the pods. A pod's count is its
// latest counters less those of its newest sample at least a minute old; lacking one, less zero
// if the pod started within the minute, else less its oldest sample.
func (h *history) record(policy types.NamespacedName, ruleOf func(report.Rule) (string, bool), reports map[types.UID]*report.Report, now time.Time) map[string]report.Counters {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.policies == nil {
		h.policies = map[types.NamespacedName]map[types.UID]*podHistory{}
	}
	pods := h.policies[policy]
	if pods == nil {
		pods = map[types.UID]*podHistory{}
		h.policies[policy] = pods
	}
	for uid := range pods {
		if _, ok := reports[uid]; !ok {
			delete(pods, uid)
		}
	}
	out := map[string]report.Counters{}
	for uid, r := range reports {
		if r == nil {
			continue
		}
		ph := pods[uid]
		if ph == nil || !ph.started.Equal(r.Started) {
			ph = &podHistory{started: r.Started}
			pods[uid] = ph
		}
		s := sample{at: now, rules: map[string]report.Counters{}}
		for _, rule := range r.Rules {
			if name, ok := ruleOf(rule); ok {
				s.rules[name] = rule.Counters
			}
		}
		ph.samples = append(ph.samples, s)
		cutoff := now.Add(-countWindow)
		base := -1
		for i, old := range ph.samples {
			if !old.at.After(cutoff) {
				base = i
			}
		}
		var baseline map[string]report.Counters
		switch {
		case base >= 0:
			ph.samples = ph.samples[base:]
			baseline = ph.samples[0].rules
		case r.Started.After(cutoff):
			// Everything the pod counted, it counted within the window.
		default:
			baseline = ph.samples[0].rules
		}
		for name, c := range s.rules {
			out[name] = out[name].Add(c.Sub(baseline[name]))
		}
	}
	return out
}

// forget drops a policy's history.
func (h *history) forget(policy types.NamespacedName) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.policies, policy)
}

// counted tells whether any rule counted a decision in the last minute.
func counted(counts map[string]report.Counters) bool {
	for _, c := range counts {
		if c != (report.Counters{}) {
			return true
		}
	}
	return false
}

// reports reads the reports of every pool's replicas, an EnforcerPool's and a pool of one's
// alike: each replica once every ReportInterval, every pendingRead while a policy of its pool
// waits for it, and at once when a reconcile finds it never read at its address. It keeps the
// latest read of each, indexed by policy: a pool of ten thousand policies costs the manager its
// replicas' reads, not ten thousand. From what changed between two reads of a replica it brings
// the policies whose entry changed, or whose counts still move, to the policy controller, and
// the EnforcerPool whose replica says something new of the pool to the pool controller. As a
// runnable of the manager it runs where the controllers run: on the leader alone.
type reports struct {
	r *RateLimitPolicyReconciler

	mu sync.Mutex
	// pods are the latest read of each enforcer pod.
	pods map[types.UID]*read
	// pending are the pools with a policy that waits for their replicas, until when to hurry.
	pending map[types.NamespacedName]time.Time
	// moving are the policies whose counts of the last minute still move with the clock.
	moving map[types.NamespacedName]bool
	// flight reads a replica that reconciles find unread once, however many ask at once.
	flight singleflight.Group
	// mounts finds why a pod waits for its volumes, in its events.
	mounts *mounts
}

// read is one read of a replica's report.
type read struct {
	// home is the key of the replica's pool, ip its address when read, at when the read began.
	home types.NamespacedName
	ip   string
	at   time.Time
	// report is what it said, or err why there is none.
	report *report.Report
	err    error
	// entries are what the report says of each policy, by ID.
	entries map[string]*entry
}

// entry is what a replica says of one policy: the revision it serves, the revision it refused
// and why, and its rules' counters.
type entry struct {
	served  *report.PolicyServed
	refused *report.PolicyRefused
	rules   []report.Rule
}

func (a *entry) equal(b *entry) bool {
	if a == nil || b == nil {
		return a == b
	}
	return ptr.Equal(a.served, b.served) && ptr.Equal(a.refused, b.refused) && slices.Equal(a.rules, b.rules)
}

// Why a replica has no report to say anything with.
var (
	errNoIP    = errors.New("the pod has no IP yet")
	errNotRead = errors.New("its report was not read yet")
)

// pendingRead is how often a pool's replicas are read while a policy waits for them.
const pendingRead = 500 * time.Millisecond

// pendingFor is how long a pool stays hurried after a policy last said it waits.
const pendingFor = 30 * time.Second

// reportReaders is how many reports are read at once.
const reportReaders = 16

func newReports(r *RateLimitPolicyReconciler) *reports {
	return &reports{r: r, pods: map[types.UID]*read{}, pending: map[types.NamespacedName]time.Time{}, moving: map[types.NamespacedName]bool{}}
}

// Start reads the reports until ctx ends.
func (s *reports) Start(ctx context.Context) error {
	tick := time.NewTicker(min(pendingRead, s.r.reportInterval()))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		var pods corev1.PodList // the cache holds enforcer pods alone
		if err := s.r.List(ctx, &pods, client.UnsafeDisableDeepCopy); err == nil {
			s.readAll(ctx, s.due(pods.Items, time.Now()))
		}
	}
}

// wait says that a policy of the pool waits for its replicas: they are read every pendingRead
// for a while.
func (s *reports) wait(pool types.NamespacedName) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pending[pool] = time.Now().Add(pendingFor)
}

// due are the live replicas whose read is due at now; the reads of pods that are gone are
// forgotten.
func (s *reports) due(pods []corev1.Pod, now time.Time) []*corev1.Pod {
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := map[types.UID]bool{}
	var due []*corev1.Pod
	for i := range pods {
		pod := &pods[i]
		key, ok := homeKeyOf(pod)
		if !ok || !live(pod) {
			continue
		}
		seen[pod.UID] = true
		every := s.r.reportInterval()
		if until, ok := s.pending[key]; ok && now.Before(until) {
			every = pendingRead
		}
		if last := s.pods[pod.UID]; pod.Status.PodIP != "" && (last == nil || last.ip != pod.Status.PodIP || now.Sub(last.at) >= every-pendingRead/2) {
			due = append(due, pod)
		}
	}
	s.mounts.forget(seen)
	for uid := range s.pods {
		if !seen[uid] {
			delete(s.pods, uid)
		}
	}
	for pool, until := range s.pending {
		if now.After(until) {
			delete(s.pending, pool)
		}
	}
	return due
}

// readAll reads the pods' reports, reportReaders at a time, and brings what changed to the
// controllers.
func (s *reports) readAll(ctx context.Context, pods []*corev1.Pod) {
	policies, pools := map[types.NamespacedName]bool{}, map[types.NamespacedName]bool{}
	var mu sync.Mutex
	readers := make(chan struct{}, reportReaders)
	var wg sync.WaitGroup
	for _, pod := range pods {
		readers <- struct{}{}
		wg.Go(func() {
			defer func() { <-readers }()
			changed, summaryChanged := s.read(ctx, pod)
			mu.Lock()
			defer mu.Unlock()
			for _, p := range changed {
				policies[p] = true
			}
			// Only an EnforcerPool has a status of its own to tell it in.
			if name := render.PoolOfPod(pod); summaryChanged && name != "" {
				pools[types.NamespacedName{Namespace: pod.Namespace, Name: name}] = true
			}
		})
	}
	wg.Wait()
	s.r.mem.policyQueue.add(policies)
	s.r.mem.poolQueue.add(pools)
}

// read reads a replica's report and records it (see record).
func (s *reports) read(ctx context.Context, pod *corev1.Pod) ([]types.NamespacedName, bool) {
	started := time.Now()
	rep, err := s.r.readReport(ctx, pod)
	return s.record(pod, rep, err, started)
}

// record records a read of a replica's report that began at started, unless a later read is
// recorded already, and returns the policies whose entry changed since the replica's previous
// read, whose counts still move, or, when what it says of its store changed, all it names; and
// whether what the report says of its pool changed.
func (s *reports) record(pod *corev1.Pod, rep *report.Report, err error, started time.Time) ([]types.NamespacedName, bool) {
	key, _ := homeKeyOf(pod)
	next := &read{home: key, ip: pod.Status.PodIP, at: started, report: rep, err: err, entries: entries(rep, key)}
	s.mu.Lock()
	defer s.mu.Unlock()
	prev := s.pods[pod.UID]
	if prev != nil && prev.at.After(started) {
		return nil, false // a later read is what the policies were, or will be, reconciled with
	}
	s.pods[pod.UID] = next
	store := prev == nil || prev.ip != next.ip || storeOf(prev) != storeOf(next)
	changed := map[types.NamespacedName]bool{}
	for id, e := range next.entries {
		var old *entry
		if prev != nil {
			old = prev.entries[id]
		}
		if key := policyKey(id); store || !e.equal(old) || s.moving[key] {
			changed[key] = true
		}
	}
	if prev != nil {
		for id := range prev.entries {
			if _, ok := next.entries[id]; !ok || store {
				changed[policyKey(id)] = true
			}
		}
	}
	return slices.Collect(maps.Keys(changed)), prev == nil || summary(prev) != summary(next)
}

// storeOf is what a read says of the replica's store, which its policies' status tells: why
// there is no report, or the store's health.
func storeOf(rd *read) string {
	if rd.err != nil {
		return "error: " + rd.err.Error()
	}
	st := rd.report.Store
	return fmt.Sprintf("%v %v %s %s", st.Connected, st.BreakerOpen, st.Cause, st.Message)
}

// readNew reads at once, and records, the reports of the pods that have an address and no read
// at it: a replica just started, or every replica after the manager started.
func (s *reports) readNew(ctx context.Context, pods []*corev1.Pod) {
	var unread []*corev1.Pod
	s.mu.Lock()
	for _, pod := range pods {
		if rd := s.pods[pod.UID]; pod.Status.PodIP != "" && (rd == nil || rd.ip != pod.Status.PodIP) {
			unread = append(unread, pod)
		}
	}
	s.mu.Unlock()
	if len(unread) == 0 {
		return
	}
	policies := map[types.NamespacedName]bool{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, pod := range unread {
		wg.Go(func() {
			changed, _, _ := s.flight.Do(string(pod.UID)+"@"+pod.Status.PodIP, func() (any, error) {
				// The read is the replica's, not the reconcile's that asked first: it outlives it.
				changed, _ := s.read(context.WithoutCancel(ctx), pod)
				return changed, nil
			})
			mu.Lock()
			defer mu.Unlock()
			for _, p := range changed.([]types.NamespacedName) {
				policies[p] = true
			}
		})
	}
	wg.Wait()
	s.r.mem.policyQueue.add(policies)
}

// summary is what a pool's status takes from a replica's read: whether it reports, is synced,
// its store's health, how many policies it serves, and which it refuses.
func summary(rd *read) string {
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

// entries indexes a replica's report by policy. The replica of a pool of one (key) tells the
// revision of its one policy at the top of its report, as an enforcer of one policy does.
func entries(r *report.Report, key types.NamespacedName) map[string]*entry {
	if r == nil {
		return nil
	}
	out := make(map[string]*entry, len(r.Policies)+1)
	get := func(id string) *entry {
		e := out[id]
		if e == nil {
			e = &entry{}
			out[id] = e
		}
		return e
	}
	if p, one := policyOfOne(key); one && r.Revision != "" {
		get(p.String()).served = &report.PolicyServed{Policy: p.String(), Revision: r.Revision, Since: r.RevisionSince}
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

// replicas are the pool's live pods as last read, each with what it says of the policy id ("" for
// none) and of its revision rev. A pod never read at its address is read first.
func (s *reports) replicas(ctx context.Context, pool types.NamespacedName, id, rev string) ([]replica, error) {
	pods, err := s.r.homePods(ctx, pool)
	if err != nil {
		return nil, err
	}
	s.readNew(ctx, pods)
	now := time.Now()
	mountFailures := make([]string, len(pods))
	for i, pod := range pods {
		mountFailures[i] = s.mounts.failure(ctx, pod, now)
	}
	out := make([]replica, 0, len(pods))
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, pod := range pods {
		rep := replica{pod: pod.Name, uid: pod.UID, ready: podReady(pod), object: pod, mountFailure: mountFailures[i]}
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
		}
		if e := rd.entryOf(id); rep.report != nil && e != nil {
			rep.rules = e.rules
			if e.served != nil {
				rep.revision = e.served.Revision
			}
			if e.refused != nil && e.refused.Revision == rev {
				rep.refused = e.refused.Reason
			}
		}
		out = append(out, rep)
	}
	return out, nil
}

// homePods are a pool's enforcer pods that are not terminating nor done, by name, found through
// the cache's index.
func (r *RateLimitPolicyReconciler) homePods(ctx context.Context, key types.NamespacedName) ([]*corev1.Pod, error) {
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(key.Namespace), client.MatchingFields{podHomeIndex: key.String()}, client.UnsafeDisableDeepCopy); err != nil {
		return nil, err
	}
	var running []*corev1.Pod
	for i := range pods.Items {
		pod := &pods.Items[i]
		// A label value cut and hashed may, however unlikely, be another long name's too.
		if k, _ := homeKeyOf(pod); k != key || !live(pod) {
			continue
		}
		running = append(running, pod)
	}
	slices.SortFunc(running, func(a, b *corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	return running, nil
}

// live tells whether a pod is neither terminating nor done.
func live(pod *corev1.Pod) bool {
	return pod.DeletionTimestamp == nil && pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed
}

// entryOf is what the read says of the policy id, nil when nothing.
func (rd *read) entryOf(id string) *entry {
	if rd == nil || id == "" {
		return nil
	}
	return rd.entries[id]
}

func (s *reports) setMoving(policy types.NamespacedName, moving bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if moving {
		s.moving[policy] = true
	} else {
		delete(s.moving, policy)
	}
}

// queue is a controller's work queue, once its source has started: the report reader and the
// pool reconciler bring it what no watch announces.
type queue struct {
	mu sync.Mutex
	q  workqueue.TypedRateLimitingInterface[reconcile.Request]
}

// source is the controller's source that hands its queue over.
func (q *queue) source() source.TypedSource[reconcile.Request] {
	return source.Func(func(_ context.Context, wq workqueue.TypedRateLimitingInterface[reconcile.Request]) error {
		q.mu.Lock()
		defer q.mu.Unlock()
		q.q = wq
		return nil
	})
}

// add adds each key, at low priority: these reconciles only refresh what replicas say.
func (q *queue) add(keys map[types.NamespacedName]bool) {
	q.mu.Lock()
	wq := q.q
	q.mu.Unlock()
	if wq == nil {
		return
	}
	for key := range keys {
		if pq, ok := wq.(priorityqueue.PriorityQueue[reconcile.Request]); ok {
			pq.AddWithOpts(priorityqueue.AddOpts{Priority: ptr.To(handler.LowPriority)}, reconcile.Request{NamespacedName: key})
		} else {
			wq.Add(reconcile.Request{NamespacedName: key})
		}
	}
}

// reportTimeout bounds the reading of one enforcer's report.
const reportTimeout = 2 * time.Second

// readReport reads the report of one enforcer pod and counts the read.
func (r *RateLimitPolicyReconciler) readReport(ctx context.Context, pod *corev1.Pod) (*report.Report, error) {
	fetch := r.FetchReport
	if fetch == nil {
		fetch = defaultFetch
	}
	ctx, cancel := context.WithTimeout(ctx, reportTimeout)
	defer cancel()
	rep, err := fetch(ctx, pod)
	reportReads.Inc()
	if err != nil {
		reportFailures.WithLabelValues(reportFailureReason(err)).Inc()
	}
	return rep, err
}

// defaultFetch keeps a connection to every enforcer between reads: net/http's default of 100
// idle connections in all would dial most of a thousand enforcers anew every interval.
var defaultFetch = FetchReport(&http.Client{Timeout: reportTimeout, Transport: &http.Transport{
	MaxIdleConns: 0, MaxIdleConnsPerHost: 2, IdleConnTimeout: 90 * time.Second,
}})

func podReady(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
