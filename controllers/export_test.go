package controllers

import (
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// PoolReconciler is the pools' reconciler that SetupWithManager registered beside r, with its
// memory, sending its requests through c.
func (r *RateLimitPolicyReconciler) PoolReconciler(c client.Client) reconcile.Reconciler {
	cp := *r
	cp.Client = c
	return &poolReconciler{RateLimitPolicyReconciler: &cp, poolMemory: r.mem.poolMemory}
}

// ProgressHold is how long a new policy's first status waits to say Ready rather than
// Reconciling.
const ProgressHold = progressHold
