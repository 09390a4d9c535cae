package controllers

import (
	"context"
	"errors"
	"fmt"
	"slices"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// How a policy lives in a pool. Its config is a ConfigMap in the pool's namespace (one per
// policy, render.PoolConfigMap), labelled with the pool for its enforcers to find and controlled
// by the pool; the policy applies it with the same drift correction as its own objects. Its
// status comes from what the pool's replicas say of it, read by poolReports. A policy moves
// between its own enforcer and a pool, or between pools, make-before-break: its new home is
// programmed, and its old one is removed only once every replica of the new one reports serving
// its current revision.

// Field indexes of the pool's objects in the manager's cache.
const (
	// poolRefIndex indexes policies by the "<namespace>/<name>" of the pool they join.
	poolRefIndex = "spec.enforcer.poolRef"
	// podPoolIndex indexes enforcer pods by the name of their pool.
	podPoolIndex = "sluice.pool"
	// poolConfigIndex indexes pooled policies' ConfigMaps by the "<namespace>/<name>" of their
	// policy.
	poolConfigIndex = "sluice.pool.policy"
)

// maxPoolConfigBytes bounds a pooled policy's config: a ConfigMap holds at most 1 MiB, and the
// rest of the object needs a little room.
const maxPoolConfigBytes = 1<<20 - 4<<10

// poolKey is the pool a policy joins: its poolRef, in the policy's namespace when it names none.
func poolKey(p *v1alpha1.RateLimitPolicy) (types.NamespacedName, bool) {
	if p.Spec.Enforcer == nil || p.Spec.Enforcer.PoolRef == nil {
		return types.NamespacedName{}, false
	}
	ref := p.Spec.Enforcer.PoolRef
	ns := ref.Namespace
	if ns == "" {
		ns = p.Namespace
	}
	return types.NamespacedName{Namespace: ns, Name: ref.Name}, true
}

// pool finds the pool a policy joins and whether it admits the policy's namespace. A pool that
// does not exist, or does not admit the policy, leaves it not accepted (obs), and nothing is
// programmed: the policy's current home, if any, keeps serving it.
func (r *RateLimitPolicyReconciler) pool(ctx context.Context, p *v1alpha1.RateLimitPolicy, obs *observation) (*v1alpha1.EnforcerPool, error) {
	key, ok := poolKey(p)
	if !ok {
		return nil, nil
	}
	pool := &v1alpha1.EnforcerPool{}
	switch err := r.Get(ctx, key, pool); {
	case apierrors.IsNotFound(err):
		obs.poolRejection = v1alpha1.ReasonPoolNotFound
		obs.poolMessage = fmt.Sprintf("EnforcerPool %s does not exist: spec.enforcer.poolRef names no pool", key)
		return nil, nil
	case err != nil:
		return nil, &failure{errRead, err}
	}
	admitted, why, err := r.admits(ctx, pool, p.Namespace)
	if err != nil {
		return nil, &failure{errRead, err}
	}
	if !admitted {
		obs.poolRejection = v1alpha1.ReasonNotAllowedByPool
		obs.poolMessage = fmt.Sprintf("EnforcerPool %s does not admit policies of namespace %s: %s", key, p.Namespace, why)
		return nil, nil
	}
	return pool, nil
}

// admits tells whether a pool admits the policies of a namespace, as its allowedPolicies say,
// and if not, why.
func (r *RateLimitPolicyReconciler) admits(ctx context.Context, pool *v1alpha1.EnforcerPool, ns string) (bool, string, error) {
	from, selector := v1alpha1.NamespacesFromSame, (*metav1.LabelSelector)(nil)
	if a := pool.Spec.AllowedPolicies; a != nil && a.Namespaces != nil {
		if a.Namespaces.From != "" {
			from = a.Namespaces.From
		}
		selector = a.Namespaces.Selector
	}
	switch from {
	case v1alpha1.NamespacesFromAll:
		return true, "", nil
	case v1alpha1.NamespacesFromSelector:
		sel, err := metav1.LabelSelectorAsSelector(selector)
		if err != nil {
			return false, "its allowedPolicies.namespaces.selector is invalid: " + err.Error(), nil
		}
		namespace := &corev1.Namespace{}
		if err := r.Get(ctx, client.ObjectKey{Name: ns}, namespace); err != nil {
			return false, "", client.IgnoreNotFound(err)
		}
		if !sel.Matches(labels.Set(namespace.Labels)) {
			return false, "the namespace's labels do not match its allowedPolicies.namespaces.selector " + sel.String(), nil
		}
		return true, "", nil
	}
	if ns != pool.Namespace {
		return false, "it admits its own namespace only (allowedPolicies.namespaces.from Same)", nil
	}
	return true, "", nil
}

// programPooled applies the policy's config into its pool, unless it is as the last apply left
// it.
func (r *RateLimitPolicyReconciler) programPooled(ctx context.Context, p *v1alpha1.RateLimitPolicy, pool *v1alpha1.EnforcerPool) (*programmed, error) {
	if prog := r.current(ctx, p, nil); prog != nil && prog.pool == poolVersion(pool) {
		return prog, nil
	}
	cm, rev, err := render.PoolConfigMap(p, pool)
	if err != nil {
		return nil, &failure{errRender, err}
	}
	if n := len(cm.Data[report.PolicyFileKey]); n > maxPoolConfigBytes {
		return nil, &failure{errRender, &tooLargeError{fmt.Errorf("the policy's config is %d bytes, over the %d a pool's ConfigMap holds: "+
			"split its rules into several policies", n, maxPoolConfigBytes)}}
	}
	if err := r.applier(p).apply(ctx, []client.Object{cm}); err != nil {
		return nil, &failure{errApply, err}
	}
	prog := &programmed{
		uid: p.UID, generation: p.Generation, defaults: cloneDefaults(r.Defaults), appProtocol: p.Spec.TargetRef.AppProtocol,
		revision: rev, service: render.PoolName(pool), image: render.PoolImage(pool, r.Defaults), storage: poolStorageKind(pool),
		deployment: render.PoolName(pool), replicas: render.PoolReplicas(pool), objects: []objectKey{keyOf(cm)},
		pool: poolVersion(pool), poolKey: client.ObjectKeyFromObject(pool),
	}
	r.mem.programmed.Store(client.ObjectKeyFromObject(p), prog)
	return prog, nil
}

// poolVersion identifies what of a pool a pooled policy's programming depends on.
func poolVersion(pool *v1alpha1.EnforcerPool) string {
	return fmt.Sprintf("%s/%d", pool.UID, pool.Generation)
}

// tooLargeError is a policy whose config no ConfigMap can hold: only a change of its spec helps.
type tooLargeError struct{ error }

func (e *tooLargeError) Unwrap() error { return e.error }

// observePooled reads what the pool's replicas say of the policy, and once every one serves its
// current revision, removes its former homes.
func (r *RateLimitPolicyReconciler) observePooled(ctx context.Context, p *v1alpha1.RateLimitPolicy, pool *v1alpha1.EnforcerPool, prog *programmed, obs *observation) error {
	dep := &appsv1.Deployment{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: pool.Namespace, Name: prog.deployment}, dep, client.UnsafeDisableDeepCopy); err != nil {
		if !apierrors.IsNotFound(err) {
			return &failure{errRead, err}
		}
		dep = nil // the pool's controller has not applied it yet
	}
	obs.deployment = dep
	id := p.Namespace + "/" + p.Name
	replicas, err := r.mem.pools.replicas(ctx, pool, id)
	if err != nil {
		return &failure{errRead, err}
	}
	reports := map[types.UID]*report.Report{}
	for _, rep := range replicas {
		if e := rep.entry; e != nil {
			if e.served != nil {
				rep.revision = e.served.Revision
			}
			if e.refused != nil && e.refused.Revision == obs.revision {
				rep.refused = e.refused.Reason
			}
		}
		obs.pods = append(obs.pods, rep.replica)
		if rep.report != nil {
			// The policy's own rules: its counts, as a report of its own would give them.
			var rules []report.Rule
			if rep.entry != nil {
				rules = rep.entry.rules
			}
			reports[rep.uid] = &report.Report{Started: rep.report.Started, Rules: rules}
		} else {
			reports[rep.uid] = nil
		}
	}
	key := client.ObjectKeyFromObject(p)
	obs.counts = r.mem.history.record(key, func(rule report.Rule) (string, bool) { return rule.Name, rule.Policy == id }, reports, r.clock().Now())
	r.mem.reports.setMoving(key, counted(obs.counts))
	if _, ready, _, _ := readiness(*obs); !ready {
		r.mem.pools.wait(client.ObjectKeyFromObject(pool))
		return nil
	}
	cm := render.PoolConfigMapName(pool.Name, p)
	return errors.Join(r.leaveOwn(ctx, p), r.leavePools(ctx, p, types.NamespacedName{Namespace: pool.Namespace, Name: cm}))
}

// poolStorageKind names where a pool's counters live, for status.
func poolStorageKind(pool *v1alpha1.EnforcerPool) string {
	return storageKind(&v1alpha1.RateLimitPolicy{Spec: v1alpha1.RateLimitPolicySpec{Storage: pool.Spec.Storage}})
}

// leaveOwn deletes the objects of the policy's own enforcer, if it had one: the pool serves it.
func (r *RateLimitPolicyReconciler) leaveOwn(ctx context.Context, p *v1alpha1.RateLimitPolicy) error {
	name := render.Name(p)
	redis, bypass := render.RedisName(name), render.BypassName(name)
	on := func(n string) metav1.ObjectMeta { return metav1.ObjectMeta{Namespace: p.Namespace, Name: n} }
	// The Deployment first: its pods stop serving before anything they read goes.
	for _, obj := range []client.Object{
		&appsv1.Deployment{ObjectMeta: on(name)}, &corev1.Service{ObjectMeta: on(name)}, &policyv1.PodDisruptionBudget{ObjectMeta: on(name)},
		&networkingv1.NetworkPolicy{ObjectMeta: on(name)}, &networkingv1.NetworkPolicy{ObjectMeta: on(bypass)}, &corev1.ConfigMap{ObjectMeta: on(name)},
		&rbacv1.RoleBinding{ObjectMeta: on(name)}, &rbacv1.Role{ObjectMeta: on(name)}, &corev1.ServiceAccount{ObjectMeta: on(name)},
		&appsv1.Deployment{ObjectMeta: on(redis)}, &corev1.Service{ObjectMeta: on(redis)}, &policyv1.PodDisruptionBudget{ObjectMeta: on(redis)},
		&corev1.Secret{ObjectMeta: on(redis)}, &networkingv1.NetworkPolicy{ObjectMeta: on(redis)},
	} {
		if err := deleteOwned(ctx, r.Client, p.UID, obj); err != nil {
			return &failure{errApply, fmt.Errorf("remove %T %s of the policy's own enforcer: %w", obj, obj.GetName(), err)}
		}
	}
	return nil
}

// leavePools deletes the policy's configs in the pools it no longer joins: every one but keep.
func (r *RateLimitPolicyReconciler) leavePools(ctx context.Context, p *v1alpha1.RateLimitPolicy, keep types.NamespacedName) error {
	var cms corev1.ConfigMapList
	if err := r.List(ctx, &cms, client.MatchingFields{poolConfigIndex: p.Namespace + "/" + p.Name}, client.UnsafeDisableDeepCopy); err != nil {
		return &failure{errRead, err}
	}
	for i := range cms.Items {
		cm := &cms.Items[i]
		if client.ObjectKeyFromObject(cm) == keep || cm.DeletionTimestamp != nil {
			continue
		}
		err := r.Delete(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: cm.Namespace, Name: cm.Name}}, client.Preconditions{UID: ptr.To(cm.UID)})
		if err != nil && !apierrors.IsNotFound(err) {
			return &failure{errApply, fmt.Errorf("remove the policy's config %s from its former pool: %w", cm.Name, err)}
		}
		logf.FromContext(ctx).Info("Removed the policy's config from a pool it left", "configMap", klog.KObj(cm))
	}
	return nil
}

// poolPods are the pool's enforcer pods that are not terminating nor done.
func (r *RateLimitPolicyReconciler) poolPods(ctx context.Context, pool *v1alpha1.EnforcerPool) ([]*corev1.Pod, error) {
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(pool.Namespace), client.MatchingFields{podPoolIndex: pool.Name}, client.UnsafeDisableDeepCopy); err != nil {
		return nil, err
	}
	var running []*corev1.Pod
	for i := range pods.Items {
		pod := &pods.Items[i]
		if render.PoolOfPod(pod) != pool.Name || pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			continue
		}
		running = append(running, pod)
	}
	slices.SortFunc(running, func(a, b *corev1.Pod) int {
		if a.Name < b.Name {
			return -1
		}
		if a.Name > b.Name {
			return 1
		}
		return 0
	})
	return running, nil
}
