package controllers

import (
	"fmt"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/report"
)

// observation is what one reconcile of a policy learned. Status is a pure function of it.
type observation struct {
	verdict
	progress
	// revision is that of the policy's config, once compiled.
	revision string
	// counts are each rule's decisions over the last minute, by rule name.
	counts map[string]report.Counters
	// redisUnreachable says why the Redis of the pool's storage.redis did not answer the
	// manager's probe.
	redisUnreachable string
}

// progress is what a reconcile of a policy or a pool found of its enforcers, in the terms of the
// conditions both have.
type progress struct {
	// applyErr is set when applying an object failed; stalled when no retry can fix it.
	applyErr error
	stalled  bool
	// programmed is true once the owner's objects are applied: a policy's config, a pool's
	// enforcers. pending is true while the pool reconciler has not yet applied a policy's
	// pool's objects as its spec is now.
	programmed, pending bool
	// replicas is the desired number of enforcer pods.
	replicas   int32
	deployment *appsv1.Deployment
	// pods are the enforcer pods that are not terminating, with what each reported.
	pods []replica
}

// replica is one enforcer pod as the manager saw it.
type replica struct {
	pod string
	uid types.UID
	// ready is the pod's Ready condition; object is the pod, whose status says why it is not, and
	// mountFailure the latest of its FailedMount events while it waits for its volumes.
	ready        bool
	object       *corev1.Pod
	mountFailure string
	// report is what the enforcer reported, or err why it could not be read.
	report *report.Report
	err    error
	// revision is the revision of the policy the replica serves ("" when it serves none), and
	// refused why it refused the policy's current revision, if it did; rules are the policy's
	// rules with their counters.
	revision, refused string
	rules             []report.Rule
}

// computeStatus derives the status from an observation made at now. A condition whose status
// changes transitions at now; one whose status does not keeps its transition time.
func computeStatus(p *v1alpha1.RateLimitPolicy, obs observation, reconciled bool, now time.Time) v1alpha1.RateLimitPolicyStatus {
	st := *p.Status.DeepCopy()
	set := conditionSetter(&st.Conditions, p.Generation, now)
	reason, msg := rejection(p, obs.verdict)
	rd := obs.readiness(obs.policyServes, "replicas serve revision "+obs.revision)
	on, why, text := degradation(p, obs)
	st.Reason = setConditions(set, reason, msg, obs.progress, "config revision "+obs.revision+" applied", rd, on, why, text)
	if obs.programmed {
		h := obs.home
		st.Enforcer = &v1alpha1.EnforcerStatus{ServiceName: h.Name, Pool: h.ID, Replicas: h.Replicas, Image: h.Image,
			ConfigRevision: obs.revision, ReadyReplicas: rd.serving, Ready: fmt.Sprintf("%d/%d", rd.serving, h.Replicas),
			Storage: storageKind(h.Storage), StoreHealth: storeHealth(obs.pods, obs.redisUnreachable)}
	}
	st.RuleNames = ruleNames(p.Spec.Rules)
	st.Rules, st.Limited = ruleCounts(p, obs.counts)
	if reconciled {
		st.ObservedGeneration = p.Generation
	}
	return st
}

// rejection is why the policy is not accepted, and its words; "" when it is.
func rejection(p *v1alpha1.RateLimitPolicy, v verdict) (string, string) {
	switch {
	case v.invalid != "":
		return v1alpha1.ReasonInvalid, v.invalid
	case v.conflictsWith != "":
		return v1alpha1.ReasonConflicted, fmt.Sprintf("RateLimitPolicy %s already targets Service %s", v.conflictsWith, p.Spec.TargetRef.Name)
	}
	return v.rejection, v.rejectionMessage
}

// setConditions sets the conditions of a policy or a pool from what its reconcile found: why its
// spec is not accepted (rejection, "" when it is, and its words), its progress, what Programmed
// says it applied, its readiness and whether it is degraded. It returns the reason kubectl's
// REASON column shows: that of the first condition that fails, in the order Accepted,
// Programmed, Ready, Degraded (True); "" when none does.
func setConditions(set func(t string, ok bool, reason, msg string), rejection, msg string, pr progress, applied string,
	rd readiness, degraded bool, why, text string) string {
	accepted := rejection == ""
	switch {
	case !accepted:
		set(v1alpha1.ConditionAccepted, false, rejection, msg)
		set(v1alpha1.ConditionStalled, true, rejection, msg)
	case pr.stalled:
		set(v1alpha1.ConditionAccepted, true, v1alpha1.ReasonAccepted, "the spec is valid")
		set(v1alpha1.ConditionStalled, true, v1alpha1.ReasonApplyFailed, pr.applyErr.Error())
	default:
		set(v1alpha1.ConditionAccepted, true, v1alpha1.ReasonAccepted, "the spec is valid")
		set(v1alpha1.ConditionStalled, false, v1alpha1.ReasonAccepted, "")
	}
	first := rejection
	switch {
	case !accepted:
		set(v1alpha1.ConditionProgrammed, false, v1alpha1.ReasonNotAccepted, "nothing is programmed for what is not accepted")
	case pr.applyErr != nil:
		set(v1alpha1.ConditionProgrammed, false, v1alpha1.ReasonApplyFailed, pr.applyErr.Error())
		first = cmpOr(first, v1alpha1.ReasonApplyFailed)
	case pr.programmed:
		set(v1alpha1.ConditionProgrammed, true, v1alpha1.ReasonProgrammed, applied)
	}
	set(v1alpha1.ConditionReady, rd.ready, rd.reason, rd.message)
	set(v1alpha1.ConditionReconciling, accepted && !pr.stalled && !rd.ready, rd.reason, rd.message)
	if !rd.ready {
		first = cmpOr(first, rd.reason)
	}
	set(v1alpha1.ConditionDegraded, degraded, why, text)
	if degraded {
		first = cmpOr(first, why)
	}
	return first
}

// cmpOr is a, or b when a is "".
func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// readiness is how many replicas serve what they must, and whether that makes their owner Ready:
// every desired replica ready and serving, none serving another revision nor refusing it, and
// the Deployment done rolling out. The reason and message name the first replica that does not
// serve, and why, in its pod's own words where its status has them.
type readiness struct {
	serving         int32
	ready           bool
	reason, message string
}

// service is what one ready, reporting replica does with what it must serve.
type service struct {
	serves bool
	// other is what it serves instead ("" for nothing yet), when it serves something to count
	// among the other revisions; refused is why it refused it; missing why it serves nothing.
	other            string
	counted          bool
	refused, missing string
}

// policyServes is what a replica does with the policy's current revision.
func (obs observation) policyServes(r replica) service {
	switch {
	case r.refused != "":
		return service{refused: "replica " + r.pod + " refused it: " + r.refused, other: r.revision, counted: r.revision != ""}
	case r.revision == obs.revision:
		return service{serves: true}
	}
	return service{other: r.revision, counted: true}
}

// readiness judges the replicas with serves; head follows the count of those that serve in the
// message.
func (pr progress) readiness(serves func(replica) service, head string) readiness {
	if !pr.programmed || pr.deployment == nil {
		return readiness{reason: v1alpha1.ReasonNotProgrammed, message: "the enforcers are not programmed"}
	}
	var rd readiness
	others := map[string]int{}
	var refused, named, missing []string
	var causes []podCause
	for _, r := range byName(pr.pods) {
		var s service
		cause := causeOf(r.object, r.mountFailure)
		switch {
		case cause.reason != "":
			causes, named = append(causes, cause), append(named, cause.text)
		case !r.ready:
			s.missing = cause.or(r.pod + " is not ready")
		case r.err != nil:
			s.missing = r.pod + " did not report: " + r.err.Error()
		default:
			s = serves(r)
		}
		if s.serves {
			rd.serving++
		}
		if s.counted {
			others[s.other]++
		}
		refused, missing = appendNonEmpty(refused, s.refused), appendNonEmpty(missing, s.missing)
	}
	// The pods whose status names their cause are named first.
	rd.message = readinessMessage(fmt.Sprintf("%d/%d %s", rd.serving, pr.replicas, head), others, refused, append(named, missing...))
	d := pr.deployment
	rolling := d.Status.ObservedGeneration < d.Generation || d.Status.UpdatedReplicas < pr.replicas || d.Status.Replicas > d.Status.UpdatedReplicas
	switch {
	case len(refused) > 0:
		rd.reason = v1alpha1.ReasonRefused
	case len(causes) > 0:
		rd.reason = causes[0].reason
	case pr.pending:
		rd.reason, rd.message = v1alpha1.ReasonRollingOut, rd.message+"; the enforcers' objects are being applied"
	case len(others) > 0 || rolling && rd.serving < pr.replicas:
		rd.reason = v1alpha1.ReasonRollingOut
	case rd.serving < pr.replicas || d.Status.AvailableReplicas < pr.replicas:
		rd.reason = v1alpha1.ReasonUnavailable
	case rolling:
		rd.reason, rd.message = v1alpha1.ReasonRollingOut, rd.message+"; old replicas are still terminating"
	default:
		rd.reason, rd.ready = v1alpha1.ReasonAvailable, true
	}
	return rd
}

func appendNonEmpty(list []string, s string) []string {
	if s == "" {
		return list
	}
	return append(list, s)
}

// readinessMessage is head, then how many replicas serve each other revision, the first
// refusal, and the first replica that serves nothing, and how many more.
func readinessMessage(head string, others map[string]int, refused, missing []string) string {
	var b strings.Builder
	b.WriteString(head)
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
		fmt.Fprintf(&b, "; %s", slices.Min(refused))
	}
	if len(missing) > 0 {
		fmt.Fprintf(&b, "; %s", missing[0])
		if len(missing) > 1 {
			fmt.Fprintf(&b, " (and %d more)", len(missing)-1)
		}
	}
	return b.String()
}

// podCause is why a pod does not run ready, as its status says it: the Ready reason that names
// it, and the pod's name with the scheduler's or the kubelet's reason and message.
type podCause struct{ reason, text string }

// or is the cause's text, or otherwise when it has none.
func (c podCause) or(otherwise string) string {
	if c.text == "" {
		return otherwise
	}
	return c.text
}

// waitingReasons are the Ready reasons of the reasons a kubelet gives a container that waits.
var waitingReasons = map[string]string{
	"ErrImagePull":               v1alpha1.ReasonImagePullFailed,
	"ImagePullBackOff":           v1alpha1.ReasonImagePullFailed,
	"InvalidImageName":           v1alpha1.ReasonImagePullFailed,
	"ErrImageNeverPull":          v1alpha1.ReasonImagePullFailed,
	"CreateContainerConfigError": v1alpha1.ReasonContainerConfigError,
	"CreateContainerError":       v1alpha1.ReasonContainerConfigError,
	"CrashLoopBackOff":           v1alpha1.ReasonCrashLooping,
}

// causeOf is why a pod is not ready, read from its status as the scheduler and the kubelet
// write it: the PodScheduled condition False with reason Unschedulable and the scheduler's
// message; a container waiting, with the kubelet's reason and message (an image that cannot be
// pulled, a Secret or ConfigMap its config needs that does not exist, a crash loop, with the
// container's last exit and termination message); or, for a pod that waits for its volumes,
// mountFailure, the kubelet's FailedMount event (a Secret or ConfigMap it mounts that does not
// exist). Nothing for a ready pod, or one whose status says nothing of why (or no pod).
func causeOf(pod *corev1.Pod, mountFailure string) podCause {
	if pod == nil || podReady(pod) {
		return podCause{}
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return podCause{v1alpha1.ReasonUnschedulable, "pod " + pod.Name + ": " + c.Reason + ": " + c.Message}
		}
	}
	for _, s := range slices.Concat(pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses) {
		w := s.State.Waiting
		if w == nil || w.Reason == "" {
			continue
		}
		text := "pod " + pod.Name + ": " + w.Reason
		if w.Message != "" {
			text += ": " + w.Message
		}
		if mountFailure != "" && waitsForVolumes(pod) {
			return podCause{v1alpha1.ReasonContainerConfigError, text + ": " + mountFailure}
		}
		if t := s.LastTerminationState.Terminated; t != nil && w.Reason == "CrashLoopBackOff" {
			text += fmt.Sprintf("; container %s last exited with code %d (%s)", s.Name, t.ExitCode, t.Reason)
			if t.Message != "" {
				text += ": " + t.Message
			}
		}
		return podCause{waitingReasons[w.Reason], text}
	}
	return podCause{}
}

// degradation tells what weakens enforcement: a store that a replica cannot use, in that
// replica's words, or, when no replica reports, a Redis the manager cannot reach; or a missing
// target. A store's failure is told first, whatever else fails.
func degradation(p *v1alpha1.RateLimitPolicy, obs observation) (bool, string, string) {
	missing := ""
	if obs.targetMissing {
		missing = "Service " + p.Spec.TargetRef.Name + " does not exist: the policy's enforcers have no requests to limit"
	}
	reason, msg := storeDegradation(byName(obs.pods))
	if reason == "" && obs.redisUnreachable != "" {
		reason, msg = v1alpha1.ReasonRedisUnreachable, obs.redisUnreachable
	}
	switch {
	case reason != "" && missing != "":
		return true, reason, msg + "; and " + missing
	case reason != "":
		return true, reason, msg
	case missing != "":
		return true, v1alpha1.ReasonTargetNotFound, missing
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
		return storeReason(r.report.Store.Cause), "replica " + r.pod + ": " + r.report.Store.Message
	}
	return "", ""
}

// storeReason is the Degraded reason of a store's failure by its cause.
func storeReason(cause string) string {
	switch cause {
	case report.CauseAuthentication:
		return v1alpha1.ReasonRedisAuthenticationFailed
	case report.CauseTLS:
		return v1alpha1.ReasonRedisTLSFailed
	}
	return v1alpha1.ReasonRedisUnreachable
}

// storeHealth is status.enforcer.storeHealth: Connected when every reporting replica's store
// answers, else the reason of the first that does not; while no replica reports, RedisUnreachable
// when the manager's probe failed, else "".
func storeHealth(pods []replica, probe string) string {
	if reason, _ := storeDegradation(byName(pods)); reason != "" {
		return reason
	}
	if slices.ContainsFunc(pods, func(r replica) bool { return r.report != nil }) {
		return v1alpha1.StoreConnected
	}
	if probe != "" {
		return v1alpha1.ReasonRedisUnreachable
	}
	return ""
}

// storageKind names where a pool's counters live, for status.
func storageKind(s *v1alpha1.Storage) string {
	switch {
	case s == nil || s.Memory != nil:
		return report.StoreKind(false, "")
	case s.ManagedRedis != nil:
		return "managed-redis"
	case s.Redis != nil:
		return report.StoreKind(true, s.Redis.Mode)
	}
	return report.StoreKind(false, "")
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

// maxConditionMessage is the longest message the API server takes in a condition.
const maxConditionMessage = 32768

// conditionSetter returns a function that sets a condition of generation gen on conds, True
// when ok: one whose status changes transitions at now, one whose status does not keeps its
// transition time (meta.SetStatusCondition). A message is cut to what the API server takes: one
// too long would refuse the whole status.
func conditionSetter(conds *[]metav1.Condition, gen int64, now time.Time) func(t string, ok bool, reason, msg string) {
	return func(t string, ok bool, reason, msg string) {
		status := metav1.ConditionFalse
		if ok {
			status = metav1.ConditionTrue
		}
		meta.SetStatusCondition(conds, metav1.Condition{Type: t, Status: status, Reason: reason, Message: cut(msg, maxConditionMessage),
			ObservedGeneration: gen, LastTransitionTime: metav1.NewTime(now)})
	}
}
