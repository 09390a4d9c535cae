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
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
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

// poolReconciler reconciles each EnforcerPool into its enforcers, in the shape of the policy
// reconciler: get, one deferred status write, validate, render and apply, remove the configs of
// policies that are gone, observe. It shares the policy reconciler's settings, its reads of the
// pool's replicas (poolReports) and its manner of applying (applier); SetupWithManager registers
// both.
type poolReconciler struct {
	*RateLimitPolicyReconciler
	*poolMemory
}

// poolMemory is the pool reconciler's state across reconciles, lost on restart.
type poolMemory struct {
	applied appliedCache
	// written is when each pool's status was last written.
	written sync.Map // types.NamespacedName -> time.Time
	// programmed is the generation, defaults and objects of each pool's last full apply.
	programmed sync.Map // types.NamespacedName -> *poolProgrammed
}

// poolProgrammed is what the last full apply of a pool established.
type poolProgrammed struct {
	uid        types.UID
	generation int64
	defaults   render.Defaults
	objects    []objectKey
}

// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=enforcerpools,verbs=get;list;watch
// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=enforcerpools/status,verbs=get;update;patch
// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch

// Reconcile applies the pool's objects, removes the configs of policies that no longer exist or
// that the pool no longer admits, and reports its replicas in status.
func (r *poolReconciler) Reconcile(ctx context.Context, req ctrl.Request) (res ctrl.Result, retErr error) {
	pool := &v1alpha1.EnforcerPool{}
	if err := r.Get(ctx, req.NamespacedName, pool); err != nil {
		if apierrors.IsNotFound(err) {
			r.applied.forget(req.NamespacedName)
			r.written.Delete(req.NamespacedName)
			r.programmed.Delete(req.NamespacedName)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, countFailure(&failure{errRead, err})
	}
	before := pool.DeepCopy()
	var obs poolObservation
	defer func() { res, retErr = r.finishPool(ctx, before, pool, &obs, res, retErr) }()

	if errs := policy.ValidatePool(pool); len(errs) > 0 {
		obs.invalid = errs.ToAggregate().Error()
		return ctrl.Result{}, nil
	}
	if err := r.programPool(ctx, pool); err != nil {
		return ctrl.Result{}, err
	}
	obs.programmed = true
	if err := r.collect(ctx, pool); err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, r.observePool(ctx, pool, &obs)
}

// finishPool classifies a failure as finish does a policy's, and writes the status.
func (r *poolReconciler) finishPool(ctx context.Context, before, pool *v1alpha1.EnforcerPool, obs *poolObservation, res ctrl.Result, err error) (ctrl.Result, error) {
	var f *failure
	if errors.As(err, &f) {
		var inTheWay *notOwnedError
		switch {
		case f.reason == errApply && errors.As(f.err, &inTheWay):
			f.reason, obs.applyErr, obs.stalled = errInTheWay, f.err, true
			res, err = ctrl.Result{RequeueAfter: stalledRecheck}, nil
		case f.reason == errApply && (apierrors.IsInvalid(f.err) || apierrors.IsBadRequest(f.err)):
			f.reason, obs.applyErr, obs.stalled = errRejected, f.err, true
			err = reconcile.TerminalError(f)
		case f.reason == errApply:
			obs.applyErr = f.err
		}
		reconcileErrors.WithLabelValues(f.reason).Inc()
	}
	now := r.clock().Now()
	pool.Status = computePoolStatus(before, *obs, err == nil, now)
	if equality.Semantic.DeepEqual(before.Status, pool.Status) {
		return res, err
	}
	key := client.ObjectKeyFromObject(pool)
	if last, ok := r.written.Load(key); ok && !poolNoticeable(&before.Status, &pool.Status) {
		if wait := last.(time.Time).Add(r.reportInterval()).Sub(now); wait > 0 {
			if res.RequeueAfter == 0 || wait < res.RequeueAfter {
				res.RequeueAfter = wait
			}
			return res, err
		}
	}
	if serr := r.Status().Patch(ctx, pool, client.MergeFrom(before)); serr != nil {
		return res, errors.Join(err, countFailure(&failure{errStatus, client.IgnoreNotFound(serr)}))
	}
	r.written.Store(key, now)
	recordTransitions(r.Recorder, pool, before.Status.Conditions, pool.Status.Conditions)
	return res, err
}

// programPool renders the pool's objects and applies them, unless they are as the last apply
// left them, and deletes what it no longer renders.
func (r *poolReconciler) programPool(ctx context.Context, pool *v1alpha1.EnforcerPool) error {
	key := client.ObjectKeyFromObject(pool)
	if v, ok := r.programmed.Load(key); ok {
		prog := v.(*poolProgrammed)
		if prog.uid == pool.UID && prog.generation == pool.Generation && equality.Semantic.DeepEqual(prog.defaults, r.Defaults) && r.unchanged(ctx, key, prog.objects) {
			return nil
		}
	}
	objs := render.Pool(pool, r.Defaults)
	if err := r.poolRedisPassword(ctx, pool, objs); err != nil {
		return &failure{errApply, err}
	}
	a := &applier{client: r.Client, recorder: r.Recorder, cache: &r.applied, key: key, on: pool,
		programmed: meta.IsStatusConditionTrue(pool.Status.Conditions, v1alpha1.ConditionProgrammed) && pool.Status.ObservedGeneration == pool.Generation}
	var first, second []client.Object
	for _, o := range objs.All() {
		if o == client.Object(objs.Deployment) || o == client.Object(objs.Service) || objs.PDB != nil && o == client.Object(objs.PDB) {
			second = append(second, o)
		} else {
			first = append(first, o)
		}
	}
	if err := a.apply(ctx, first, second); err != nil {
		return &failure{errApply, err}
	}
	name, ns := objs.Deployment.Name, pool.Namespace
	var unwanted []client.Object
	if objs.PDB == nil {
		unwanted = append(unwanted, &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}})
	}
	if objs.NetworkPolicy == nil {
		unwanted = append(unwanted, &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}})
	}
	redis := metav1.ObjectMeta{Namespace: ns, Name: render.RedisName(name)}
	if objs.RedisNetworkPolicy == nil {
		unwanted = append(unwanted, &networkingv1.NetworkPolicy{ObjectMeta: redis})
	}
	if objs.RedisDeployment == nil {
		unwanted = append(unwanted, &appsv1.Deployment{ObjectMeta: redis}, &corev1.Service{ObjectMeta: redis},
			&policyv1.PodDisruptionBudget{ObjectMeta: redis}, &corev1.Secret{ObjectMeta: redis})
	}
	for _, obj := range unwanted {
		if err := deleteOwned(ctx, r.Client, pool.UID, obj); err != nil {
			return &failure{errApply, err}
		}
	}
	prog := &poolProgrammed{uid: pool.UID, generation: pool.Generation, defaults: cloneDefaults(r.Defaults)}
	for _, o := range objs.All() {
		prog.objects = append(prog.objects, keyOf(o))
	}
	r.programmed.Store(key, prog)
	return nil
}

// unchanged tells whether every object is at the resourceVersion the last apply left it at.
func (r *poolReconciler) unchanged(ctx context.Context, key types.NamespacedName, objects []objectKey) bool {
	for _, o := range objects {
		live := newObject(o.kind)
		last, ok := r.applied.get(key, o)
		if live == nil || !ok || r.Get(ctx, client.ObjectKey{Namespace: o.namespace, Name: o.name}, live, client.UnsafeDisableDeepCopy) != nil ||
			live.GetResourceVersion() != last.resourceVersion {
			return false
		}
	}
	return true
}

// poolRedisPassword is redisPassword for a pool's managed Redis.
func (r *poolReconciler) poolRedisPassword(ctx context.Context, pool *v1alpha1.EnforcerPool, objs *render.PoolObjects) error {
	if objs.RedisDeployment == nil {
		return nil
	}
	key := client.ObjectKey{Namespace: pool.Namespace, Name: objs.RedisDeployment.Name}
	live := &corev1.Secret{}
	err := r.Get(ctx, key, live)
	switch {
	case err == nil:
		if owner := metav1.GetControllerOf(live); owner == nil || owner.UID != pool.UID {
			return &notOwnedError{kind: "Secret", name: key.Name, owner: "pool"}
		}
		if password := live.Data[render.RedisPasswordKey]; len(password) > 0 {
			objs.WithRedisPassword(string(password))
			return nil
		}
	case !apierrors.IsNotFound(err):
		return err
	}
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	objs.WithRedisPassword(hex.EncodeToString(secret))
	if err == nil {
		return nil
	}
	if err := r.Create(ctx, objs.RedisSecret.DeepCopy(), client.FieldOwner(FieldOwner)); err != nil {
		if apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("the Secret %s exists but is not one of the managed Redis Secrets the manager knows: created a moment ago, or not the pool's", key.Name)
		}
		return fmt.Errorf("create Secret %s: %w", key.Name, err)
	}
	return nil
}

// collect deletes the configs of the pool's policies that no longer exist (or exist again as
// another policy of the same name), or that the pool no longer admits. A policy that moves to
// another pool removes its config here itself, once its new pool serves it.
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
		key := policyKey(cm.Annotations[report.PolicyAnnotation])
		p := &v1alpha1.RateLimitPolicy{}
		err := r.Get(ctx, key, p, client.UnsafeDisableDeepCopy)
		if err != nil && !apierrors.IsNotFound(err) {
			return &failure{errRead, err}
		}
		why := ""
		switch ok, known := admitted[key.Namespace]; {
		case apierrors.IsNotFound(err) || string(p.UID) != cm.Annotations[render.PolicyUIDAnnotation]:
			why = "its policy no longer exists"
		case known && !ok:
			why = "the pool no longer admits its namespace"
		case !known:
			ok, _, err := r.admits(ctx, pool, key.Namespace)
			if err != nil {
				return &failure{errRead, err}
			}
			if admitted[key.Namespace] = ok; !ok {
				why = "the pool no longer admits its namespace"
			}
		}
		if why == "" {
			continue
		}
		if err := r.Delete(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: cm.Namespace, Name: cm.Name}},
			client.Preconditions{UID: ptr.To(cm.UID)}); err != nil && !apierrors.IsNotFound(err) {
			return &failure{errApply, err}
		}
		logf.FromContext(ctx).Info("Removed a policy's config from the pool", "configMap", klog.KObj(cm), "policy", key, "reason", why)
	}
	return nil
}

// observePool reads the pool's Deployment and what its replicas report.
func (r *poolReconciler) observePool(ctx context.Context, pool *v1alpha1.EnforcerPool, obs *poolObservation) error {
	obs.replicas, obs.image, obs.storage, obs.service = render.PoolReplicas(pool), render.PoolImage(pool, r.Defaults), poolStorageKind(pool), render.PoolName(pool)
	dep := &appsv1.Deployment{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: pool.Namespace, Name: render.PoolName(pool)}, dep, client.UnsafeDisableDeepCopy); err != nil {
		return client.IgnoreNotFound(err)
	}
	obs.deployment = dep
	replicas, err := r.mem.pools.replicas(ctx, pool, "")
	if err != nil {
		return &failure{errRead, err}
	}
	for _, rep := range replicas {
		obs.pods = append(obs.pods, rep.replica)
	}
	return nil
}

// SetupWithManager is not the pool reconciler's own: RateLimitPolicyReconciler.SetupWithManager
// registers it beside the policies' (enforcerpool_setup.go).
var _ reconcile.Reconciler = &poolReconciler{}
