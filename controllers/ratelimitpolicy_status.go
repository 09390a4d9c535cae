package controllers

import (
	"fmt"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers/render"
)

// observation is what one reconcile learned. Status is a pure function of it.
type observation struct {
	// invalid is the validation error, if the spec is invalid.
	invalid string
	// conflictsWith names the older policy that targets the same Service.
	conflictsWith string
	// applyErr is set when applying an object failed; stalled when no retry can fix it.
	applyErr error
	stalled  bool
	// programmed is true once every object was applied.
	programmed bool
	revision   string
	service    string
	replicas   int32
	image      string
	deployment *appsv1.Deployment
	// targetMissing is true when the target Service does not exist.
	targetMissing bool
	// redisUnreachable says why the Redis of storage.redis did not answer a probe.
	redisUnreachable string
}

// computeStatus derives the status from an observation made at now. A condition whose status
// changes transitions at now; one whose status does not keeps its transition time.
func computeStatus(p *v1alpha1.RateLimitPolicy, obs observation, reconciled bool, now time.Time) v1alpha1.RateLimitPolicyStatus {
	st := *p.Status.DeepCopy()
	gen := p.Generation
	set := func(t string, ok bool, reason, msg string) {
		status := metav1.ConditionFalse
		if ok {
			status = metav1.ConditionTrue
		}
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: t, Status: status, Reason: reason, Message: msg,
			ObservedGeneration: gen, LastTransitionTime: metav1.NewTime(now)})
	}

	switch {
	case obs.invalid != "":
		set(v1alpha1.ConditionAccepted, false, v1alpha1.ReasonInvalid, obs.invalid)
		set(v1alpha1.ConditionStalled, true, v1alpha1.ReasonInvalid, obs.invalid)
	case obs.conflictsWith != "":
		msg := fmt.Sprintf("RateLimitPolicy %s already targets Service %s", obs.conflictsWith, p.Spec.TargetRef.Name)
		set(v1alpha1.ConditionAccepted, false, v1alpha1.ReasonConflicted, msg)
		set(v1alpha1.ConditionStalled, true, v1alpha1.ReasonConflicted, msg)
	case obs.stalled:
		set(v1alpha1.ConditionAccepted, true, v1alpha1.ReasonAccepted, "the spec is valid")
		set(v1alpha1.ConditionStalled, true, v1alpha1.ReasonApplyFailed, obs.applyErr.Error())
	default:
		set(v1alpha1.ConditionAccepted, true, v1alpha1.ReasonAccepted, "the spec is valid")
		set(v1alpha1.ConditionStalled, false, v1alpha1.ReasonAccepted, "")
	}

	accepted := obs.invalid == "" && obs.conflictsWith == ""
	switch {
	case !accepted:
		set(v1alpha1.ConditionProgrammed, false, v1alpha1.ReasonNotAccepted, "nothing is programmed for a policy that is not accepted")
	case obs.applyErr != nil:
		set(v1alpha1.ConditionProgrammed, false, v1alpha1.ReasonApplyFailed, obs.applyErr.Error())
	case obs.programmed:
		set(v1alpha1.ConditionProgrammed, true, v1alpha1.ReasonProgrammed, "config revision "+obs.revision+" applied")
	}

	ready, reason, msg := deploymentReady(obs)
	set(v1alpha1.ConditionReady, ready, reason, msg)
	set(v1alpha1.ConditionReconciling, accepted && !obs.stalled && !ready, reason, msg)

	switch {
	case obs.targetMissing:
		set(v1alpha1.ConditionDegraded, true, v1alpha1.ReasonTargetNotFound, "Service "+p.Spec.TargetRef.Name+" does not exist: the enforcer has nothing to forward to")
	case obs.redisUnreachable != "":
		set(v1alpha1.ConditionDegraded, true, v1alpha1.ReasonRedisUnreachable, obs.redisUnreachable)
	default:
		set(v1alpha1.ConditionDegraded, false, v1alpha1.ReasonAsExpected, "")
	}

	if obs.programmed {
		st.Enforcer = &v1alpha1.EnforcerStatus{ServiceName: obs.service, Replicas: obs.replicas, Image: obs.image, ConfigRevision: obs.revision}
		if obs.deployment != nil {
			st.Enforcer.ReadyReplicas = obs.deployment.Status.ReadyReplicas
		}
	}
	if reconciled {
		st.ObservedGeneration = gen
	}
	return st
}

// deploymentReady tells whether the enforcer Deployment runs the current config revision on all
// its replicas.
func deploymentReady(obs observation) (bool, string, string) {
	d := obs.deployment
	switch {
	case !obs.programmed || d == nil:
		return false, v1alpha1.ReasonNotProgrammed, "the enforcer is not programmed"
	case d.Annotations[render.RevisionAnnotation] != obs.revision:
		return false, v1alpha1.ReasonRollingOut, "the enforcer Deployment does not have config revision " + obs.revision + " yet"
	case d.Status.ObservedGeneration < d.Generation:
		return false, v1alpha1.ReasonRollingOut, "the Deployment controller has not observed the enforcer Deployment's latest spec"
	case d.Spec.Replicas != nil && (d.Status.UpdatedReplicas < *d.Spec.Replicas || d.Status.AvailableReplicas < *d.Spec.Replicas):
		return false, v1alpha1.ReasonRollingOut, fmt.Sprintf("%d of %d enforcer replicas updated and %d available",
			d.Status.UpdatedReplicas, *d.Spec.Replicas, d.Status.AvailableReplicas)
	case d.Status.Replicas > d.Status.UpdatedReplicas:
		return false, v1alpha1.ReasonRollingOut, "old enforcer replicas are still terminating"
	}
	return true, v1alpha1.ReasonAvailable, "all enforcer replicas run config revision " + obs.revision
}
