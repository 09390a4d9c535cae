package controllers

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// poolReconciler reconciles every pool into its enforcers, and alone applies their kinds: the
// Deployment, Service, budget, identity, NetworkPolicies and managed Redis. Its key is an
// EnforcerPool's, or a policy's pool of one's (oneKey). An EnforcerPool is reconciled in the
// shape of a policy: get, one deferred status write, validate, render and apply, remove the
// configs of the policies it no longer serves, observe. A pool of one follows its policy, its
// config and its target Service: rendered and applied by the same code once its policy is
// accepted and its config written, and removed once its policy has moved to a pool that serves
// it. It has no status of its own: what applying it found goes to its policy's (outcome). It
// shares the policy reconciler's settings, memory and reads of replicas; SetupWithManager
// registers both.
type poolReconciler struct {
	*RateLimitPolicyReconciler
}

// poolMemory is the pool reconciler's state across reconciles, lost on restart.
type poolMemory struct {
	applied appliedCache
	// written is when each EnforcerPool's status was last written.
	written sync.Map // types.NamespacedName -> time.Time
	// programmed is what each pool's last full apply established.
	programmed sync.Map // types.NamespacedName -> *poolProgrammed
	// outcomes is what each pool's last reconcile found of its objects, for its policies.
	outcomes sync.Map // types.NamespacedName -> outcome
}

// poolProgrammed is what the last full apply of a pool established: the version of what it was
// rendered from (the pool's, and a pool of one's target Service's), the defaults, the objects.
type poolProgrammed struct {
	version  string
	defaults render.Defaults
	objects  []objectKey
}

// outcome is what a pool's last reconcile found of its objects, for the status of its policies:
// the version of the pool (home.version) it applied or tried to, and why applying failed, stalled
// when no retry helps.
type outcome struct {
	version string
	err     error
	stalled bool
}

func (o outcome) same(p outcome) bool {
	return o.version == p.version && o.stalled == p.stalled && fmt.Sprint(o.err) == fmt.Sprint(p.err)
}

// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=enforcerpools,verbs=get;list;watch
// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=enforcerpools/status,verbs=get;update;patch
// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=services;serviceaccounts;secrets,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=rbac.authorization.k8s.io,resources=roles;rolebindings,verbs=get;list;watch;create;patch;delete

// Reconcile reconciles the pool of the key: an EnforcerPool, or a policy's pool of one.
func (r *poolReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	if p, ok := policyOfOne(req.NamespacedName); ok {
		return r.reconcileOne(ctx, p)
	}
	return r.reconcilePool(ctx, req.NamespacedName)
}

// reconcilePool applies an EnforcerPool's objects, removes the configs of the policies it no
// longer serves, and reports its replicas in its status.
func (r *poolReconciler) reconcilePool(ctx context.Context, key types.NamespacedName) (res ctrl.Result, retErr error) {
	pool := &v1alpha1.EnforcerPool{}
	if err := r.Get(ctx, key, pool); err != nil {
		if apierrors.IsNotFound(err) {
			r.forgetPool(key)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, countFailure(&failure{errRead, err})
	}
	before := pool.DeepCopy()
	h := poolHome(pool, r.Defaults)
	var obs poolObservation
	defer func() { res, retErr = r.finishPool(ctx, before, pool, h, &obs, res, retErr) }()

	if errs := policy.ValidatePool(pool); len(errs) > 0 {
		obs.invalid = errs.ToAggregate().Error()
		return ctrl.Result{}, nil
	}
	if err := r.program(ctx, h, pool, nil, r.programmedAs(h, programmedAt(pool.Status.Conditions, pool.Status.ObservedGeneration, pool.Generation))); err != nil {
		return ctrl.Result{}, err
	}
	obs.programmed = true
	if err := r.collect(ctx, pool); err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, r.observePool(ctx, h, &obs)
}

// reconcileOne applies the pool of one of the policy of key p while it is the policy's home, and
// removes it once the policy has moved to a pool that serves it. While the policy is not
// accepted, or joins a pool that does not serve it yet, its pool of one stays as it is.
func (r *poolReconciler) reconcileOne(ctx context.Context, key types.NamespacedName) (res ctrl.Result, retErr error) {
	p := &v1alpha1.RateLimitPolicy{}
	if err := r.Get(ctx, key, p); err != nil {
		if apierrors.IsNotFound(err) {
			r.forgetPool(oneKey(key)) // the garbage collector removes its objects
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, countFailure(&failure{errRead, err})
	}
	if moved(p, "") {
		return ctrl.Result{}, countErr(r.leave(ctx, p))
	}
	if _, pooled := poolKey(p); pooled {
		return ctrl.Result{}, nil
	}
	v, err := r.judge(ctx, p)
	if err != nil || v.home == nil {
		return ctrl.Result{}, countErr(err)
	}
	// Its config first: the pods mount it. The policy reconciler writes it once the policy is
	// accepted, and its creation brings the pool back here.
	cm := &corev1.ConfigMap{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: v.home.Name}, cm); err != nil || !metav1.IsControlledBy(cm, p) {
		return ctrl.Result{}, countErr(readFailure(client.IgnoreNotFound(err)))
	}
	defer func() { res, retErr = r.finishOne(ctx, v.home, res, retErr) }()
	// A pool of one has no status of its own to say it was programmed: its policy's Programmed
	// says its config was applied.
	return ctrl.Result{}, r.program(ctx, v.home, p, v.target, r.programmedAs(v.home, false))
}

// programmedAs tells whether a pool's objects are programmed as its version is now: as the
// pool reconciler last recorded, or, before it recorded anything since it started, as the
// pool's status says. Then a difference is drift; otherwise the change of the version.
func (r *poolReconciler) programmedAs(h *home, status bool) bool {
	v, ok := r.mem.pools.outcomes.Load(h.key)
	if !ok {
		return status
	}
	o := v.(outcome)
	return o.version == h.version && o.err == nil
}

// countErr counts a failure, if err is one, and returns err.
func countErr(err error) error {
	var f *failure
	if errors.As(err, &f) {
		return countFailure(f)
	}
	return err
}

// finishPool settles an EnforcerPool's reconcile as finish does a policy's, records its outcome
// for its policies, and writes its status.
func (r *poolReconciler) finishPool(ctx context.Context, before, pool *v1alpha1.EnforcerPool, h *home, obs *poolObservation,
	res ctrl.Result, err error) (ctrl.Result, error) {
	res, o, err := settle(res, err)
	obs.applyErr, obs.stalled = o.err, o.stalled
	if obs.programmed || o.err != nil {
		r.record(ctx, h, o)
	}
	now := r.clock().Now()
	pool.Status = computePoolStatus(before, *obs, err == nil, now)
	if equality.Semantic.DeepEqual(before.Status, pool.Status) {
		return res, err
	}
	key := client.ObjectKeyFromObject(pool)
	if last, ok := r.mem.pools.written.Load(key); ok && !poolNoticeable(&before.Status, &pool.Status) {
		if wait := last.(time.Time).Add(r.reportInterval()).Sub(now); wait > 0 {
			return requeueBy(res, wait), err
		}
	}
	if serr := r.Status().Patch(ctx, pool, client.MergeFrom(before)); serr != nil {
		return res, errors.Join(err, countFailure(&failure{errStatus, client.IgnoreNotFound(serr)}))
	}
	r.mem.pools.written.Store(key, now)
	recordTransitions(r.Recorder, pool, before.Status.Conditions, pool.Status.Conditions)
	return res, err
}

// finishOne settles a pool of one's reconcile and records its outcome for its policy.
func (r *poolReconciler) finishOne(ctx context.Context, h *home, res ctrl.Result, err error) (ctrl.Result, error) {
	res, o, err := settle(res, err)
	r.record(ctx, h, o)
	return res, err
}

// record keeps what a pool's reconcile found of its objects, and brings the policies it serves
// when that changed: their status tells it.
func (r *poolReconciler) record(ctx context.Context, h *home, o outcome) {
	o.version = h.version
	prev, ok := r.mem.pools.outcomes.Swap(h.key, o)
	if ok && prev.(outcome).same(o) {
		return
	}
	r.mem.policyQueue.add(r.policiesOf(ctx, h.key))
}

// forgetPool drops what the manager remembers of a pool that is gone.
func (r *poolReconciler) forgetPool(key types.NamespacedName) {
	r.mem.pools.applied.forget(key)
	r.mem.pools.written.Delete(key)
	r.mem.pools.programmed.Delete(key)
	r.mem.pools.outcomes.Delete(key)
}

// program renders a pool's objects and applies them for owner (the pool, or the policy of a
// pool of one, fronting target), unless they are as the last apply left them, and deletes what
// it no longer renders. programmed says that the owner's spec is already programmed: a
// difference is drift.
func (r *poolReconciler) program(ctx context.Context, h *home, owner client.Object, target *corev1.Service, programmed bool) error {
	version := h.version + "@"
	if target != nil {
		version += target.ResourceVersion
	}
	if v, ok := r.mem.pools.programmed.Load(h.key); ok {
		prog := v.(*poolProgrammed)
		if prog.version == version && equality.Semantic.DeepEqual(prog.defaults, r.Defaults) && unchanged(ctx, r.Client, &r.mem.pools.applied, h.key, prog.objects) {
			return nil
		}
	}
	objs, err := h.Objects(r.Defaults, target)
	if err != nil {
		if errors.Is(err, render.ErrBypassProtection) {
			err = &stalledError{err}
		}
		return &failure{errRender, err}
	}
	if err := r.redisPassword(ctx, owner, objs); err != nil {
		return &failure{errApply, err}
	}
	a := &applier{client: r.Client, uncached: r.mem.uncached, recorder: r.Recorder, cache: &r.mem.pools.applied, key: h.key, on: owner, programmed: programmed}
	w := waves(objs)
	if err := a.apply(ctx, w[:]...); err != nil {
		return &failure{errApply, err}
	}
	for _, obj := range unwanted(objs) {
		if err := deleteOwned(ctx, r.Client, owner.GetUID(), obj); err != nil {
			return &failure{errApply, err}
		}
	}
	prog := &poolProgrammed{version: version, defaults: cloneDefaults(r.Defaults)}
	for _, o := range objs.All() {
		prog.objects = append(prog.objects, keyOf(o))
	}
	r.mem.pools.programmed.Store(h.key, prog)
	return nil
}

// stalledError is a failure only a change of the spec or of the cluster fixes, such as a bypass
// protection that cannot be drawn around the target Service, or a config no ConfigMap holds.
type stalledError struct{ error }

func (e *stalledError) Unwrap() error { return e.error }

// redisPassword completes the managed Redis of objs with its password: the one its Secret
// holds, or, when there is no Secret yet (or its password was emptied), a new one of 256 random
// bits, in a Secret created here so that no other reconcile generates another. A Secret of that
// name that the owner does not control is never read nor taken over.
func (r *poolReconciler) redisPassword(ctx context.Context, owner client.Object, objs *render.PoolObjects) error {
	if objs.RedisDeployment == nil {
		return nil
	}
	key := client.ObjectKey{Namespace: objs.RedisDeployment.Namespace, Name: objs.RedisDeployment.Name}
	kind := ownerKind(metav1.GetControllerOfNoCopy(objs.RedisDeployment))
	live := &corev1.Secret{}
	err := r.Get(ctx, key, live)
	switch {
	case err == nil:
		if ref := metav1.GetControllerOf(live); ref == nil || ref.UID != owner.GetUID() {
			return &notOwnedError{kind: "Secret", name: key.Name, owner: kind}
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
			return fmt.Errorf("the Secret %s exists but is not one of the managed Redis Secrets the manager knows: created a moment ago, or not the %s's "+
				"(delete or rename it, or rename the %s)", key.Name, kind, kind)
		}
		return fmt.Errorf("create Secret %s: %w", key.Name, err)
	}
	return nil
}

// collect deletes the configs of the pool's policies that it no longer serves (see letGo).
func (r *poolReconciler) collect(ctx context.Context, pool *v1alpha1.EnforcerPool) error {
	var cms corev1.ConfigMapList
	if err := r.List(ctx, &cms, client.InNamespace(pool.Namespace), client.MatchingLabels{report.PoolLabel: report.LabelValue(pool.Name)},
		client.UnsafeDisableDeepCopy); err != nil {
		return &failure{errRead, err}
	}
	admitted := map[string]bool{}
	for i := range cms.Items {
		cm := &cms.Items[i]
		if owner := metav1.GetControllerOfNoCopy(cm); owner == nil || owner.UID != pool.UID || cm.DeletionTimestamp != nil {
			continue
		}
		why, err := r.letGo(ctx, pool, cm, admitted)
		if err != nil {
			return &failure{errRead, err}
		}
		if why == "" {
			continue
		}
		if err := r.Delete(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: cm.Namespace, Name: cm.Name}},
			client.Preconditions{UID: ptr.To(cm.UID)}); err != nil && !apierrors.IsNotFound(err) {
			return &failure{errApply, err}
		}
		logf.FromContext(ctx).Info("Removed a policy's config from the pool", "configMap", klog.KObj(cm), "reason", why)
	}
	return nil
}

// letGo tells why the pool no longer serves the policy of a config, or "": the policy no longer
// exists (or exists again as another policy of the same name), has moved to another home that
// serves it, or is of a namespace the pool no longer admits. admitted remembers the namespaces
// asked about.
func (r *poolReconciler) letGo(ctx context.Context, pool *v1alpha1.EnforcerPool, cm *corev1.ConfigMap, admitted map[string]bool) (string, error) {
	key := policyKey(cm.Annotations[report.PolicyAnnotation])
	p := &v1alpha1.RateLimitPolicy{}
	switch err := r.Get(ctx, key, p, client.UnsafeDisableDeepCopy); {
	case apierrors.IsNotFound(err):
		return "its policy no longer exists", nil
	case err != nil:
		return "", err
	case string(p.UID) != cm.Annotations[render.PolicyUIDAnnotation]:
		return "its policy no longer exists", nil
	case moved(p, pool.Namespace+"/"+pool.Name):
		return "its policy moved to a home that serves it", nil
	}
	ok, known := admitted[key.Namespace]
	if !known {
		var err error
		if ok, _, err = r.admits(ctx, pool, key.Namespace); err != nil {
			return "", err
		}
		admitted[key.Namespace] = ok
	}
	if !ok {
		return "the pool no longer admits its namespace", nil
	}
	return "", nil
}

// leave removes a policy's pool of one once the pool it moved to serves it: its enforcers first,
// then its config.
func (r *poolReconciler) leave(ctx context.Context, p *v1alpha1.RateLimitPolicy) error {
	name := render.Name(p)
	for _, obj := range append(poolObjects(p.Namespace, name), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: p.Namespace, Name: name}}) {
		if err := deleteOwned(ctx, r.Client, p.UID, obj); err != nil {
			return &failure{errApply, fmt.Errorf("remove %T %s of the policy's pool of one: %w", obj, obj.GetName(), err)}
		}
	}
	r.forgetPool(oneKey(client.ObjectKeyFromObject(p)))
	return nil
}

// observePool reads the pool's Deployment and what its replicas report.
func (r *poolReconciler) observePool(ctx context.Context, h *home, obs *poolObservation) error {
	obs.replicas, obs.image, obs.storage, obs.service = h.Replicas, h.Image, storageKind(h.Storage), h.Name
	dep := &appsv1.Deployment{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: h.Namespace, Name: h.Name}, dep, client.UnsafeDisableDeepCopy); err != nil {
		return readFailure(client.IgnoreNotFound(err))
	}
	obs.deployment = dep
	pods, err := r.mem.reports.replicas(ctx, h.key, "", "")
	if err != nil {
		return &failure{errRead, err}
	}
	obs.pods = pods
	return nil
}

// SetupWithManager is not the pool reconciler's own: RateLimitPolicyReconciler.SetupWithManager
// registers it beside the policies' (enforcerpool_setup.go).
var _ reconcile.Reconciler = &poolReconciler{}
