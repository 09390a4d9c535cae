package controllers

import (
	"errors"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers/render"
)

var t0 = time.Unix(1_700_000_000, 0)

// A condition transitions at the time of the observation that changed it, and keeps that time
// while its status holds.
func TestComputeStatusWhenAConditionChangesThenItTransitionsAtTheObservationsTime(t *testing.T) {
	p := &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Generation: 1}}
	p.Status = computeStatus(p, observation{invalid: "spec.rules: Required value"}, true, t0)
	later := t0.Add(time.Hour)
	p.Status = computeStatus(p, observation{invalid: "spec.rules[0].name: Required value"}, true, later)
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
			observation{applyErr: errors.New("ConfigMap x exists and is not owned by this policy"), stalled: true}, true, false},
		{"when the error is transient then Reconciling and not Stalled",
			observation{applyErr: errors.New("etcdserver: request timed out")}, false, true},
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
			ObjectMeta: metav1.ObjectMeta{Generation: 2, Annotations: map[string]string{render.RevisionAnnotation: "r1"}},
			Spec:       appsv1.DeploymentSpec{Replicas: ptr.To(replicas)},
			Status:     appsv1.DeploymentStatus{ObservedGeneration: 2, Replicas: replicas, UpdatedReplicas: replicas, AvailableReplicas: replicas, ReadyReplicas: replicas},
		}
	}
	programmed := func(d *appsv1.Deployment) observation {
		return observation{programmed: true, revision: "r1", service: "sluice-p", replicas: 2, image: "img", deployment: d}
	}
	rolling := ready(2)
	rolling.Status.UpdatedReplicas = 1
	oldRevision := ready(2)
	oldRevision.Annotations[render.RevisionAnnotation] = "r0"
	unobserved := ready(2)
	unobserved.Status.ObservedGeneration = 1
	terminating := ready(2)
	terminating.Status.Replicas = 3
	withTarget := programmed(ready(2))
	withTarget.targetMissing = true
	withRedis := programmed(ready(2))
	withRedis.redisUnreachable = "dial tcp 10.0.0.1:6379: i/o timeout"

	type cond struct {
		status metav1.ConditionStatus
		reason string
	}
	cases := []struct {
		name string
		obs  observation
		want map[string]cond
	}{
		{"when every replica runs the current revision then Ready", programmed(ready(2)), map[string]cond{
			v1alpha1.ConditionAccepted: {"True", v1alpha1.ReasonAccepted}, v1alpha1.ConditionProgrammed: {"True", v1alpha1.ReasonProgrammed},
			v1alpha1.ConditionReady: {"True", v1alpha1.ReasonAvailable}, v1alpha1.ConditionDegraded: {"False", v1alpha1.ReasonAsExpected},
			v1alpha1.ConditionReconciling: {"False", v1alpha1.ReasonAvailable}, v1alpha1.ConditionStalled: {"False", v1alpha1.ReasonAccepted}}},
		{"when the spec is invalid then not Accepted and Stalled", observation{invalid: "spec.rules: Required value"}, map[string]cond{
			v1alpha1.ConditionAccepted: {"False", v1alpha1.ReasonInvalid}, v1alpha1.ConditionStalled: {"True", v1alpha1.ReasonInvalid},
			v1alpha1.ConditionProgrammed: {"False", v1alpha1.ReasonNotAccepted}, v1alpha1.ConditionReady: {"False", v1alpha1.ReasonNotProgrammed},
			v1alpha1.ConditionReconciling: {"False", v1alpha1.ReasonNotProgrammed}}},
		{"when an older policy targets the Service then Conflicted and Stalled", observation{conflictsWith: "older"}, map[string]cond{
			v1alpha1.ConditionAccepted: {"False", v1alpha1.ReasonConflicted}, v1alpha1.ConditionStalled: {"True", v1alpha1.ReasonConflicted}}},
		{"when the Deployment still has the old revision then RollingOut", programmed(oldRevision), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRollingOut}, v1alpha1.ConditionReconciling: {"True", v1alpha1.ReasonRollingOut}}},
		{"when replicas are being updated then RollingOut", programmed(rolling), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRollingOut}}},
		{"when the Deployment controller has not seen the spec then RollingOut", programmed(unobserved), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRollingOut}}},
		{"when old replicas still terminate then RollingOut", programmed(terminating), map[string]cond{
			v1alpha1.ConditionReady: {"False", v1alpha1.ReasonRollingOut}}},
		{"when the target Service is missing then Degraded TargetNotFound", withTarget, map[string]cond{
			v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonTargetNotFound}}},
		{"when Redis does not answer then Degraded RedisUnreachable", withRedis, map[string]cond{
			v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonRedisUnreachable}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Generation: 3}}
			st := computeStatus(p, c.obs, true, t0)
			for typ, want := range c.want {
				got := meta.FindStatusCondition(st.Conditions, typ)
				if got == nil || got.Status != want.status || got.Reason != want.reason || got.ObservedGeneration != 3 {
					t.Errorf("%s = %+v, want %s %s at generation 3", typ, got, want.status, want.reason)
				}
			}
			if st.ObservedGeneration != 3 {
				t.Errorf("observedGeneration = %d, want 3", st.ObservedGeneration)
			}
			if c.obs.programmed && (st.Enforcer == nil || st.Enforcer.Image != "img" || st.Enforcer.Replicas != 2 || st.Enforcer.ConfigRevision != "r1") {
				t.Errorf("status.enforcer = %+v, want the image, replicas and revision observed", st.Enforcer)
			}
		})
	}
}
