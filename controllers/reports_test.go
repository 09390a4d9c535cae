package controllers

import (
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/sluice-dev/sluice/internal/report"
)

// A read of a report differs from the last one exactly when a reconcile would see something
// else: another report, another error or another address; an earlier read that ends last does
// not undo a later one.
func TestReportsSeenWhenAPodIsReadAgainThenOnlyADifferenceIsAChange(t *testing.T) {
	pod := func(uid types.UID, ip string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{UID: uid}, Status: corev1.PodStatus{PodIP: ip}}
	}
	rep := func(allowed uint64, connected bool) *report.Report {
		// Fresh times, as each read decodes them anew.
		return &report.Report{Version: report.Version, Started: t0.UTC(), Revision: "r1", RevisionSince: t0.Add(time.Second).UTC(),
			Store: report.Store{Kind: "memory", Connected: connected, Since: t0.UTC()},
			Rules: []report.Rule{{Policy: "ns/p", Name: "r", Counters: report.Counters{Allowed: allowed}}}}
	}
	var s reportsSeen
	steps := []struct {
		name string
		pod  *corev1.Pod
		rep  *report.Report
		err  error
		at   time.Duration
		want bool
	}{
		{"when a pod is read for the first time then it changed", pod("a", "10.0.0.1"), rep(5, true), nil, 0, true},
		{"when the same report is read again then no change", pod("a", "10.0.0.1"), rep(5, true), nil, 10 * time.Second, false},
		{"when a counter moves then it changed", pod("a", "10.0.0.1"), rep(6, true), nil, 20 * time.Second, true},
		{"when the store disconnects then it changed", pod("a", "10.0.0.1"), rep(6, false), nil, 30 * time.Second, true},
		{"when an earlier read ends last then it is ignored", pod("a", "10.0.0.1"), rep(1, true), nil, 25 * time.Second, false},
		{"when the read fails then it changed", pod("a", "10.0.0.1"), nil, errors.New("connection refused"), 40 * time.Second, true},
		{"when it fails alike then no change", pod("a", "10.0.0.1"), nil, errors.New("connection refused"), 50 * time.Second, false},
		{"when it answers again then it changed", pod("a", "10.0.0.1"), rep(6, false), nil, 60 * time.Second, true},
		{"when the pod has another address then it changed", pod("a", "10.0.0.2"), rep(6, false), nil, 70 * time.Second, true},
		{"when another pod is read then it changed", pod("b", "10.0.0.3"), rep(6, false), nil, 70 * time.Second, true},
	}
	for _, st := range steps {
		if got := s.observe(st.pod, st.rep, st.err, t0.Add(st.at)); got != st.want {
			t.Errorf("%s: changed = %v, want %v", st.name, got, st.want)
		}
	}
	if _, ok := s.fresh(pod("a", "10.0.0.2"), t0.Add(70*time.Second+freshReport)); ok {
		t.Error("a read freshReport old is still fresh")
	}
	if read, ok := s.fresh(pod("a", "10.0.0.2"), t0.Add(70*time.Second+freshReport/2)); !ok || read.report.Store.Connected {
		t.Errorf("fresh = %+v, %v; want the last read", read, ok)
	}
	s.keep(map[types.UID]bool{"b": true})
	if s.observe(pod("a", "10.0.0.2"), rep(6, false), nil, t0.Add(80*time.Second)) != true {
		t.Error("a pod kept out of the live set was remembered")
	}
}

// The report ticker records a sample only when a report changed, so the samples of an idle
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
		// The ticker brings the policy when the report changed, or while its counts move.
		if c := counter(at); c != last || moving || at == 0 {
			got := sparse.record(key, rule, reps, t0.Add(at))
			moving = counted(got)
			last = c
			if got["r"] != want["r"] {
				t.Errorf("at %v: counts %+v sampled sparsely, %+v sampled every interval", at, got["r"], want["r"])
			}
		} else if counted(want) {
			t.Errorf("at %v: the ticker skips the policy while every-interval counts are %+v", at, want["r"])
		}
	}
}
