package controllers

import (
	"fmt"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/report"
)

// observation is what one reconcile learned. Status is a pure function of it.
type observation struct {
	// invalid is the validation error, if the spec is invalid.
	invalid string
	// conflictsWith names the older policy that targets the same Service.
	conflictsWith string
	// poolRejection is the reason the pool of spec.enforcer.poolRef does not take the policy
	// (PoolNotFound, NotAllowedByPool), and poolMessage says why.
	poolRejection, poolMessage string
	// pool is the "<namespace>/<name>" of the pool that serves the policy, "" for its own enforcer.
	pool string
	// applyErr is set when applying an object failed; stalled when no retry can fix it.
	applyErr error
	stalled  bool
	// programmed is true once every object was applied.
	programmed bool
	revision   string
	service    string
	replicas   int32
	image      string
	storage    string
	deployment *appsv1.Deployment
	// pods are the enforcer pods that are not terminating, with what each reported.
	pods []replica
	// counts are each rule's decisions over the last minute, by rule name.
	counts map[string]report.Counters
	// targetMissing is true when the target Service does not exist.
	targetMissing bool
	// redisUnreachable says why the Redis of storage.redis did not answer the manager's probe.
	redisUnreachable string
}

// replica is one enforcer pod as the manager saw it.
type replica struct {
	pod string
	uid types.UID
	// ready is the pod's Ready condition.
	ready bool
	// report is what the enforcer reported, or err why it could not be read.
	report *report.Report
	err    error
	// revision is the revision of the policy the replica serves: its report's, or, for a
	// pool's replica, its entry's ("" when it serves none). refused is why it refused the
	// current revision, if it did.
	revision, refused string
}

// computeStatus derives the status from an observation made at now. A condition whose status
// changes transitions at now; one whose status does not keeps its transition time.
func computeStatus(p *v1alpha1.RateLimitPolicy, obs observation, reconciled bool, now time.Time) v1alpha1.RateLimitPolicyStatus {
	st := *p.Status.DeepCopy()
	set := conditionSetter(&st.Conditions, p.Generation, now)

	switch {
	case obs.invalid != "":
		set(v1alpha1.ConditionAccepted, false, v1alpha1.ReasonInvalid, obs.invalid)
		set(v1alpha1.ConditionStalled, true, v1alpha1.ReasonInvalid, obs.invalid)
	case obs.conflictsWith != "":
		msg := fmt.Sprintf("RateLimitPolicy %s already targets Service %s", obs.conflictsWith, p.Spec.TargetRef.Name)
		set(v1alpha1.ConditionAccepted, false, v1alpha1.ReasonConflicted, msg)
		set(v1alpha1.ConditionStalled, true, v1alpha1.ReasonConflicted, msg)
	case obs.poolRejection != "":
		set(v1alpha1.ConditionAccepted, false, obs.poolRejection, obs.poolMessage)
		set(v1alpha1.ConditionStalled, true, obs.poolRejection, obs.poolMessage)
	case obs.stalled:
		set(v1alpha1.ConditionAccepted, true, v1alpha1.ReasonAccepted, "the spec is valid")
		set(v1alpha1.ConditionStalled, true, v1alpha1.ReasonApplyFailed, obs.applyErr.Error())
	default:
		set(v1alpha1.ConditionAccepted, true, v1alpha1.ReasonAccepted, "the spec is valid")
		set(v1alpha1.ConditionStalled, false, v1alpha1.ReasonAccepted, "")
	}

	accepted := obs.invalid == "" && obs.conflictsWith == "" && obs.poolRejection == ""
	switch {
	case !accepted:
		set(v1alpha1.ConditionProgrammed, false, v1alpha1.ReasonNotAccepted, "nothing is programmed for a policy that is not accepted")
	case obs.applyErr != nil:
		set(v1alpha1.ConditionProgrammed, false, v1alpha1.ReasonApplyFailed, obs.applyErr.Error())
	case obs.programmed:
		set(v1alpha1.ConditionProgrammed, true, v1alpha1.ReasonProgrammed, "config revision "+obs.revision+" applied")
	}

	serving, ready, reason, msg := readiness(obs)
	set(v1alpha1.ConditionReady, ready, reason, msg)
	set(v1alpha1.ConditionReconciling, accepted && !obs.stalled && !ready, reason, msg)
	st.Reason = ""
	if !ready {
		st.Reason = reason
	}

	degraded, reason, msg := degradation(p, obs)
	set(v1alpha1.ConditionDegraded, degraded, reason, msg)

	if obs.programmed {
		st.Enforcer = &v1alpha1.EnforcerStatus{ServiceName: obs.service, Pool: obs.pool, Replicas: obs.replicas, Image: obs.image,
			ConfigRevision: obs.revision, ReadyReplicas: serving, Ready: fmt.Sprintf("%d/%d", serving, obs.replicas), Storage: obs.storage}
	}
	st.RuleNames = ruleNames(p.Spec.Rules)
	st.Rules, st.Limited = ruleCounts(p, obs.counts)
	if reconciled {
		st.ObservedGeneration = p.Generation
	}
	return st
}

// readiness tells how many replicas serve the current revision and whether that makes the
// policy Ready: every desired replica ready and reporting it, no replica reporting another, and
// the Deployment done rolling out.
func readiness(obs observation) (serving int32, ready bool, reason, msg string) {
	if !obs.programmed || obs.deployment == nil {
		return 0, false, v1alpha1.ReasonNotProgrammed, "the enforcer is not programmed"
	}
	others := map[string]int{}
	var missing, refused []string
	for _, r := range obs.pods {
		switch {
		case !r.ready:
			missing = append(missing, r.pod+" is not ready")
		case r.err != nil:
			missing = append(missing, r.pod+" did not report: "+r.err.Error())
		case r.refused != "":
			refused = append(refused, "replica "+r.pod+" refused it: "+r.refused)
			if r.revision != "" {
				others[r.revision]++
			}
		case r.revision == obs.revision:
			serving++
		default:
			others[r.revision]++
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d/%d replicas serve revision %s", serving, obs.replicas, obs.revision)
	for _, rev := range slices.Sorted(func(yield func(string) bool) {
		for rev := range others {
			if !yield(rev) {
				return
			}
		}
	}) {
		if rev == "" {
			fmt.Fprintf(&b, "; %d does not serve it yet", others[rev])
		} else {
			fmt.Fprintf(&b, "; %d serves %s", others[rev], rev)
		}
	}
	if len(refused) > 0 {
		slices.Sort(refused)
		fmt.Fprintf(&b, "; %s", refused[0])
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		fmt.Fprintf(&b, "; %s", missing[0])
		if len(missing) > 1 {
			fmt.Fprintf(&b, " (and %d more)", len(missing)-1)
		}
	}
	msg = b.String()
	d := obs.deployment
	rolling := d.Status.ObservedGeneration < d.Generation ||
		d.Status.UpdatedReplicas < obs.replicas || d.Status.Replicas > d.Status.UpdatedReplicas
	switch {
	case len(refused) > 0:
		return serving, false, v1alpha1.ReasonRefused, msg
	case len(others) > 0 || rolling && serving < obs.replicas:
		return serving, false, v1alpha1.ReasonRollingOut, msg
	case serving < obs.replicas || d.Status.AvailableReplicas < obs.replicas:
		return serving, false, v1alpha1.ReasonUnavailable, msg
	case rolling:
		return serving, false, v1alpha1.ReasonRollingOut, msg + "; old replicas are still terminating"
	}
	return serving, true, v1alpha1.ReasonAvailable, msg
}

// degradation tells what weakens enforcement: a missing target, a store that a replica cannot
// use, in that replica's words, or, when no replica reports, a Redis the manager cannot reach.
func degradation(p *v1alpha1.RateLimitPolicy, obs observation) (bool, string, string) {
	if obs.targetMissing && obs.pool != "" {
		return true, v1alpha1.ReasonTargetNotFound, "Service " + p.Spec.TargetRef.Name + " does not exist: the pool limits requests for nothing"
	}
	if obs.targetMissing {
		return true, v1alpha1.ReasonTargetNotFound, "Service " + p.Spec.TargetRef.Name + " does not exist: the enforcer has nothing to forward to"
	}
	if reason, msg := storeDegradation(byName(obs.pods)); reason != "" {
		return true, reason, msg
	}
	if obs.redisUnreachable != "" {
		return true, v1alpha1.ReasonRedisUnreachable, obs.redisUnreachable
	}
	return false, v1alpha1.ReasonAsExpected, ""
}

// byName returns the replicas sorted by pod name, so that what status tells of them is stable.
func byName(pods []replica) []replica {
	pods = slices.Clone(pods)
	slices.SortFunc(pods, func(a, b replica) int { return strings.Compare(a.pod, b.pod) })
	return pods
}

// storeDegradation tells of the first replica whose report says its store does not answer: the
// reason its cause gives, and its words; "" when every reporting replica's store answers.
func storeDegradation(pods []replica) (reason, msg string) {
	for _, r := range pods {
		if r.report == nil || r.report.Store.Connected {
			continue
		}
		reason := v1alpha1.ReasonRedisUnreachable
		switch r.report.Store.Cause {
		case report.CauseAuthentication:
			reason = v1alpha1.ReasonRedisAuthenticationFailed
		case report.CauseTLS:
			reason = v1alpha1.ReasonRedisTLSFailed
		}
		return reason, "replica " + r.pod + ": " + r.report.Store.Message
	}
	return "", ""
}

// maxRuleNames is the length bound of status.ruleNames, its schema's maxLength.
const maxRuleNames = 64

// ruleNames joins the rules' names with commas for kubectl get. Past maxRuleNames, it keeps the
// names that fit beside a "+N more" for the rest, so that the column stays one screen wide.
func ruleNames(rules []v1alpha1.Rule) string {
	names := make([]string, len(rules))
	for i, r := range rules {
		names[i] = r.Name
	}
	if all := strings.Join(names, ","); len(all) <= maxRuleNames {
		return all
	}
	var b strings.Builder
	for i, n := range names {
		more := fmt.Sprintf("+%d more", len(names)-i-1)
		if b.Len()+len(n)+1+len(more) > maxRuleNames {
			return b.String() + fmt.Sprintf("+%d more", len(names)-i)
		}
		b.WriteString(n)
		b.WriteByte(',')
	}
	return strings.TrimSuffix(b.String(), ",") // not reached: the whole list was too long
}

// ruleCounts turns the counts of the last minute into status, in spec order, and the share of
// enforced decisions that refused.
func ruleCounts(p *v1alpha1.RateLimitPolicy, counts map[string]report.Counters) ([]v1alpha1.RuleStatus, string) {
	if len(counts) == 0 {
		return nil, ""
	}
	var out []v1alpha1.RuleStatus
	var decided, limited uint64
	for _, rule := range p.Spec.Rules {
		c, ok := counts[rule.Name]
		if !ok {
			continue
		}
		rs := v1alpha1.RuleStatus{Name: rule.Name, Allowed: int64(c.Allowed), Limited: int64(c.Limited + c.ShadowLimited),
			Failed: int64(c.FailedOpen + c.FailedClosed), Skipped: int64(c.Skipped), Charged: int64(c.Charged)}
		rs.LimitedShare = share(c.Limited+c.ShadowLimited, c.Allowed+c.Limited+c.ShadowLimited)
		if rule.Mode != v1alpha1.ModeShadow {
			decided += c.Allowed + c.Limited
			limited += c.Limited
		}
		out = append(out, rs)
	}
	return out, share(limited, decided)
}

// share formats part/whole as a percentage with one decimal, or "" when whole is 0.
func share(part, whole uint64) string {
	if whole == 0 {
		return ""
	}
	return fmt.Sprintf("%.1f%%", 100*float64(part)/float64(whole))
}

// conditionSetter returns a function that sets a condition of generation gen on conds, True
// when ok: one whose status changes transitions at now, one whose status does not keeps its
// transition time (meta.SetStatusCondition).
func conditionSetter(conds *[]metav1.Condition, gen int64, now time.Time) func(t string, ok bool, reason, msg string) {
	return func(t string, ok bool, reason, msg string) {
		status := metav1.ConditionFalse
		if ok {
			status = metav1.ConditionTrue
		}
		meta.SetStatusCondition(conds, metav1.Condition{Type: t, Status: status, Reason: reason, Message: msg,
			ObservedGeneration: gen, LastTransitionTime: metav1.NewTime(now)})
	}
}
