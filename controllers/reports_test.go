package controllers

import (
	"errors"
	"maps"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// A read of a replica's report brings a policy exactly when its reconcile would see something
// else: another revision or other counts of its own, another health of the store or another
// error, another address; an earlier read that ends last does not undo a later one. A pool's
// replica brings only the policies whose entry changed, unless its store's health did.
func TestReportsWhenAReplicaIsReadAgainThenOnlyWhatChangedBringsItsPolicies(t *testing.T) {
	pod := func(uid types.UID, ip string, labels map[string]string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", UID: uid, Labels: labels}, Status: corev1.PodStatus{PodIP: ip}}
	}
	own := map[string]string{render.EnforcerPodLabelKey: render.EnforcerPodLabelValue, "app.kubernetes.io/instance": "p"}
	pooled := map[string]string{render.EnforcerPodLabelKey: render.EnforcerPodLabelValue, report.PoolLabel: "shared"}
	rep := func(allowed uint64, connected bool) *report.Report {
		// Fresh times, as each read decodes them anew.
		return &report.Report{Version: report.Version, Started: t0.UTC(), Revision: "r1", RevisionSince: t0.Add(time.Second).UTC(),
			Store: report.Store{Kind: "memory", Connected: connected, Since: t0.UTC()},
			Rules: []report.Rule{{Policy: "ns/p", Name: "r", Counters: report.Counters{Allowed: allowed}}}}
	}
	poolRep := func(revs map[string]string, connected bool) *report.Report {
		r := &report.Report{Version: report.Version, Pool: "ns/shared", Synced: true, Store: report.Store{Connected: connected}}
		for _, id := range slices.Sorted(maps.Keys(revs)) {
			r.Policies = append(r.Policies, report.PolicyServed{Policy: id, Revision: revs[id], Since: t0.UTC()})
		}
		return r
	}
	s := newReports(&RateLimitPolicyReconciler{})
	steps := []struct {
		name string
		pod  *corev1.Pod
		rep  *report.Report
		err  error
		at   time.Duration
		want []string
	}{
		{"when a replica is read for the first time then its policy comes", pod("a", "10.0.0.1", own), rep(5, true), nil, 0, []string{"ns/p"}},
		{"when the same report is read again then nothing", pod("a", "10.0.0.1", own), rep(5, true), nil, 10 * time.Second, nil},
		{"when a counter moves then it comes", pod("a", "10.0.0.1", own), rep(6, true), nil, 20 * time.Second, []string{"ns/p"}},
		{"when the store disconnects then it comes", pod("a", "10.0.0.1", own), rep(6, false), nil, 30 * time.Second, []string{"ns/p"}},
		{"when an earlier read ends last then it is ignored", pod("a", "10.0.0.1", own), rep(1, true), nil, 25 * time.Second, nil},
		{"when the read fails then it comes", pod("a", "10.0.0.1", own), nil, errors.New("connection refused"), 40 * time.Second, []string{"ns/p"}},
		{"when it fails alike then nothing", pod("a", "10.0.0.1", own), nil, errors.New("connection refused"), 50 * time.Second, nil},
		{"when it answers again then it comes", pod("a", "10.0.0.1", own), rep(6, false), nil, 60 * time.Second, []string{"ns/p"}},
		{"when the pod has another address then it comes", pod("a", "10.0.0.2", own), rep(6, false), nil, 70 * time.Second, []string{"ns/p"}},
		{"when a pool's replica is read then every policy it serves comes", pod("b", "10.0.0.3", pooled),
			poolRep(map[string]string{"x/1": "r1", "x/2": "r1"}, true), nil, 0, []string{"x/1", "x/2"}},
		{"when one policy's revision changes then it alone comes", pod("b", "10.0.0.3", pooled),
			poolRep(map[string]string{"x/1": "r1", "x/2": "r2"}, true), nil, 10 * time.Second, []string{"x/2"}},
		{"when a policy joins then it alone comes", pod("b", "10.0.0.3", pooled),
			poolRep(map[string]string{"x/1": "r1", "x/2": "r2", "x/3": "r1"}, true), nil, 20 * time.Second, []string{"x/3"}},
		{"when its store disconnects then every policy it serves comes", pod("b", "10.0.0.3", pooled),
			poolRep(map[string]string{"x/1": "r1", "x/2": "r2", "x/3": "r1"}, false), nil, 30 * time.Second, []string{"x/1", "x/2", "x/3"}},
	}
	for _, st := range steps {
		changed, _ := s.record(st.pod, st.rep, st.err, t0.Add(st.at))
		var got []string
		for _, key := range changed {
			got = append(got, key.String())
		}
		slices.Sort(got)
		if !slices.Equal(got, st.want) {
			t.Errorf("%s: brings %v, want %v", st.name, got, st.want)
		}
	}
	if due := s.due(nil, t0); len(due) != 0 || len(s.pods) != 0 {
		t.Errorf("with no pods left: %d due, %d reads remembered; want none", len(due), len(s.pods))
	}
}

// The report reader brings a policy only when a report changed, so the samples of an idle
// policy are far apart: the counts must be those that a sample every interval gives.
func TestHistoryWhenIdleIntervalsAreNotSampledThenCountsAreTheSame(t *testing.T) {
	key := types.NamespacedName{Namespace: "ns", Name: "p"}
	rule := func(r report.Rule) (string, bool) { return r.Name, true }
	started := t0.Add(-time.Hour)
	counter := func(at time.Duration) uint64 { // 10 decisions at 100 s, 5 at 300 s, none else
		switch {
		case at >= 300*time.Second:
			return 15
		case at >= 100*time.Second:
			return 10
		}
		return 0
	}
	var every, sparse history
	last := uint64(0)
	moving := true
	for at := time.Duration(0); at <= 600*time.Second; at += 10 * time.Second {
		reps := map[types.UID]*report.Report{"a": {Started: started, Rules: []report.Rule{{Name: "r", Counters: report.Counters{Allowed: counter(at)}}}}}
		want := every.record(key, rule, reps, t0.Add(at))
		// The reader brings the policy when the report changed, or while its counts move.
		if c := counter(at); c != last || moving || at == 0 {
			got := sparse.record(key, rule, reps, t0.Add(at))
			moving = counted(got)
			last = c
			if got["r"] != want["r"] {
				t.Errorf("at %v: counts %+v sampled sparsely, %+v sampled every interval", at, got["r"], want["r"])
			}
		} else if counted(want) {
			t.Errorf("at %v: the reader skips the policy while every-interval counts are %+v", at, want["r"])
		}
	}
}
