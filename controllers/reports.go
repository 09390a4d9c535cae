package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
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

	"github.com/sluice-dev/sluice/api/v1alpha1"
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

// freshReport is how old a read of a report may be for a reconcile to use it rather than read
// again: the report ticker's read of a moment ago, which brought the policy.
const freshReport = time.Second

// reportReaders is how many reports the report ticker reads at once.
const reportReaders = 16

// reportsSeen is the last read of each enforcer pod's report, by the report ticker or a
// reconcile, and which policies' counts still move; it lives in the manager's memory.
type reportsSeen struct {
	mu     sync.Mutex
	pods   map[types.UID]seenReport
	moving map[types.NamespacedName]bool
}

type seenReport struct {
	// ip is the pod's address when read.
	ip     string
	report *report.Report
	err    string
	// at is when the read began.
	at time.Time
}

// observe records a read of pod's report that began at, unless a later one is recorded
// already, and reports whether what it read differs from the previous read: another report, or
// another error. A pod read for the first time differs.
func (s *reportsSeen) observe(pod *corev1.Pod, rep *report.Report, err error, at time.Time) bool {
	read := seenReport{ip: pod.Status.PodIP, report: rep, at: at}
	if err != nil {
		read.err = err.Error()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pods == nil {
		s.pods = map[types.UID]seenReport{}
	}
	last, ok := s.pods[pod.UID]
	if ok && last.at.After(at) {
		return false // a later read is what the policy was, or will be, reconciled with
	}
	s.pods[pod.UID] = read
	return !ok || last.ip != read.ip || last.err != read.err || !sameReport(last.report, read.report)
}

// fresh returns the last read of pod's report when it began less than freshReport before now,
// at the pod's current address.
func (s *reportsSeen) fresh(pod *corev1.Pod, now time.Time) (reportRead, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	read, ok := s.pods[pod.UID]
	if !ok || read.ip != pod.Status.PodIP || now.Sub(read.at) >= freshReport {
		return reportRead{}, false
	}
	r := reportRead{report: read.report}
	if read.err != "" {
		r.err = errors.New(read.err)
	}
	return r, true
}

// keep forgets the pods not in live.
func (s *reportsSeen) keep(live map[types.UID]bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid := range s.pods {
		if !live[uid] {
			delete(s.pods, uid)
		}
	}
}

func (s *reportsSeen) setMoving(policy types.NamespacedName, moving bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.moving == nil {
		s.moving = map[types.NamespacedName]bool{}
	}
	if moving {
		s.moving[policy] = true
	} else {
		delete(s.moving, policy)
	}
}

func (s *reportsSeen) isMoving(policy types.NamespacedName) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.moving[policy]
}

func (s *reportsSeen) forget(policy types.NamespacedName) { s.setMoving(policy, false) }

// sameReport tells whether two reports say the same.
func sameReport(a, b *report.Report) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Version == b.Version && a.Started.Equal(b.Started) && a.Revision == b.Revision && a.RevisionSince.Equal(b.RevisionSince) &&
		a.ConfigSource == b.ConfigSource && a.Store.Kind == b.Store.Kind && a.Store.Connected == b.Store.Connected &&
		a.Store.BreakerOpen == b.Store.BreakerOpen && a.Store.Cause == b.Store.Cause && a.Store.Message == b.Store.Message &&
		a.Store.Since.Equal(b.Store.Since) && slices.Equal(a.Rules, b.Rules)
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

// reportTicker is the clock of the enforcers' reports. Every ReportInterval it reads the report
// of every enforcer pod of every policy in the cache, and brings a policy to the reconciler, at
// low priority, only when one of its replicas says something new (another report, or another
// reason to have none), or its counts still move through the last minute. A thousand idle
// policies cost a thousand reads an interval and nothing else: no reconcile, no comparison of
// objects, no status computed. As a source of the controller it runs where the controller runs:
// on the leader alone.
type reportTicker struct{ r *RateLimitPolicyReconciler }

// Start reads the reports every interval until ctx ends.
func (t reportTicker) Start(ctx context.Context, q workqueue.TypedRateLimitingInterface[reconcile.Request]) error {
	go func() {
		tick := time.NewTicker(t.r.reportInterval())
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			for _, key := range t.due(ctx) {
				if pq, ok := q.(priorityqueue.PriorityQueue[reconcile.Request]); ok {
					pq.AddWithOpts(priorityqueue.AddOpts{Priority: ptr.To(handler.LowPriority)}, reconcile.Request{NamespacedName: key})
				} else {
					q.Add(reconcile.Request{NamespacedName: key})
				}
			}
		}
	}()
	return nil
}

// due reads every report once and returns the policies to reconcile.
func (t reportTicker) due(ctx context.Context) []types.NamespacedName {
	var policies v1alpha1.RateLimitPolicyList
	if err := t.r.List(ctx, &policies, client.UnsafeDisableDeepCopy); err != nil {
		return nil
	}
	type read struct {
		policy types.NamespacedName
		pod    *corev1.Pod
	}
	var reads []read
	live := map[types.UID]bool{}
	for i := range policies.Items {
		p := &policies.Items[i]
		pods, err := t.r.enforcerPods(ctx, p)
		if err != nil {
			continue
		}
		for _, pod := range pods {
			live[pod.UID] = true
			if pod.Status.PodIP != "" {
				reads = append(reads, read{client.ObjectKeyFromObject(p), pod})
			}
		}
	}
	changed := make([]bool, len(reads))
	readers := make(chan struct{}, reportReaders)
	var wg sync.WaitGroup
	for i, rd := range reads {
		readers <- struct{}{}
		wg.Go(func() {
			defer func() { <-readers }()
			changed[i] = t.r.readReport(ctx, rd.pod).changed
		})
	}
	wg.Wait()
	t.r.mem.reports.keep(live)
	var due []types.NamespacedName
	seen := map[types.NamespacedName]bool{}
	for i, rd := range reads {
		if !seen[rd.policy] && (changed[i] || t.r.mem.reports.isMoving(rd.policy)) {
			seen[rd.policy] = true
			due = append(due, rd.policy)
		}
	}
	return due
}
