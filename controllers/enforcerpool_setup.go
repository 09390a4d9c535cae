package controllers

import (
	"context"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// indexPools adds the cache indexes of pools: policies by the pool they join, enforcer pods by
// their pool, and pooled policies' ConfigMaps by their policy.
func (r *RateLimitPolicyReconciler) indexPools(ctx context.Context, mgr ctrl.Manager) error {
	idx := mgr.GetFieldIndexer()
	if err := idx.IndexField(ctx, &v1alpha1.RateLimitPolicy{}, poolRefIndex, func(o client.Object) []string {
		if key, ok := poolKey(o.(*v1alpha1.RateLimitPolicy)); ok {
			return []string{key.String()}
		}
		return nil
	}); err != nil {
		return err
	}
	if err := idx.IndexField(ctx, &corev1.Pod{}, podPoolIndex, func(o client.Object) []string {
		if name := render.PoolOfPod(o); name != "" {
			return []string{name}
		}
		return nil
	}); err != nil {
		return err
	}
	return idx.IndexField(ctx, &corev1.ConfigMap{}, poolConfigIndex, func(o client.Object) []string {
		if id, ok := o.GetAnnotations()[report.PolicyAnnotation]; ok && o.GetLabels()[report.PoolLabel] != "" {
			return []string{id}
		}
		return nil
	})
}

// policiesOfPool enqueues the policies that join a pool.
func (r *RateLimitPolicyReconciler) policiesOfPool() handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		var list v1alpha1.RateLimitPolicyList
		if err := r.List(ctx, &list, client.MatchingFields{poolRefIndex: client.ObjectKeyFromObject(o).String()}, client.UnsafeDisableDeepCopy); err != nil {
			return nil
		}
		reqs := make([]reconcile.Request, len(list.Items))
		for i := range list.Items {
			reqs[i] = reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])}
		}
		return reqs
	})
}

// policiesOfPoolObjects enqueues the policies that join the pool of a pool's Deployment or pod:
// whether every replica is ready and done rolling out is part of their readiness, and their
// replicas' reports do not change when it does.
func (r *RateLimitPolicyReconciler) policiesOfPoolObjects() handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		pool := render.PoolOfPod(o)
		if ref := metav1.GetControllerOfNoCopy(o); pool == "" && ref != nil && ref.Kind == "EnforcerPool" && ref.APIVersion == v1alpha1.GroupVersion.String() {
			pool = ref.Name
		}
		if pool == "" {
			return nil
		}
		var list v1alpha1.RateLimitPolicyList
		key := types.NamespacedName{Namespace: o.GetNamespace(), Name: pool}.String()
		if err := r.List(ctx, &list, client.MatchingFields{poolRefIndex: key}, client.UnsafeDisableDeepCopy); err != nil {
			return nil
		}
		reqs := make([]reconcile.Request, len(list.Items))
		for i := range list.Items {
			reqs[i] = reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])}
		}
		return reqs
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

// setupPools registers the pools' controller: it owns the pools' objects, and watches their
// pods, the deletion of policies (whose configs it removes), and the labels of namespaces, by
// which a pool may admit policies.
func (r *RateLimitPolicyReconciler) setupPools(mgr ctrl.Manager) error {
	pr := &poolReconciler{RateLimitPolicyReconciler: r, poolMemory: &poolMemory{}}
	r.mem.poolMemory = pr.poolMemory
	policyGone := handler.TypedFuncs[client.Object, reconcile.Request]{
		DeleteFunc: func(_ context.Context, e event.TypedDeleteEvent[client.Object], q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
			if p, ok := e.Object.(*v1alpha1.RateLimitPolicy); ok {
				if key, ok := poolKey(p); ok {
					q.Add(reconcile.Request{NamespacedName: key})
				}
			}
		},
	}
	selectingPools := handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, _ client.Object) []reconcile.Request {
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
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1alpha1.EnforcerPool{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&appsv1.Deployment{}).
		Owns(&corev1.Service{}).
		Owns(&corev1.Secret{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Owns(&networkingv1.NetworkPolicy{}).
		Owns(&corev1.ServiceAccount{}).
		Owns(&rbacv1.Role{}).
		Owns(&rbacv1.RoleBinding{}).
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if name := render.PoolOfPod(o); name != "" {
				return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: name}}}
			}
			return nil
		})).
		Watches(&v1alpha1.RateLimitPolicy{}, policyGone).
		Watches(&corev1.Namespace{}, selectingPools, builder.WithPredicates(predicate.LabelChangedPredicate{})).
		WatchesRawSource(r.mem.pools.source(true)).
		Complete(pr)
}
