package controllers

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

var t0 = time.Unix(1_700_000_000, 0)

// testHome is the pool of one of a policy p with two replicas of the image img on Redis.
func testHome() *home {
	return oneHome(&v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "uid-p", Generation: 3},
		Spec: v1alpha1.RateLimitPolicySpec{
			Enforcer: &v1alpha1.EnforcerSpec{Replicas: ptr.To[int32](2), Image: "img"},
			Storage:  &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{"redis:6379"}}},
		}}, render.Defaults{})
}

// A condition transitions at the time of the observation that changed it, and keeps that time
// while its status holds.
func TestComputeStatusWhenAConditionChangesThenItTransitionsAtTheObservationsTime(t *testing.T) {
	p := &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Generation: 1}}
	p.Status = computeStatus(p, observation{verdict: verdict{invalid: "spec.rules: Required value"}}, true, t0)
	later := t0.Add(time.Hour)
	p.Status = computeStatus(p, observation{verdict: verdict{invalid: "spec.rules[0].name: Required value"}}, true, later)
	if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionAccepted); !c.LastTransitionTime.Time.Equal(t0) {
		t.Errorf("Accepted stayed False but moved to %v, want %v", c.LastTransitionTime, t0)
	}
	p.Status = computeStatus(p, observation{}, true, later)
	if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionAccepted); c.Status != metav1.ConditionTrue || !c.LastTransitionTime.Time.Equal(later) {
		t.Errorf("Accepted = %s at %v, want True at %v", c.Status, c.LastTransitionTime, later)
	}
}

// An apply error no retry can fix is Stalled, and the policy is no longer Reconciling; a transient
// one keeps it Reconciling, so kstatus waits.
func TestComputeStatusWhenApplyFailsThenStalledOnlyWhenFinal(t *testing.T) {
	cases := []struct {
		name                 string
		obs                  observation
		stalled, reconciling bool
	}{
		{"when the error is final then Stalled and not Reconciling",
			observation{progress: progress{applyErr: errors.New("ConfigMap x exists and is not owned by this policy"), stalled: true}}, true, false},
		{"when the error is transient then Reconciling and not Stalled",
			observation{progress: progress{applyErr: errors.New("etcdserver: request timed out")}}, false, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := &v1alpha1.RateLimitPolicy{}
			st := computeStatus(p, c.obs, false, t0)
			if got := meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionStalled); got != c.stalled {
				t.Errorf("Stalled = %v, want %v", got, c.stalled)
			}
			if got := meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionReconciling); got != c.reconciling {
				t.Errorf("Reconciling = %v, want %v", got, c.reconciling)
			}
			if prog := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionProgrammed); prog == nil || prog.Reason != v1alpha1.ReasonApplyFailed {
				t.Errorf("Programmed = %+v, want False ApplyFailed", prog)
			}
		})
	}
}

// Every condition and reason the controller reports, from the observations that lead to it.
func TestComputeStatusWhenObservedThenEveryConditionAndReason(t *testing.T) {
	ready := func(replicas int32) *appsv1.Deployment {
		return &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Generation: 2},
			Spec:       appsv1.DeploymentSpec{Replicas: ptr.To(replicas)},
			Status:     appsv1.DeploymentStatus{ObservedGeneration: 2, Replicas: replicas, UpdatedReplicas: replicas, AvailableReplicas: replicas, ReadyReplicas: replicas},
		}
	}
	serving := func(pod, revision string) replica {
		return replica{pod: pod, ready: true, revision: revision, report: &report.Report{Revision: revision, Store: report.Store{Connected: true}}}
	}
	observe := func(d *appsv1.Deployment, pods ...replica) observation {
		return observation{verdict: verdict{home: testHome()}, revision: "r1", progress: progress{programmed: true, replicas: 2, deployment: d, pods: pods}}
	}
	both := []replica{serving("p-a", "r1"), serving("p-b", "r1")}
	rolling := ready(2)
	rolling.Status.UpdatedReplicas = 1
	unobserved := ready(2)
	unobserved.Status.ObservedGeneration = 1
	terminating := ready(2)
	terminating.Status.Replicas = 3
	withTarget := observe(ready(2), both...)
	withTarget.targetMissing = true
	storeFails := func(cause, msg string) observation {
		b := serving("p-b", "r1")
		b.report.Store = report.Store{Cause: cause, Message: msg}
		return observe(ready(2), serving("p-a", "r1"), b)
	}
	probeOnly := observe(ready(2), replica{pod: "p-a", ready: true, err: errors.New("connection refused")})
	probeOnly.redisUnreachable = "dial tcp 10.0.0.1:6379: i/o timeout"

	type cond struct {
		status       metav1.ConditionStatus
		reason, text string
	}
	cases := []struct {
		name  string
		obs   observation
		want  map[string]cond
		ready string
	}{
		{"when every replica serves the current revision then Ready", observe(ready(2), both...), map[string]cond{
			v1alpha1.ConditionAccepted: {"True", v1alpha1.ReasonAccepted, ""}, v1alpha1.ConditionProgrammed: {"True", v1alpha1.ReasonProgrammed, ""},
			v1alpha1.ConditionReady:       {"True", v1alpha1.ReasonAvailable, "2/2 replicas serve revision r1"},
			v1alpha1.ConditionDegraded:    {"False", v1alpha1.ReasonAsExpected, ""},
			v1alpha1.ConditionReconciling: {"False", v1alpha1.ReasonAvailable, ""}, v1alpha1.ConditionStalled: {"False", v1alpha1.ReasonAccepted, ""}}, "2/2"},
		{"when the spec is invalid then not Accepted and Stalled", observation{verdict: verdict{invalid: "spec.rules: Required value"}}, map[string]cond{
			v1alpha1.ConditionAccepted: {"False", v1alpha1.ReasonInvalid, ""}, v1alpha1.ConditionStalled: {"True", v1alpha1.ReasonInvalid, ""},
			v1alpha1.ConditionProgrammed: {"False", v1alpha1.ReasonNotAccepted, ""}, v1alpha1.ConditionReady: {"False", v1alpha1.ReasonNotProgrammed, ""},
			v1alpha1.ConditionReconciling: {"False", v1alpha1.ReasonNotProgrammed, ""}}, ""},
		{"when an older policy targets the Service then Conflicted and Stalled", observation{verdict: verdict{conflictsWith: "older"}}, map[string]cond{
			v1alpha1.ConditionAccepted: {"False", v1alpha1.ReasonConflicted, ""}, v1alpha1.ConditionStalled: {"True", v1alpha1.ReasonConflicted, ""}}, ""},
		{"when a replica still serves the previous revision then RollingOut", observe(ready(2), serving("p-a", "r1"), serving("p-b", "r0")), map[string]cond{
			v1alpha1.ConditionReady:       {"False", v1alpha1.ReasonRollingOut, "1/2 replicas serve revision r1; 1 serves r0"},
			v1alpha1.ConditionReconciling: {"True", v1alpha1.ReasonRollingOut, ""}}, "1/2"},
		{"when a replica is not ready then Unavailable, naming it", observe(ready(2), serving("p-a", "r1"), replica{pod: "p-b"}), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonUnavailable, "1/2 replicas serve revision r1; p-b is not ready"}}, "1/2"},
		{"when a replica does not report then Unavailable, saying why", observe(ready(2), serving("p-a", "r1"), replica{pod: "p-b", ready: true, err: errors.New("connection refused")}), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonUnavailable, "1/2 replicas serve revision r1; p-b did not report: connection refused"}}, "1/2"},
		{"when a replica is missing then Unavailable", observe(ready(2), serving("p-a", "r1")), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonUnavailable, "1/2 replicas serve revision r1"}}, "1/2"},
		{"when replicas are being updated then RollingOut", observe(rolling, serving("p-a", "r1")), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRollingOut, ""}}, "1/2"},
		{"when the Deployment controller has not seen the spec then RollingOut", observe(unobserved, serving("p-a", "r1")), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRollingOut, ""}}, "1/2"},
		{"when old replicas still terminate then RollingOut", observe(terminating, both...), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRollingOut, "2/2 replicas serve revision r1; old replicas are still terminating"}}, "2/2"},
		{"when the target Service is missing then Degraded TargetNotFound", withTarget, map[string]cond{
			v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonTargetNotFound, ""}}, "2/2"},
		{"when Redis refuses a replica's password then Degraded in Redis's words", storeFails(report.CauseAuthentication, "WRONGPASS invalid username-password pair"), map[string]cond{
			v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonRedisAuthenticationFailed, "replica p-b: WRONGPASS invalid username-password pair"},
			v1alpha1.ConditionReady:    {"True", v1alpha1.ReasonAvailable, ""}}, "2/2"},
		{"when a replica's TLS handshake fails then Degraded RedisTLSFailed", storeFails(report.CauseTLS, "tls: failed to verify certificate"), map[string]cond{
			v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonRedisTLSFailed, "replica p-b: tls: failed to verify certificate"}}, "2/2"},
		{"when Redis does not answer a replica in time then Degraded RedisUnreachable", storeFails(report.CauseTimeout, "context deadline exceeded"), map[string]cond{
			v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonRedisUnreachable, "replica p-b: context deadline exceeded"}}, "2/2"},
		{"when a pool's replica refused the current revision then Refused, in its words", observe(ready(2), serving("p-a", "r1"),
			replica{pod: "p-b", ready: true, revision: "r0", refused: `unknown field "spec.x"`, report: &report.Report{Store: report.Store{Connected: true}}}), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRefused, `1/2 replicas serve revision r1; 1 serves r0; replica p-b refused it: unknown field "spec.x"`}}, "1/2"},
		{"when a pool's replica does not serve the policy yet then RollingOut", observe(ready(2), serving("p-a", "r1"),
			replica{pod: "p-b", ready: true, report: &report.Report{Store: report.Store{Connected: true}}}), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRollingOut, "1/2 replicas serve revision r1; 1 does not serve it yet"}}, "1/2"},
		{"when the pool does not exist then not Accepted and Stalled", observation{verdict: verdict{rejection: v1alpha1.ReasonPoolNotFound, rejectionMessage: "EnforcerPool gw/x does not exist"}}, map[string]cond{
			v1alpha1.ConditionAccepted: {"False", v1alpha1.ReasonPoolNotFound, "EnforcerPool gw/x does not exist"}, v1alpha1.ConditionStalled: {"True", v1alpha1.ReasonPoolNotFound, ""},
			v1alpha1.ConditionProgrammed: {"False", v1alpha1.ReasonNotAccepted, ""}}, ""},
		{"when the pool does not admit the namespace then not Accepted and Stalled", observation{verdict: verdict{rejection: v1alpha1.ReasonNotAllowedByPool, rejectionMessage: "no"}}, map[string]cond{
			v1alpha1.ConditionAccepted: {"False", v1alpha1.ReasonNotAllowedByPool, "no"}, v1alpha1.ConditionStalled: {"True", v1alpha1.ReasonNotAllowedByPool, ""}}, ""},
		{"when no replica reports then the manager's probe speaks", probeOnly, map[string]cond{
			v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonRedisUnreachable, "dial tcp 10.0.0.1:6379: i/o timeout"}}, "0/2"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Generation: 3}}
			st := computeStatus(p, c.obs, true, t0)
			for typ, want := range c.want {
				got := meta.FindStatusCondition(st.Conditions, typ)
				if got == nil || got.Status != want.status || got.Reason != want.reason || got.ObservedGeneration != 3 || want.text != "" && got.Message != want.text {
					t.Errorf("%s = %+v, want %s %s %q at generation 3", typ, got, want.status, want.reason, want.text)
				}
			}
			if st.ObservedGeneration != 3 {
				t.Errorf("observedGeneration = %d, want 3", st.ObservedGeneration)
			}
			if want := firstFailing(st.Conditions); st.Reason != want {
				t.Errorf("status.reason = %q, want %q", st.Reason, want)
			}
			if !c.obs.programmed {
				return
			}
			if st.Enforcer == nil || st.Enforcer.Image != "img" || st.Enforcer.Replicas != 2 || st.Enforcer.ConfigRevision != "r1" ||
				st.Enforcer.Ready != c.ready || st.Enforcer.Storage != "redis-standalone" {
				t.Errorf("status.enforcer = %+v, want the image, replicas, revision and storage observed, ready %s", st.Enforcer, c.ready)
			}
		})
	}
}

// Counts of the last minute become status.rules in spec order and the share limited; a shadow
// rule's would-be refusals count for the rule, not for the policy's share; a rule's skipped
// decisions and responses charged are its own counts.
func TestComputeStatusWhenRulesDecidedThenCountsAndShares(t *testing.T) {
	p := &v1alpha1.RateLimitPolicy{Spec: v1alpha1.RateLimitPolicySpec{Rules: []v1alpha1.Rule{
		{Name: "login"}, {Name: "trial", Mode: v1alpha1.ModeShadow}, {Name: "api"}, {Name: "idle"}}}}
	obs := observation{counts: map[string]report.Counters{
		"api":   {Allowed: 90, Limited: 10, FailedOpen: 2, FailedClosed: 1},
		"trial": {Allowed: 5, ShadowLimited: 15},
		"login": {Allowed: 0, Limited: 0, Skipped: 4, Charged: 3}, // charged by the response
	}}
	st := computeStatus(p, obs, true, t0)
	want := []v1alpha1.RuleStatus{
		{Name: "login", Skipped: 4, Charged: 3},
		{Name: "trial", Allowed: 5, Limited: 15, LimitedShare: "75.0%"},
		{Name: "api", Allowed: 90, Limited: 10, Failed: 3, LimitedShare: "10.0%"},
	}
	if fmt.Sprint(st.Rules) != fmt.Sprint(want) {
		t.Errorf("status.rules = %+v, want %+v", st.Rules, want)
	}
	if st.Limited != "10.0%" {
		t.Errorf("status.limited = %q, want 10.0%% (the enforced rules' 10 of 100)", st.Limited)
	}
	if st := computeStatus(p, observation{}, true, t0); st.Rules != nil || st.Limited != "" {
		t.Errorf("with no counts: rules %+v, limited %q; want none", st.Rules, st.Limited)
	}
}

// The counts of the last minute: each pod's latest counters less those of its newest sample at
// least a minute old, or less zero for a pod that started within the minute.
func TestHistoryWhenReportsArriveThenCountsCoverTheLastMinute(t *testing.T) {
	var h history
	key := types.NamespacedName{Namespace: "ns", Name: "p"}
	rule := func(r report.Rule) (string, bool) { return r.Name, r.Policy == "ns/p" }
	rep := func(started time.Time, allowed uint64) *report.Report {
		return &report.Report{Started: started, Rules: []report.Rule{
			{Policy: "ns/p", Name: "r", Counters: report.Counters{Allowed: allowed}},
			{Policy: "ns/other", Name: "r", Counters: report.Counters{Allowed: 1000}},
		}}
	}
	old, fresh := t0.Add(-time.Hour), t0.Add(-10*time.Second)
	steps := []struct {
		at      time.Duration
		reports map[types.UID]*report.Report
		want    uint64
	}{
		// a: running for an hour, first seen with 100: its first sample is the baseline.
		// b: started 10 s ago: all of its 7 fell within the minute.
		{0, map[types.UID]*report.Report{"a": rep(old, 100), "b": rep(fresh, 7)}, 0 + 7},
		{30 * time.Second, map[types.UID]*report.Report{"a": rep(old, 130), "b": rep(fresh, 17)}, 30 + 17},
		// A minute after the first reports, what came before them has left the window.
		{70 * time.Second, map[types.UID]*report.Report{"a": rep(old, 150), "b": rep(fresh, 27)}, 50 + 20},
		// b restarts: its counters start again from zero, within the window.
		{80 * time.Second, map[types.UID]*report.Report{"a": rep(old, 150), "b": rep(t0.Add(75*time.Second), 4)}, 50 + 4},
		// a goes away: only b counts.
		{90 * time.Second, map[types.UID]*report.Report{"b": rep(t0.Add(75*time.Second), 6)}, 6},
		// Nothing more happens: b's 6 count until a minute has passed since them.
		{120 * time.Second, map[types.UID]*report.Report{"b": rep(t0.Add(75*time.Second), 6)}, 6},
		{200 * time.Second, map[types.UID]*report.Report{"b": rep(t0.Add(75*time.Second), 6)}, 0},
	}
	for _, s := range steps {
		got := h.record(key, rule, s.reports, t0.Add(s.at))
		if got["r"].Allowed != s.want || len(got) != 1 {
			t.Errorf("at %v: counts %+v, want allowed %d of rule r only", s.at, got, s.want)
		}
	}
	h.forget(key)
	if len(h.policies) != 0 {
		t.Errorf("forget left %d policies", len(h.policies))
	}
}

// status.ruleNames lists every rule for kubectl get while they fit in its 64 characters, and
// past that the names that fit and how many it left out, never more than 64.
func TestRuleNamesWhenTheRulesAreListedThenAllFitOrTheRestAreCounted(t *testing.T) {
	named := func(lengths ...int) []v1alpha1.Rule {
		rules := make([]v1alpha1.Rule, len(lengths))
		for i, n := range lengths {
			rules[i].Name = strings.Repeat(string(rune('a'+i)), n)
		}
		return rules
	}
	numbered := func(n int) []v1alpha1.Rule {
		rules := make([]v1alpha1.Rule, n)
		for i := range rules {
			rules[i].Name = fmt.Sprintf("rule-%d", i)
		}
		return rules
	}
	a, b, c := strings.Repeat("a", 20), strings.Repeat("b", 21), strings.Repeat("c", 21)
	cases := []struct {
		name  string
		rules []v1alpha1.Rule
		want  string
	}{
		{"when there is one rule then its name", named(5), "aaaaa"},
		{"when the names join to 64 characters then all of them", named(20, 21, 21), a + "," + b + "," + c},
		{"when they join to 65 then the last is counted instead", named(20, 21, 22), a + "," + b + ",+1 more"},
		{"when 32 rules have short names then those that fit and the rest counted", numbered(32),
			"rule-0,rule-1,rule-2,rule-3,rule-4,rule-5,rule-6,rule-7,+24 more"},
		{"when the first name leaves no room for the count then only the count", named(63, 1), "+2 more"},
		{"when 32 names have 63 characters then only the count", named(slices.Repeat([]int{63}, 32)...), "+32 more"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := ruleNames(c.rules)
			if got != c.want {
				t.Errorf("ruleNames = %q, want %q", got, c.want)
			}
			if len(got) > maxRuleNames {
				t.Errorf("ruleNames = %q: %d characters, more than %d", got, len(got), maxRuleNames)
			}
		})
	}
}

// firstFailing is the reason of the first condition that fails, in the order Accepted (False),
// Programmed (False), Ready (False), Degraded (True): what kubectl's REASON column shows.
func firstFailing(conds []metav1.Condition) string {
	for _, f := range []struct {
		typ    string
		status metav1.ConditionStatus
	}{{v1alpha1.ConditionAccepted, "False"}, {v1alpha1.ConditionProgrammed, "False"}, {v1alpha1.ConditionReady, "False"}, {v1alpha1.ConditionDegraded, "True"}} {
		if c := meta.FindStatusCondition(conds, f.typ); c != nil && c.Status == f.status {
			return c.Reason
		}
	}
	return ""
}
