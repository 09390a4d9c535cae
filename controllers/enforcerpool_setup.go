package controllers

import (
	"context"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
)

// index adds the cache indexes of both controllers: policies by target and by the pool they
// join, enforcer pods by their pool, and policies' configs by their policy.
func (r *RateLimitPolicyReconciler) index(ctx context.Context, idx client.FieldIndexer) error {
	if err := idx.IndexField(ctx, &v1alpha1.RateLimitPolicy{}, targetIndex, func(o client.Object) []string {
		return []string{o.(*v1alpha1.RateLimitPolicy).Spec.TargetRef.Name}
	}); err != nil {
		return err
	}
	if err := idx.IndexField(ctx, &v1alpha1.RateLimitPolicy{}, poolRefIndex, func(o client.Object) []string {
		if key, ok := poolKey(o.(*v1alpha1.RateLimitPolicy)); ok {
			return []string{key.String()}
		}
		return nil
	}); err != nil {
		return err
	}
	if err := idx.IndexField(ctx, &corev1.Pod{}, podHomeIndex, func(o client.Object) []string {
		if key, ok := homeKeyOf(o); ok {
			return []string{key.String()}
		}
		return nil
	}); err != nil {
		return err
	}
	return idx.IndexField(ctx, &corev1.ConfigMap{}, configIndex, func(o client.Object) []string {
		if key, ok := policyOfConfig(o); ok {
			return []string{key.String()}
		}
		return nil
	})
}

// policiesOf are the policies a pool serves: a pool of one's policy, or those that join an
// EnforcerPool.
func (r *RateLimitPolicyReconciler) policiesOf(ctx context.Context, pool types.NamespacedName) map[types.NamespacedName]bool {
	if p, ok := policyOfOne(pool); ok {
		return map[types.NamespacedName]bool{p: true}
	}
	var list v1alpha1.RateLimitPolicyList
	if err := r.List(ctx, &list, client.MatchingFields{poolRefIndex: pool.String()}, client.UnsafeDisableDeepCopy); err != nil {
		return nil
	}
	out := make(map[types.NamespacedName]bool, len(list.Items))
	for i := range list.Items {
		out[client.ObjectKeyFromObject(&list.Items[i])] = true
	}
	return out
}

// requests are reconcile requests of keys.
func requests(keys map[types.NamespacedName]bool) []reconcile.Request {
	reqs := make([]reconcile.Request, 0, len(keys))
	for key := range keys {
		reqs = append(reqs, reconcile.Request{NamespacedName: key})
	}
	return reqs
}

// policiesTargeting enqueues, under key, the policies of a namespace that target a Service name:
// to the policies' controller, the policies (key nil); to the pools', their pools of one.
func (r *RateLimitPolicyReconciler) policiesTargeting(target func(client.Object) string, key func(types.NamespacedName) types.NamespacedName) handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		var list v1alpha1.RateLimitPolicyList
		if err := r.List(ctx, &list, client.InNamespace(o.GetNamespace()), client.MatchingFields{targetIndex: target(o)}, client.UnsafeDisableDeepCopy); err != nil {
			return nil
		}
		reqs := make([]reconcile.Request, len(list.Items))
		for i := range list.Items {
			reqs[i] = reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])}
			if key != nil {
				reqs[i].NamespacedName = key(reqs[i].NamespacedName)
			}
		}
		return reqs
	})
}

// poolsSelectingNamespaces enqueues the pools that admit policies by their namespace's labels.
func (r *RateLimitPolicyReconciler) poolsSelectingNamespaces() handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, _ client.Object) []reconcile.Request {
		var list v1alpha1.EnforcerPoolList
		if err := r.List(ctx, &list, client.UnsafeDisableDeepCopy); err != nil {
			return nil
		}
		var reqs []reconcile.Request
		for i := range list.Items {
			if a := list.Items[i].Spec.AllowedPolicies; a != nil && a.Namespaces != nil && a.Namespaces.From == v1alpha1.NamespacesFromSelector {
				reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
			}
		}
		return reqs
	})
}

// policiesOfPool enqueues the policies that join a pool.
func (r *RateLimitPolicyReconciler) policiesOfPool() handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		return requests(r.policiesOf(ctx, client.ObjectKeyFromObject(o)))
	})
}

// pooledPoliciesOfNamespace enqueues a namespace's policies that join a pool: a pool may admit
// them by the namespace's labels.
func (r *RateLimitPolicyReconciler) pooledPoliciesOfNamespace() handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		var list v1alpha1.RateLimitPolicyList
		if err := r.List(ctx, &list, client.InNamespace(o.GetName()), client.UnsafeDisableDeepCopy); err != nil {
			return nil
		}
		var reqs []reconcile.Request
		for i := range list.Items {
			if _, ok := poolKey(&list.Items[i]); ok {
				reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
			}
		}
		return reqs
	})
}

// policyHomes enqueues the pools a policy concerns: its pool of one, which follows it, and the
// pools that hold a config of its and are not its home (or all when it is gone), which let it go
// once it is served elsewhere. A pool is not brought by every change of each of its policies:
// a pool of ten thousand would look at each of their configs ten thousand times.
func (r *RateLimitPolicyReconciler) policyHomes(gone bool) func(context.Context, client.Object) []reconcile.Request {
	return func(ctx context.Context, o client.Object) []reconcile.Request {
		key := client.ObjectKeyFromObject(o)
		pools := map[types.NamespacedName]bool{oneKey(key): true}
		var cms corev1.ConfigMapList
		if err := r.List(ctx, &cms, client.MatchingFields{configIndex: key.String()}, client.UnsafeDisableDeepCopy); err != nil {
			return requests(pools)
		}
		home := homeKey(o.(*v1alpha1.RateLimitPolicy))
		for i := range cms.Items {
			if pool, ok := homeKeyOf(&cms.Items[i]); ok && (gone || pool != home) {
				pools[pool] = true
			}
		}
		return requests(pools)
	}
}

// servingChanged passes a policy's changes that its pools act on: its spec, and whether it is
// Ready, and where.
var servingChanged = predicate.Funcs{UpdateFunc: func(e event.UpdateEvent) bool {
	old, cur := e.ObjectOld.(*v1alpha1.RateLimitPolicy), e.ObjectNew.(*v1alpha1.RateLimitPolicy)
	pool := func(p *v1alpha1.RateLimitPolicy) string {
		if p.Status.Enforcer == nil {
			return ""
		}
		return p.Status.Enforcer.Pool
	}
	ready := func(p *v1alpha1.RateLimitPolicy) string {
		c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil {
			return ""
		}
		return string(c.Status) + c.Reason
	}
	return old.Generation != cur.Generation || pool(old) != pool(cur) || ready(old) != ready(cur) ||
		old.Status.ObservedGeneration != cur.Status.ObservedGeneration
}}

// setupPools registers the pools' controller. It owns the enforcers' kinds, whether a pool or a
// policy (its pool of one) controls them; it watches its pools' pods, whose reports its status
// tells, the policies, whose pools of one follow them and whose configs it lets go, their
// configs and targets, which shape pools of one, and the labels of namespaces, by which a pool
// may admit policies.
func (r *RateLimitPolicyReconciler) setupPools(mgr ctrl.Manager) error {
	ofPool := handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		if key, ok := homeKeyOf(o); ok {
			return []reconcile.Request{{NamespacedName: key}}
		}
		return nil
	})
	b := ctrl.NewControllerManagedBy(mgr).Named("enforcerpool").
		WithOptions(controller.Options{MaxConcurrentReconciles: max(1, r.Workers)}).
		For(&v1alpha1.EnforcerPool{}, builder.WithPredicates(predicate.GenerationChangedPredicate{}))
	for _, kind := range []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &corev1.Secret{}, &policyv1.PodDisruptionBudget{},
		&networkingv1.NetworkPolicy{}, &corev1.ServiceAccount{}, &rbacv1.Role{}, &rbacv1.RoleBinding{}} {
		b = b.Watches(kind, ofPool)
	}
	return b.
		// An EnforcerPool's pods: its status tells them. A pool of one has none of its own.
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if name := render.PoolOfPod(o); name != "" {
				return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: name}}}
			}
			return nil
		})).
		Watches(&v1alpha1.RateLimitPolicy{}, handler.EnqueueRequestsFromMapFunc(r.policyHomes(false)), builder.WithPredicates(servingChanged)).
		Watches(&v1alpha1.RateLimitPolicy{}, handler.TypedFuncs[client.Object, reconcile.Request]{
			DeleteFunc: func(ctx context.Context, e event.TypedDeleteEvent[client.Object], q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
				for _, req := range r.policyHomes(true)(ctx, e.Object) {
					q.Add(req)
				}
			},
		}).
		// A pool of one's config, written once its policy is accepted, and its target Service.
		Watches(&corev1.ConfigMap{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if key, ok := homeKeyOf(o); ok && metav1.GetControllerOfNoCopy(o).Kind == "RateLimitPolicy" {
				return []reconcile.Request{{NamespacedName: key}}
			}
			return nil
		})).
		Watches(&corev1.Service{}, r.policiesTargeting(client.Object.GetName, oneKey)).
		Watches(&corev1.Namespace{}, r.poolsSelectingNamespaces(), builder.WithPredicates(predicate.LabelChangedPredicate{})).
		WatchesRawSource(r.mem.poolQueue.source()).
		Complete(&poolReconciler{r})
}
