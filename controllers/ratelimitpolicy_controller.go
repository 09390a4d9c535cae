package controllers

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// FieldOwner is the server-side apply field manager of everything the controller writes.
const FieldOwner = "sluice"

// EventDriftCorrected is the reason of the event that says an owned object was put back after a
// hand edit or a deletion.
const EventDriftCorrected = "DriftCorrected"

// targetIndex indexes policies by the Service they target.
const targetIndex = "spec.targetRef.name"

// podPolicyIndex indexes enforcer pods by the name of their policy: finding a policy's pods is a
// lookup, not a match of every pod of the namespace against a selector.
const podPolicyIndex = "sluice.policy"

// RateLimitPolicyReconciler reconciles each RateLimitPolicy into its enforcer.
type RateLimitPolicyReconciler struct {
	client.Client
	Scheme   *runtime.Scheme
	Recorder events.EventRecorder
	Defaults render.Defaults
	// Workers is the number of policies reconciled at once. Default 4.
	Workers int
	// ProbeRedis, when set, checks every ProbeInterval that the Redis of storage.redis answers,
	// and reports Degraded RedisUnreachable when it does not.
	ProbeRedis RedisProbe
	// ProbeInterval is how often a policy's Redis is probed. Default 1 minute.
	ProbeInterval time.Duration
	// Clock stamps the conditions' transitions. Default the real clock.
	Clock clock.PassiveClock
	// FetchReport reads an enforcer pod's report. Default FetchReport over HTTP with a 2s
	// timeout.
	FetchReport ReportFetcher
	// ReportInterval is how often each policy's enforcer reports are read (see reportTicker),
	// and the least time between two status writes that only update counts or messages.
	// Default 10s.
	ReportInterval time.Duration

	// mem is what the reconciler remembers between reconciles; SetupWithManager makes it.
	mem *memory
}

// memory is the reconciler's state across reconciles, lost on restart.
type memory struct {
	history history
	reports reportsSeen
	applied appliedCache
	// programmed is what each policy's last full apply established.
	programmed sync.Map // types.NamespacedName -> *programmed
	// written is when each policy's status was last written.
	written sync.Map // types.NamespacedName -> time.Time
	// progress is when each policy whose first status is held back was first found on its way.
	progress sync.Map // types.NamespacedName -> time.Time
	// pools reads the pools' replicas' reports; poolMemory is the pool reconciler's.
	pools      *poolReports
	poolMemory *poolMemory
}

// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=ratelimitpolicies,verbs=get;list;watch
// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=ratelimitpolicies/status,verbs=get;update;patch
// +kubebuilder:rbac:groups="",resources=configmaps;services,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=serviceaccounts,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=rbac.authorization.k8s.io,resources=roles;rolebindings,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile applies the policy's enforcer objects and reports what it observed in status: get,
// one deferred status write, validate, render and apply, observe. Each step says why it failed
// (a failure); finish counts and classifies it once.
func (r *RateLimitPolicyReconciler) Reconcile(ctx context.Context, req ctrl.Request) (res ctrl.Result, retErr error) {
	p := &v1alpha1.RateLimitPolicy{}
	if err := r.Get(ctx, req.NamespacedName, p); err != nil {
		if apierrors.IsNotFound(err) {
			r.forget(req.NamespacedName)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, countFailure(&failure{errRead, err})
	}
	before := p.DeepCopy()
	var obs observation
	defer func() { res, retErr = r.finish(ctx, before, p, &obs, res, retErr) }()

	target, ok, err := r.validate(ctx, p, &obs)
	if !ok || err != nil {
		return ctrl.Result{}, err // an invalid or conflicting policy waits for a change of its spec
	}
	pool, err := r.pool(ctx, p, &obs)
	if err != nil || obs.poolRejection != "" {
		return ctrl.Result{}, err // and one whose pool does not take it, for a change of either
	}
	var prog *programmed
	if pool != nil {
		prog, err = r.programPooled(ctx, p, pool)
	} else {
		prog, err = r.program(ctx, p, target)
	}
	if err != nil {
		return ctrl.Result{}, err
	}
	obs.programmed, obs.revision, obs.service, obs.replicas = true, prog.revision, prog.service, prog.replicas
	obs.image, obs.storage = prog.image, prog.storage
	if pool != nil {
		obs.pool = pool.Namespace + "/" + pool.Name
		return ctrl.Result{}, r.observePooled(ctx, p, pool, prog, &obs)
	}
	res, err = r.observe(ctx, p, prog, &obs)
	if err != nil {
		return res, err
	}
	// Its own enforcers serve it: the pools it was in, if any, no longer need to.
	if _, ready, _, _ := readiness(obs); ready {
		return res, r.leavePools(ctx, p, types.NamespacedName{})
	}
	return res, nil
}

// forget drops what the manager remembers of a deleted policy.
func (r *RateLimitPolicyReconciler) forget(key types.NamespacedName) {
	r.mem.history.forget(key)
	r.mem.reports.forget(key)
	r.mem.applied.forget(key)
	r.mem.programmed.Delete(key)
	r.mem.written.Delete(key)
	r.mem.progress.Delete(key)
	forgetStatus(key)
}

// failure is why a step of a reconcile failed: the reason label of
// sluice_manager_reconcile_errors_total, and the error.
type failure struct {
	reason string
	err    error
}

func (f *failure) Error() string { return f.err.Error() }
func (f *failure) Unwrap() error { return f.err }

// countFailure counts a failure under its reason and returns it.
func countFailure(f *failure) error {
	reconcileErrors.WithLabelValues(f.reason).Inc()
	return f
}

// finish classifies the reconcile's failure, if any, once: it is counted under its reason; an
// object in the way stalls the policy and is looked at again now and then (no event of ours
// announces its removal); an object the API server refuses as invalid, or a bypass protection
// that cannot be rendered, stalls it until the spec or the manager changes, without retries.
// Then it writes the status, and requeues for the next write it holds back.
func (r *RateLimitPolicyReconciler) finish(ctx context.Context, before, p *v1alpha1.RateLimitPolicy, obs *observation, res ctrl.Result, err error) (ctrl.Result, error) {
	var f *failure
	if errors.As(err, &f) {
		var inTheWay *notOwnedError
		var bypass *bypassError
		var tooLarge *tooLargeError
		switch {
		case f.reason == errApply && errors.As(f.err, &inTheWay):
			f.reason, obs.applyErr, obs.stalled = errInTheWay, f.err, true
			res, err = ctrl.Result{RequeueAfter: stalledRecheck}, nil
		case f.reason == errApply && (apierrors.IsInvalid(f.err) || apierrors.IsBadRequest(f.err)):
			f.reason, obs.applyErr, obs.stalled = errRejected, f.err, true
			err = reconcile.TerminalError(f)
		case f.reason == errApply:
			obs.applyErr = f.err
		case errors.As(f.err, &bypass):
			obs.applyErr, obs.stalled = f.err, true
			err = nil // only a change of the Service or of the spec can fix it, and both are watched
		case errors.As(f.err, &tooLarge):
			obs.applyErr, obs.stalled = f.err, true
			err = nil // only a change of the spec can fix it
		}
		reconcileErrors.WithLabelValues(f.reason).Inc()
	}
	wait, serr := r.writeStatus(ctx, before, p, *obs, err == nil)
	if serr != nil {
		err = errors.Join(err, countFailure(&failure{errStatus, serr}))
	}
	if wait > 0 && (res.RequeueAfter == 0 || wait < res.RequeueAfter) {
		res.RequeueAfter = wait
	}
	return res, err
}

// validate judges the policy as the webhook does (a policy that bypassed admission is still
// judged), finds no older policy on its target, and reads the target Service (nil when missing).
// It reports whether the policy may be programmed.
func (r *RateLimitPolicyReconciler) validate(ctx context.Context, p *v1alpha1.RateLimitPolicy, obs *observation) (*corev1.Service, bool, error) {
	if errs := policy.Validate(p); len(errs) > 0 {
		obs.invalid = errs.ToAggregate().Error()
		return nil, false, nil
	}
	other, err := r.olderPolicyOnTarget(ctx, p)
	if err != nil {
		return nil, false, &failure{errRead, err}
	}
	if other != "" {
		obs.conflictsWith = other
		return nil, false, nil
	}
	target := &corev1.Service{}
	err = r.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: p.Spec.TargetRef.Name}, target)
	if obs.targetMissing = apierrors.IsNotFound(err); obs.targetMissing {
		return nil, true, nil
	}
	if err != nil {
		return nil, false, &failure{errRead, err}
	}
	return target, true, nil
}

// program renders the policy's objects and applies them, unless the objects are as the last
// apply left them (a report-only tick neither renders nor compares them again).
func (r *RateLimitPolicyReconciler) program(ctx context.Context, p *v1alpha1.RateLimitPolicy, target *corev1.Service) (*programmed, error) {
	rendered := withServiceProtocol(p, target)
	if prog := r.current(ctx, rendered, target); prog != nil && prog.pool == "" {
		return prog, nil
	}
	objs, err := render.Enforcer(rendered, r.Defaults)
	if err != nil {
		return nil, &failure{errRender, err}
	}
	if err := r.redisPassword(ctx, p, objs); err != nil {
		return nil, &failure{errApply, err}
	}
	if objs.Bypass, err = render.Bypass(p, target); err != nil {
		return nil, &failure{errRender, &bypassError{err}}
	}
	if err := r.apply(ctx, p, objs); err != nil {
		return nil, &failure{errApply, err}
	}
	return r.remember(rendered, objs, target), nil
}

// bypassError is a bypass protection that cannot be rendered for the target Service.
type bypassError struct{ error }

func (e *bypassError) Unwrap() error { return e.error }

// observe reads what the data plane says: the Deployment, the replicas' reports and, when no
// replica reports, the manager's own probe of Redis.
func (r *RateLimitPolicyReconciler) observe(ctx context.Context, p *v1alpha1.RateLimitPolicy, prog *programmed, obs *observation) (ctrl.Result, error) {
	// The Deployment, the target and the pods are only read, never changed, so they are the
	// cache's own objects rather than deep copies: this runs for every policy on every report tick.
	dep := &appsv1.Deployment{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: prog.deployment}, dep, client.UnsafeDisableDeepCopy); err != nil {
		if apierrors.IsNotFound(err) {
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, &failure{errRead, err}
	}
	obs.deployment = dep
	if err := r.readReports(ctx, p, obs); err != nil {
		return ctrl.Result{}, &failure{errRead, err}
	}
	// The manager's own probe of Redis speaks only when no replica does.
	if !slices.ContainsFunc(obs.pods, func(r replica) bool { return r.report != nil }) {
		var probed bool
		if obs.redisUnreachable, probed = r.probeRedis(ctx, p); probed {
			return ctrl.Result{RequeueAfter: min(r.probeInterval(), r.reportInterval()), Priority: ptr.To(handler.LowPriority)}, nil
		}
	}
	// Replicas report what no event announces: the report ticker reads them on a clock and
	// brings the policy back when what they say changed.
	return ctrl.Result{}, nil
}

func (r *RateLimitPolicyReconciler) reportInterval() time.Duration {
	if r.ReportInterval > 0 {
		return r.ReportInterval
	}
	return 10 * time.Second
}

// reportTimeout bounds the reading of one enforcer's report.
const reportTimeout = 2 * time.Second

// readReports finds the policy's enforcer pods through the API server, reads the report of each
// that runs, at once (or takes the one the report ticker read a moment ago), and records their
// counters.
func (r *RateLimitPolicyReconciler) readReports(ctx context.Context, p *v1alpha1.RateLimitPolicy, obs *observation) error {
	running, err := r.enforcerPods(ctx, p)
	if err != nil {
		return err
	}
	for _, pod := range running {
		obs.pods = append(obs.pods, replica{pod: pod.Name, uid: pod.UID, ready: podReady(pod), err: errNoIP})
	}
	var wg sync.WaitGroup
	for i, pod := range running {
		if pod.Status.PodIP == "" {
			continue
		}
		if read, ok := r.mem.reports.fresh(pod, time.Now()); ok {
			obs.pods[i].report, obs.pods[i].err = read.report, read.err
			continue
		}
		wg.Go(func() {
			read := r.readReport(ctx, pod)
			obs.pods[i].report, obs.pods[i].err = read.report, read.err
		})
	}
	wg.Wait()
	for i := range obs.pods {
		if rep := obs.pods[i].report; rep != nil {
			obs.pods[i].revision = rep.Revision
		}
	}
	reports := map[types.UID]*report.Report{}
	for i, pod := range running {
		reports[pod.UID] = obs.pods[i].report
	}
	id := p.Namespace + "/" + p.Name
	key := client.ObjectKeyFromObject(p)
	obs.counts = r.mem.history.record(key, func(rule report.Rule) (string, bool) {
		return rule.Name, rule.Policy == id
	}, reports, r.clock().Now())
	// Counts of the last minute move on with the clock until the window has passed the last
	// decision: the ticker brings the policy back each interval until then.
	r.mem.reports.setMoving(key, counted(obs.counts))
	return nil
}

// enforcerPods are the policy's enforcer pods that are not terminating nor done, found through
// the cache's index by policy.
func (r *RateLimitPolicyReconciler) enforcerPods(ctx context.Context, p *v1alpha1.RateLimitPolicy) ([]*corev1.Pod, error) {
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(p.Namespace), client.MatchingFields{podPolicyIndex: p.Name}, client.UnsafeDisableDeepCopy); err != nil {
		return nil, err
	}
	var running []*corev1.Pod
	for i := range pods.Items {
		pod := &pods.Items[i]
		// A label value cut and hashed may, however unlikely, be another long name's too.
		if render.PolicyOfPod(pod) != p.Name || pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			continue
		}
		running = append(running, pod)
	}
	return running, nil
}

// reportRead is one read of an enforcer's report: the report or why there is none, and whether
// that differs from the previous read of the pod.
type reportRead struct {
	report  *report.Report
	err     error
	changed bool
}

// readReport reads the report of one enforcer pod, counts the read, and records it for the
// report ticker to compare the next read with.
func (r *RateLimitPolicyReconciler) readReport(ctx context.Context, pod *corev1.Pod) reportRead {
	fetch := r.FetchReport
	if fetch == nil {
		fetch = defaultFetch
	}
	started := time.Now()
	ctx, cancel := context.WithTimeout(ctx, reportTimeout)
	defer cancel()
	rep, err := fetch(ctx, pod)
	reportReads.Inc()
	if err != nil {
		reportFailures.WithLabelValues(reportFailureReason(err)).Inc()
	}
	return reportRead{report: rep, err: err, changed: r.mem.reports.observe(pod, rep, err, started)}
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

// storageKind names where the policy's counters live, for status.
func storageKind(p *v1alpha1.RateLimitPolicy) string {
	switch s := p.Spec.Storage; {
	case s == nil || s.Memory != nil:
		return report.StoreKind(false, "")
	case s.ManagedRedis != nil:
		return "managed-redis"
	case s.Redis != nil:
		return report.StoreKind(true, s.Redis.Mode)
	}
	return report.StoreKind(false, "")
}

func (r *RateLimitPolicyReconciler) clock() clock.PassiveClock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

func (r *RateLimitPolicyReconciler) probeInterval() time.Duration {
	if r.ProbeInterval > 0 {
		return r.ProbeInterval
	}
	return time.Minute
}

// olderPolicyOnTarget returns the name of a policy that claimed the same Service first: created
// earlier, or at the same time with a smaller name.
func (r *RateLimitPolicyReconciler) olderPolicyOnTarget(ctx context.Context, p *v1alpha1.RateLimitPolicy) (string, error) {
	var list v1alpha1.RateLimitPolicyList
	if err := r.List(ctx, &list, client.InNamespace(p.Namespace), client.MatchingFields{targetIndex: p.Spec.TargetRef.Name}); err != nil {
		return "", err
	}
	for _, o := range list.Items {
		if o.UID == p.UID || !o.DeletionTimestamp.IsZero() {
			continue
		}
		t, pt := o.CreationTimestamp, p.CreationTimestamp
		if t.Before(&pt) || t.Equal(&pt) && o.Name < p.Name {
			return o.Name, nil
		}
	}
	return "", nil
}

// writeStatus writes the status when it changed, and records an event for each condition that
// changed status. A change a user acts on (a condition's status or reason, the generation, the
// revision, the replicas serving it) is written at once; one that only moves counts or messages
// waits until ReportInterval has passed since the last write, and writeStatus returns how long
// is left. So a thousand idle policies write nothing, and a busy one once per interval.
func (r *RateLimitPolicyReconciler) writeStatus(ctx context.Context, before, p *v1alpha1.RateLimitPolicy, obs observation, reconciled bool) (time.Duration, error) {
	now := r.clock().Now()
	p.Status = computeStatus(before, obs, reconciled, now)
	exportStatus(client.ObjectKeyFromObject(p), &p.Status)
	if equality.Semantic.DeepEqual(before.Status, p.Status) {
		return 0, nil
	}
	key := client.ObjectKeyFromObject(p)
	if wait := r.holdProgress(key, before, p, now); wait > 0 {
		p.Status = before.Status
		return wait, nil
	}
	if last, ok := r.mem.written.Load(key); ok && !noticeable(&before.Status, &p.Status) {
		if wait := last.(time.Time).Add(r.reportInterval()).Sub(now); wait > 0 {
			p.Status = before.Status
			return wait, nil
		}
	}
	if err := r.Status().Patch(ctx, p, client.MergeFrom(before)); err != nil {
		return 0, client.IgnoreNotFound(err)
	}
	r.mem.written.Store(key, now)
	r.mem.progress.Delete(key)
	recordTransitions(r.Recorder, p, before.Status.Conditions, p.Status.Conditions)
	return 0, nil
}

// progressHold is how long a new policy's first status is held back while it says only that the
// policy is on its way: when its enforcers serve it within that time, one write says Ready where
// two said Reconciling, then Ready (and an event for the change). A pool serves a new policy in
// well under a second, so in a rollout of thousands this halves the policies' status writes,
// the API server's largest cost (docs/benchmarks.md). Until a policy's first status is written
// nothing says it is observed, as before any controller's first reconcile; every later status,
// and a first one that tells of anything else, is written at once.
const progressHold = 2 * time.Second

// holdProgress returns how much longer the status of p is held back, or 0 when it is written
// now: only a policy's first status is held, while it says the policy is accepted, programmed and
// on its way (Reconciling) with nothing wrong, for progressHold from when it was first found so.
func (r *RateLimitPolicyReconciler) holdProgress(key types.NamespacedName, before, p *v1alpha1.RateLimitPolicy, now time.Time) time.Duration {
	st := &p.Status
	onItsWay := before.Status.ObservedGeneration == 0 && len(before.Status.Conditions) == 0 && st.ObservedGeneration == p.Generation &&
		meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionAccepted) &&
		meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionProgrammed) &&
		meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionReconciling) &&
		!meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionStalled) &&
		!meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionDegraded)
	if !onItsWay {
		return 0
	}
	since, _ := r.mem.progress.LoadOrStore(key, now)
	return max(since.(time.Time).Add(progressHold).Sub(now), 0)
}

// recordTransitions records an event on obj, a policy or a pool, for each of Accepted, Ready and
// Degraded whose status changed from before to after, or that is news at first (newsAtFirst):
// a Warning when it tells of a problem.
func recordTransitions(rec events.EventRecorder, obj runtime.Object, before, after []metav1.Condition) {
	if rec == nil {
		return
	}
	for _, t := range []string{v1alpha1.ConditionAccepted, v1alpha1.ConditionReady, v1alpha1.ConditionDegraded} {
		old, cur := meta.FindStatusCondition(before, t), meta.FindStatusCondition(after, t)
		if cur == nil || old != nil && old.Status == cur.Status || old == nil && !newsAtFirst(cur) {
			continue
		}
		kind := corev1.EventTypeNormal
		if (t == v1alpha1.ConditionDegraded) == (cur.Status == metav1.ConditionTrue) {
			kind = corev1.EventTypeWarning
		}
		rec.Eventf(obj, nil, kind, cur.Reason, t, "%s is %s: %s", t, cur.Status, cur.Message)
	}
}

// newsAtFirst tells whether a condition's first status is worth an event: only a problem the
// policy will not outgrow by itself, a policy not accepted or degraded from the start. Every new
// policy is Accepted, not Degraded, and not yet Ready while its enforcer rolls out: telling that
// would be three events, three writes to the API server, for every new policy. Ready is told when
// it turns True.
func newsAtFirst(c *metav1.Condition) bool {
	switch c.Type {
	case v1alpha1.ConditionAccepted:
		return c.Status == metav1.ConditionFalse
	case v1alpha1.ConditionDegraded:
		return c.Status == metav1.ConditionTrue
	}
	return false
}

// noticeable tells whether a status change is one a user or a GitOps tool acts on, rather than
// moved counts or reworded messages.
func noticeable(old, cur *v1alpha1.RateLimitPolicyStatus) bool {
	if old.ObservedGeneration != cur.ObservedGeneration || len(old.Conditions) != len(cur.Conditions) ||
		(old.Enforcer == nil) != (cur.Enforcer == nil) || old.RuleNames != cur.RuleNames {
		return true
	}
	for _, c := range cur.Conditions {
		o := meta.FindStatusCondition(old.Conditions, c.Type)
		if o == nil || o.Status != c.Status || o.Reason != c.Reason || o.ObservedGeneration != c.ObservedGeneration {
			return true
		}
	}
	if old.Enforcer != nil {
		o, c := old.Enforcer, cur.Enforcer
		if o.ConfigRevision != c.ConfigRevision || o.ReadyReplicas != c.ReadyReplicas || o.Replicas != c.Replicas ||
			o.Image != c.Image || o.Storage != c.Storage || o.ServiceName != c.ServiceName || o.Pool != c.Pool {
			return true
		}
	}
	return false
}

// SetupWithManager registers the controller: it owns the enforcer objects and watches Services,
// so that a target that appears or disappears is noticed.
func (r *RateLimitPolicyReconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	r.mem = &memory{}
	r.mem.pools = newPoolReports(r)
	if err := mgr.GetFieldIndexer().IndexField(ctx, &v1alpha1.RateLimitPolicy{}, targetIndex, func(o client.Object) []string {
		return []string{o.(*v1alpha1.RateLimitPolicy).Spec.TargetRef.Name}
	}); err != nil {
		return err
	}
	if err := r.indexPools(ctx, mgr); err != nil {
		return err
	}
	if err := mgr.GetFieldIndexer().IndexField(ctx, &corev1.Pod{}, podPolicyIndex, func(o client.Object) []string {
		if name := render.PolicyOfPod(o); name != "" {
			return []string{name}
		}
		return nil
	}); err != nil {
		return err
	}
	// policiesTargeting enqueues the policies of a namespace that target a Service name.
	policiesTargeting := func(target func(client.Object) string) handler.EventHandler {
		return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			var list v1alpha1.RateLimitPolicyList
			if err := r.List(ctx, &list, client.InNamespace(o.GetNamespace()), client.MatchingFields{targetIndex: target(o)}); err != nil {
				return nil
			}
			reqs := make([]reconcile.Request, len(list.Items))
			for i := range list.Items {
				reqs[i] = reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])}
			}
			return reqs
		})
	}
	if err := ctrl.NewControllerManagedBy(mgr).
		WithOptions(controller.Options{MaxConcurrentReconciles: max(1, r.Workers)}).
		For(&v1alpha1.RateLimitPolicy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&corev1.ConfigMap{}).
		Owns(&corev1.Secret{}).
		Owns(&appsv1.Deployment{}).
		Owns(&corev1.Service{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Owns(&networkingv1.NetworkPolicy{}).
		Owns(&corev1.ServiceAccount{}).
		Owns(&rbacv1.Role{}).
		Owns(&rbacv1.RoleBinding{}).
		// A pod that starts, becomes ready or goes away changes what the policy's status says.
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			name := render.PolicyOfPod(o)
			if name == "" {
				return nil
			}
			return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: name}}}
		})).
		Watches(&corev1.Service{}, policiesTargeting(client.Object.GetName)).
		// A policy that goes away frees its target for the next policy in line.
		// Status writes do not: they would bring every policy of the target back at once.
		Watches(&v1alpha1.RateLimitPolicy{}, policiesTargeting(func(o client.Object) string {
			return o.(*v1alpha1.RateLimitPolicy).Spec.TargetRef.Name
		}), builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		// Replicas report what no event announces.
		WatchesRawSource(reportTicker{r}).
		// A pool that appears, goes or changes, a namespace whose labels a pool selects by, and
		// a pooled policy's config changed by hand bring the policies that join it; its
		// replicas' reports bring the policies whose entry changed.
		Watches(&v1alpha1.EnforcerPool{}, r.policiesOfPool(), builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(&appsv1.Deployment{}, r.policiesOfPoolObjects()).
		Watches(&corev1.Pod{}, r.policiesOfPoolObjects()).
		Watches(&corev1.Namespace{}, r.pooledPoliciesOfNamespace(), builder.WithPredicates(predicate.LabelChangedPredicate{})).
		Watches(&corev1.ConfigMap{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			id, ok := o.GetAnnotations()[report.PolicyAnnotation]
			if !ok || o.GetLabels()[report.PoolLabel] == "" {
				return nil
			}
			return []reconcile.Request{{NamespacedName: policyKey(id)}}
		})).
		WatchesRawSource(r.mem.pools.source(false)).
		Complete(r); err != nil {
		return err
	}
	return r.setupPools(mgr)
}

// CacheByObject narrows what the manager caches: of all pods, only enforcer pods; of all
// Secrets, only the managed Redis's, which the manager generates. It reads no other Secret.
func CacheByObject() map[client.Object]cache.ByObject {
	return map[client.Object]cache.ByObject{
		&corev1.Pod{}:    {Label: labels.SelectorFromSet(labels.Set{render.EnforcerPodLabelKey: render.EnforcerPodLabelValue})},
		&corev1.Secret{}: {Label: labels.SelectorFromSet(render.RedisSecretLabels)},
	}
}

// redisPassword completes the managed Redis of objs with its password: the one its Secret
// holds, or, when there is no Secret yet (or its password was emptied), a new one of 256 random
// bits, in a Secret created here so that no other reconcile generates another. A Secret of that
// name that the policy does not own is never read nor taken over.
func (r *RateLimitPolicyReconciler) redisPassword(ctx context.Context, p *v1alpha1.RateLimitPolicy, objs *render.Objects) error {
	if objs.RedisDeployment == nil {
		return nil
	}
	key := client.ObjectKey{Namespace: p.Namespace, Name: objs.RedisDeployment.Name}
	live := &corev1.Secret{}
	err := r.Get(ctx, key, live)
	switch {
	case err == nil:
		if owner := metav1.GetControllerOf(live); owner == nil || owner.UID != p.UID {
			return &notOwnedError{kind: "Secret", name: key.Name}
		}
		if password := live.Data[render.RedisPasswordKey]; len(password) > 0 {
			objs.WithRedisPassword(string(password))
			return nil
		}
	case !apierrors.IsNotFound(err):
		return err
	}
	secret := make([]byte, 32)
	_, _ = rand.Read(secret) // never fails: crypto/rand crashes the program instead
	objs.WithRedisPassword(hex.EncodeToString(secret))
	if err == nil {
		return nil // the emptied Secret gets the new password applied
	}
	if err := r.Create(ctx, objs.RedisSecret.DeepCopy(), client.FieldOwner(FieldOwner)); err != nil {
		if apierrors.IsAlreadyExists(err) {
			// Created by a reconcile that the cache has not caught up with, or someone else's
			// Secret, which the cache never shows: look again later, never overwrite it.
			return fmt.Errorf("the Secret %s exists but is not one of the managed Redis Secrets the manager knows: created a moment ago, or not the policy's "+
				"(delete or rename it, or rename the policy)", key.Name)
		}
		return fmt.Errorf("create Secret %s: %w", key.Name, err)
	}
	return nil
}

// withServiceProtocol is the policy to render: when its targetRef names no appProtocol, the
// target Service port's appProtocol, as Gateway API implementations read it, if it is one the
// enforcer speaks (kubernetes.io/h2c is h2c; kubernetes.io/ws and wss are http and https).
func withServiceProtocol(p *v1alpha1.RateLimitPolicy, svc *corev1.Service) *v1alpha1.RateLimitPolicy {
	if p.Spec.TargetRef.AppProtocol != "" || svc == nil {
		return p
	}
	for _, port := range svc.Spec.Ports {
		if port.Port != p.Spec.TargetRef.Port || port.AppProtocol == nil {
			continue
		}
		var proto v1alpha1.AppProtocol
		switch strings.ToLower(*port.AppProtocol) {
		case "http", "kubernetes.io/ws":
			proto = v1alpha1.AppProtocolHTTP
		case "https", "kubernetes.io/wss":
			proto = v1alpha1.AppProtocolHTTPS
		case "h2c", "kubernetes.io/h2c":
			proto = v1alpha1.AppProtocolH2C
		default:
			return p // a protocol the enforcer does not speak: http, as without one
		}
		c := p.DeepCopy()
		c.Spec.TargetRef.AppProtocol = proto
		return c
	}
	return p
}
