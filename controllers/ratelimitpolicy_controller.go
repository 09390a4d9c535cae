package controllers

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
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
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// FieldOwner is the server-side apply field manager of everything the controllers write.
const FieldOwner = "sluice"

// EventDriftCorrected is the reason of the event that says an owned object was put back after a
// hand edit or a deletion.
const EventDriftCorrected = "DriftCorrected"

// RateLimitPolicyReconciler reconciles each RateLimitPolicy into its config, in the pool that
// serves it, and its status, from what that pool's replicas report; SetupWithManager registers
// the pool reconciler beside it, which runs the pools' enforcers.
type RateLimitPolicyReconciler struct {
	client.Client
	Scheme   *runtime.Scheme
	Recorder events.EventRecorder
	Defaults render.Defaults
	// Workers is the number of policies reconciled at once; at least 1. cmd/manager's --workers
	// sets 16.
	Workers int
	// ProbeRedis, when set, checks every ProbeInterval that the Redis of a pool's storage.redis
	// answers while none of its replicas reports, and reports Degraded RedisUnreachable when it
	// does not.
	ProbeRedis RedisProbe
	// ProbeInterval is how often a policy's Redis is probed. Default 1 minute.
	ProbeInterval time.Duration
	// Clock stamps the conditions' transitions. Default the real clock.
	Clock clock.PassiveClock
	// FetchReport reads an enforcer pod's report. Default FetchReport over HTTP with a 2s
	// timeout.
	FetchReport ReportFetcher
	// ReportInterval is how often each enforcer's report is read (see reports), and the least
	// time between two status writes that only update counts or messages. Default 10s.
	ReportInterval time.Duration

	// mem is what the reconcilers remember between reconciles; SetupWithManager makes it.
	mem *memory
}

// memory is the reconcilers' state across reconciles, lost on restart.
type memory struct {
	history history
	// applied and configured are what each policy's last apply of its config established.
	applied    appliedCache
	configured sync.Map // types.NamespacedName -> *configured
	// written is when each policy's status was last written.
	written sync.Map // types.NamespacedName -> time.Time
	// progress is when each policy whose first status is held back was first found on its way.
	progress sync.Map // types.NamespacedName -> time.Time
	// reports reads the replicas' reports; pools is the pool reconciler's memory.
	reports *reports
	pools   poolMemory
	// policyQueue and poolQueue are the two controllers' queues.
	policyQueue, poolQueue queue
	// uncached reads the API server itself, past the cache.
	uncached client.Reader
}

// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=ratelimitpolicies,verbs=get;list;watch
// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=ratelimitpolicies/status,verbs=get;update;patch
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile writes the policy's config where its pool reads it and reports in status what the
// pool's replicas say of it: get, one deferred status write, validate, compile and apply the
// config, read its pool's reports. Each step says why it failed (a failure); finish counts and
// classifies it once.
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

	var err error
	if obs.verdict, err = r.judge(ctx, p); err != nil || obs.home == nil {
		return ctrl.Result{}, err // an invalid, conflicting or unadmitted policy waits for a change
	}
	err = r.configure(ctx, p, &obs)
	res, oerr := r.observe(ctx, p, &obs)
	return res, errors.Join(err, oerr)
}

// forget drops what the manager remembers of a deleted policy.
func (r *RateLimitPolicyReconciler) forget(key types.NamespacedName) {
	r.mem.history.forget(key)
	r.mem.reports.setMoving(key, false)
	r.mem.applied.forget(key)
	r.mem.configured.Delete(key)
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

// settle classifies a reconcile's failure, if any, once, for a policy and a pool alike: it is
// counted under its reason; an object in the way stalls the owner and is looked at again now and
// then (no event of ours announces its removal); an object the API server refuses as invalid
// stalls it until the spec or the manager changes, without retries; so does a stalledError
// (a bypass protection that cannot be drawn, a config no ConfigMap holds), which only a change
// of the spec or of a watched object can fix. The outcome says what status tells of it.
func settle(res ctrl.Result, err error) (ctrl.Result, outcome, error) {
	var f *failure
	if !errors.As(err, &f) {
		return res, outcome{}, err
	}
	var o outcome
	var inTheWay *notOwnedError
	var stalled *stalledError
	switch {
	case f.reason == errApply && errors.As(f.err, &inTheWay):
		f.reason, o = errInTheWay, outcome{err: f.err, stalled: true}
		res, err = ctrl.Result{RequeueAfter: stalledRecheck}, nil
	case f.reason == errApply && (apierrors.IsInvalid(f.err) || apierrors.IsBadRequest(f.err)):
		f.reason, o = errRejected, outcome{err: f.err, stalled: true}
		err = reconcile.TerminalError(f)
	case f.reason == errApply:
		o.err = f.err
	case errors.As(f.err, &stalled):
		o, err = outcome{err: f.err, stalled: true}, nil
	}
	reconcileErrors.WithLabelValues(f.reason).Inc()
	return res, o, err
}

// requeueBy is res, requeued after wait at the latest.
func requeueBy(res ctrl.Result, wait time.Duration) ctrl.Result {
	if wait > 0 && (res.RequeueAfter == 0 || wait < res.RequeueAfter) {
		res.RequeueAfter = wait
	}
	return res
}

// finish settles the reconcile's failure, takes the failure of its pool's objects that the pool
// reconciler recorded when the policy's own steps had none, writes the status, and requeues for
// the next write it holds back.
func (r *RateLimitPolicyReconciler) finish(ctx context.Context, before, p *v1alpha1.RateLimitPolicy, obs *observation, res ctrl.Result, err error) (ctrl.Result, error) {
	res, o, err := settle(res, err)
	if o.err != nil {
		obs.applyErr, obs.stalled = o.err, o.stalled
	}
	wait, serr := r.writeStatus(ctx, before, p, *obs, err == nil)
	if serr != nil {
		err = errors.Join(err, countFailure(&failure{errStatus, serr}))
	}
	return requeueBy(res, wait), err
}

// maxConfigBytes bounds a policy's config: a ConfigMap holds at most 1 MiB, and the rest of the
// object needs a little room.
const maxConfigBytes = 1<<20 - 4<<10

// configured is what a policy's last apply of its config established: what it was compiled from
// (the policy's UID and generation, its pool's version, its target Service's), its revision, and
// the ConfigMap.
type configured struct {
	version, revision string
	config            objectKey
}

// configure compiles the policy into its config and applies it where its pool reads it, unless
// it is as the last apply left it (a report-only reconcile neither compiles nor compares it).
func (r *RateLimitPolicyReconciler) configure(ctx context.Context, p *v1alpha1.RateLimitPolicy, obs *observation) error {
	key, h := client.ObjectKeyFromObject(p), obs.home
	version := fmt.Sprintf("%s/%d %s", p.UID, p.Generation, h.version)
	if obs.target != nil {
		version += " " + obs.target.ResourceVersion
	}
	if v, ok := r.mem.configured.Load(key); ok {
		if c := v.(*configured); c.version == version && unchanged(ctx, r.Client, &r.mem.applied, key, []objectKey{c.config}) {
			obs.revision, obs.programmed = c.revision, true
			return nil
		}
	}
	cm, rev, err := h.Config(p, obs.target)
	if err != nil {
		return &failure{errRender, err}
	}
	if n := len(cm.Data[report.PolicyFileKey]); n > maxConfigBytes {
		return &failure{errRender, &stalledError{fmt.Errorf("the policy's config is %d bytes, over the %d a ConfigMap holds: "+
			"split its rules into several policies", n, maxConfigBytes)}}
	}
	a := &applier{client: r.Client, uncached: r.mem.uncached, recorder: r.Recorder, cache: &r.mem.applied, key: key, on: p,
		programmed: programmedAt(p.Status.Conditions, p.Status.ObservedGeneration, p.Generation)}
	if err := a.apply(ctx, []client.Object{cm}); err != nil {
		return &failure{errApply, err}
	}
	r.mem.configured.Store(key, &configured{version: version, revision: rev, config: keyOf(cm)})
	obs.revision, obs.programmed = rev, true
	return nil
}

// observe reads what the policy's pool says of it: what the pool reconciler found of its
// objects, its Deployment, what its replicas report of the policy and, when no replica reports,
// the manager's own probe of its Redis. While the pool does not serve the policy yet, its
// replicas are read more often.
func (r *RateLimitPolicyReconciler) observe(ctx context.Context, p *v1alpha1.RateLimitPolicy, obs *observation) (ctrl.Result, error) {
	h := obs.home
	obs.replicas = h.Replicas
	if v, ok := r.mem.pools.outcomes.Load(h.key); ok {
		o := v.(outcome)
		obs.applyErr, obs.stalled, obs.pending = o.err, o.stalled, o.version != h.version
	}
	// The Deployment and the pods are only read, never changed, so they are the cache's own
	// objects rather than deep copies: this runs for every policy on every report it changes.
	dep := &appsv1.Deployment{}
	switch err := r.Get(ctx, client.ObjectKey{Namespace: h.Namespace, Name: h.Name}, dep, client.UnsafeDisableDeepCopy); {
	case err == nil:
		obs.deployment = dep
	case !apierrors.IsNotFound(err):
		return ctrl.Result{}, &failure{errRead, err}
	}
	id := p.Namespace + "/" + p.Name
	pods, err := r.mem.reports.replicas(ctx, h.key, id, obs.revision)
	if err != nil {
		return ctrl.Result{}, &failure{errRead, err}
	}
	obs.pods = pods
	reports := map[types.UID]*report.Report{}
	for _, rep := range pods {
		reports[rep.uid] = nil
		if rep.report != nil {
			// The policy's own rules: its counts, as a report of its own would give them.
			reports[rep.uid] = &report.Report{Started: rep.report.Started, Rules: rep.rules}
		}
	}
	key := client.ObjectKeyFromObject(p)
	obs.counts = r.mem.history.record(key, func(rule report.Rule) (string, bool) { return rule.Name, rule.Policy == id }, reports, r.clock().Now())
	// Counts of the last minute move on with the clock until the window has passed the last
	// decision: the reader brings the policy back at each read until then.
	r.mem.reports.setMoving(key, counted(obs.counts))
	if obs.readiness(obs.policyServes, "").ready {
		return ctrl.Result{}, nil
	}
	r.mem.reports.wait(h.key)
	var res ctrl.Result
	// A pod that waits for its volumes changes nothing the cache sees when the kubelet finds one
	// missing: only its events tell, and they are read again after an interval.
	if slices.ContainsFunc(pods, func(r replica) bool { return r.object != nil && waitsForVolumes(r.object) }) {
		res = ctrl.Result{RequeueAfter: r.reportInterval(), Priority: ptr.To(handler.LowPriority)}
	}
	// The manager's own probe of Redis speaks only when no replica does.
	if slices.ContainsFunc(pods, func(r replica) bool { return r.report != nil }) {
		return res, nil
	}
	var probed bool
	if obs.redisUnreachable, probed = r.probeRedis(ctx, h.Storage); probed {
		return ctrl.Result{RequeueAfter: min(r.probeInterval(), r.reportInterval()), Priority: ptr.To(handler.LowPriority)}, nil
	}
	return res, nil
}

func (r *RateLimitPolicyReconciler) reportInterval() time.Duration {
	if r.ReportInterval > 0 {
		return r.ReportInterval
	}
	return 10 * time.Second
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
			o.Image != c.Image || o.Storage != c.Storage || o.ServiceName != c.ServiceName || o.Pool != c.Pool || o.StoreHealth != c.StoreHealth {
			return true
		}
	}
	return false
}

// SetupWithManager registers the policies' controller and, beside it, the pools'
// (enforcerpool_setup.go), with the cache indexes both use and the reader of reports. The
// policies' controller owns their configs; it watches their targets, pools and namespaces, which
// decide where and whether they are served, and their pools' Deployments and pods, whose
// rollout and readiness are part of theirs.
func (r *RateLimitPolicyReconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	r.mem = &memory{uncached: mgr.GetAPIReader()}
	r.mem.reports = newReports(r)
	r.mem.reports.mounts = newMounts(r.mem.uncached, r.reportInterval())
	if err := r.index(ctx, mgr.GetFieldIndexer()); err != nil {
		return err
	}
	if err := mgr.Add(r.mem.reports); err != nil {
		return err
	}
	policiesOfHome := handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		key, ok := homeKeyOf(o)
		if !ok {
			return nil
		}
		return requests(r.policiesOf(ctx, key))
	})
	err := ctrl.NewControllerManagedBy(mgr).
		WithOptions(controller.Options{MaxConcurrentReconciles: max(1, r.Workers)}).
		For(&v1alpha1.RateLimitPolicy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		// Its config, in its pool of one or an EnforcerPool, edited or deleted by hand.
		Watches(&corev1.ConfigMap{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if key, ok := policyOfConfig(o); ok {
				return []reconcile.Request{{NamespacedName: key}}
			}
			return nil
		})).
		Watches(&corev1.Service{}, r.policiesTargeting(client.Object.GetName, nil)).
		// A policy that goes away frees its target for the next policy in line.
		// Status writes do not: they would bring every policy of the target back at once.
		Watches(&v1alpha1.RateLimitPolicy{}, r.policiesTargeting(func(o client.Object) string {
			return o.(*v1alpha1.RateLimitPolicy).Spec.TargetRef.Name
		}, nil), builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		// A pool that appears, goes or changes, and a namespace whose labels a pool admits by.
		Watches(&v1alpha1.EnforcerPool{}, r.policiesOfPool(), builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(&corev1.Namespace{}, r.pooledPoliciesOfNamespace(), builder.WithPredicates(predicate.LabelChangedPredicate{})).
		Watches(&appsv1.Deployment{}, policiesOfHome).
		Watches(&corev1.Pod{}, policiesOfHome).
		// What no watch announces: replicas' reports, and what the pool reconciler found.
		WatchesRawSource(r.mem.policyQueue.source()).
		Complete(r)
	if err != nil {
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
