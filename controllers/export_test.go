package controllers

import (
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// PoolReconciler is the pools' reconciler that SetupWithManager registered beside r, with its
// memory, sending its requests through c.
func (r *RateLimitPolicyReconciler) PoolReconciler(c client.Client) reconcile.Reconciler {
	cp := *r
	cp.Client = c
	return &poolReconciler{&cp}
}

// ProgressHold is how long a new policy's first status waits to say Ready rather than
// Reconciling.
const ProgressHold = progressHold

// OneKey is the pool reconciler's key of the pool of one of the policy of key p.
func OneKey(p types.NamespacedName) types.NamespacedName { return oneKey(p) }
