package controllers

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers/render"
	"github.com/sluice-dev/sluice/enforcer/policy"
)

// FieldOwner is the server-side apply field manager of everything the controller writes.
const FieldOwner = "sluice"

// EventDriftCorrected is the reason of the event that says an owned object was put back after a
// hand edit or a deletion.
const EventDriftCorrected = "DriftCorrected"

// targetIndex indexes policies by the Service they target.
const targetIndex = "spec.targetRef.name"

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
}

// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=ratelimitpolicies,verbs=get;list;watch
// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=ratelimitpolicies/status,verbs=get;update;patch
// +kubebuilder:rbac:groups="",resources=configmaps;services,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile applies the policy's enforcer objects and reports what it observed in status.
func (r *RateLimitPolicyReconciler) Reconcile(ctx context.Context, req ctrl.Request) (_ ctrl.Result, retErr error) {
	p := &v1alpha1.RateLimitPolicy{}
	if err := r.Get(ctx, req.NamespacedName, p); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	before := p.DeepCopy()
	var obs observation
	defer func() { retErr = errors.Join(retErr, r.writeStatus(ctx, before, p, obs, retErr == nil)) }()

	// The same validation as the webhook: a policy that bypassed admission is still judged.
	if errs := policy.Validate(p); len(errs) > 0 {
		obs.invalid = errs.ToAggregate().Error()
		return ctrl.Result{}, nil // nothing to retry until the spec changes
	}
	other, err := r.olderPolicyOnTarget(ctx, p)
	if err != nil {
		return ctrl.Result{}, err
	}
	if other != "" {
		obs.conflictsWith = other
		return ctrl.Result{}, nil
	}

	objs, err := render.Enforcer(p, r.Defaults)
	if err != nil {
		return ctrl.Result{}, err
	}
	if err := r.apply(ctx, p, objs); err != nil {
		obs.applyErr = err
		var inTheWay *notOwnedError
		switch {
		case errors.As(err, &inTheWay):
			// Final until someone removes the object, which no event of ours announces: look
			// again now and then, without the error backoff.
			obs.stalled = true
			return ctrl.Result{RequeueAfter: stalledRecheck}, nil
		case apierrors.IsInvalid(err) || apierrors.IsBadRequest(err):
			obs.stalled = true // only a change of the spec, or of the manager, can fix it
			return ctrl.Result{}, reconcile.TerminalError(err)
		}
		return ctrl.Result{}, err
	}
	obs.programmed, obs.revision, obs.service, obs.replicas = true, objs.Revision, objs.Service.Name, render.Replicas(p)
	obs.image = objs.Deployment.Spec.Template.Spec.Containers[0].Image

	dep := &appsv1.Deployment{}
	if err := r.Get(ctx, client.ObjectKeyFromObject(objs.Deployment), dep); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	obs.deployment = dep
	target := &corev1.Service{}
	err = r.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: p.Spec.TargetRef.Name}, target)
	obs.targetMissing = apierrors.IsNotFound(err)
	if err := client.IgnoreNotFound(err); err != nil {
		return ctrl.Result{}, err
	}
	// Redis can fail with nothing in the cluster changing: look again on a clock.
	var probed bool
	if obs.redisUnreachable, probed = r.probeRedis(ctx, p); probed {
		return ctrl.Result{RequeueAfter: r.probeInterval()}, nil
	}
	return ctrl.Result{}, nil
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

// apply writes each object with server-side apply under one field owner, unless the live copy
// already holds every field of it: an unchanged policy with untouched objects costs no write, and
// a hand edit of any rendered field, or a deleted object, is put back, with an event that says
// what. Objects no longer rendered (the managed Redis when storage changes, the
// PodDisruptionBudget at one replica) are deleted.
func (r *RateLimitPolicyReconciler) apply(ctx context.Context, p *v1alpha1.RateLimitPolicy, objs *render.Objects) error {
	logger := log.FromContext(ctx)
	// A difference is drift, put back with an event, only when the spec is the one already
	// programmed: after a change of the spec, new and changed objects are simply the change.
	programmed := meta.IsStatusConditionTrue(p.Status.Conditions, v1alpha1.ConditionProgrammed) &&
		p.Status.ObservedGeneration == p.Generation
	for _, obj := range objs.All() {
		u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
		if err != nil {
			return err
		}
		desired := &unstructured.Unstructured{Object: u}
		unstructured.RemoveNestedField(desired.Object, "status")
		unstructured.RemoveNestedField(desired.Object, "metadata", "creationTimestamp")
		unstructured.RemoveNestedField(desired.Object, "spec", "template", "metadata", "creationTimestamp")
		live := obj.DeepCopyObject().(client.Object)
		var drift string
		switch err := r.Get(ctx, client.ObjectKeyFromObject(obj), live); {
		case apierrors.IsNotFound(err):
			if programmed {
				drift = "the object was deleted"
			}
		case err != nil:
			return err
		default:
			if owner := metav1.GetControllerOf(live); owner == nil || owner.UID != p.UID {
				if live.GetDeletionTimestamp() != nil || owner != nil && owner.Kind == "RateLimitPolicy" && owner.Name == p.Name {
					// A policy deleted and created again: garbage collection is about to remove
					// the old one's objects, and their deletion brings us back here.
					return fmt.Errorf("%s %s still belongs to the earlier policy %s, which is being deleted", desired.GetKind(), desired.GetName(), p.Name)
				}
				return &notOwnedError{kind: desired.GetKind(), name: desired.GetName()}
			}
			liveU, err := runtime.DefaultUnstructuredConverter.ToUnstructured(live)
			if err != nil {
				return err
			}
			field, differs := firstDifference(liveU, desired.Object, "")
			if !differs {
				continue
			}
			if programmed {
				drift = field[1:] + " differed from the policy"
			}
		}
		if err := r.Apply(ctx, client.ApplyConfigurationFromUnstructured(desired), client.FieldOwner(FieldOwner), client.ForceOwnership); err != nil {
			return fmt.Errorf("apply %s %s: %w", desired.GetKind(), desired.GetName(), err)
		}
		logger.Info("Applied enforcer object", "kind", desired.GetKind(), "object", klog.KObj(desired), "drift", drift)
		if drift != "" && r.Recorder != nil {
			r.Recorder.Eventf(p, live, corev1.EventTypeWarning, EventDriftCorrected, "Apply",
				"Put back %s %s: %s", desired.GetKind(), desired.GetName(), drift)
		}
	}
	name, ns := objs.Deployment.Name, objs.Deployment.Namespace
	var unwanted []client.Object
	if objs.PDB == nil {
		unwanted = append(unwanted, &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}})
	}
	if objs.RedisDeployment == nil {
		redis := metav1.ObjectMeta{Namespace: ns, Name: render.RedisName(name)}
		unwanted = append(unwanted, &appsv1.Deployment{ObjectMeta: redis}, &corev1.Service{ObjectMeta: redis})
	}
	for _, obj := range unwanted {
		if err := r.deleteOwned(ctx, p, obj); err != nil {
			return err
		}
	}
	return nil
}

// stalledRecheck is how often a policy stalled by an object in its way looks again.
const stalledRecheck = 5 * time.Minute

// notOwnedError says that an object the policy renders exists and belongs to something else.
// The controller never takes such an object over.
type notOwnedError struct{ kind, name string }

func (e *notOwnedError) Error() string {
	return fmt.Sprintf("%s %s exists and is not owned by this policy: delete or rename it, or rename the policy", e.kind, e.name)
}

// deleteOwned deletes obj if it exists and the policy controls it.
func (r *RateLimitPolicyReconciler) deleteOwned(ctx context.Context, p *v1alpha1.RateLimitPolicy, obj client.Object) error {
	if err := r.Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
		return client.IgnoreNotFound(err)
	}
	if owner := metav1.GetControllerOf(obj); owner == nil || owner.UID != p.UID {
		return nil
	}
	if err := r.Delete(ctx, obj, client.Preconditions{UID: ptr.To(obj.GetUID())}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	log.FromContext(ctx).Info("Deleted enforcer object that the policy no longer renders", "object", klog.KObj(obj))
	return nil
}

// firstDifference returns the path of the first field of want that got lacks or holds with
// another value, and whether there is one. Fields that got has beyond want (defaults the API
// server set, status) do not count; lists must match item by item.
func firstDifference(got, want any, path string) (string, bool) {
	switch w := want.(type) {
	case map[string]any:
		g, _ := got.(map[string]any)
		for _, k := range slices.Sorted(maps.Keys(w)) {
			if w[k] == nil {
				continue
			}
			if p, differs := firstDifference(g[k], w[k], path+"."+k); differs {
				return p, true
			}
		}
		return "", false
	case []any:
		g, _ := got.([]any)
		if len(g) != len(w) {
			return path, true
		}
		for i := range w {
			if p, differs := firstDifference(g[i], w[i], fmt.Sprintf("%s[%d]", path, i)); differs {
				return p, true
			}
		}
		return "", false
	default:
		return path, !equality.Semantic.DeepEqual(got, want)
	}
}

// writeStatus writes the status once, and only when it changed, and records an event for each
// condition that changed status.
func (r *RateLimitPolicyReconciler) writeStatus(ctx context.Context, before, p *v1alpha1.RateLimitPolicy, obs observation, reconciled bool) error {
	clk := r.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	p.Status = computeStatus(before, obs, reconciled, clk.Now())
	if equality.Semantic.DeepEqual(before.Status, p.Status) {
		return nil
	}
	if err := r.Status().Patch(ctx, p, client.MergeFrom(before)); err != nil {
		return client.IgnoreNotFound(err)
	}
	for _, t := range []string{v1alpha1.ConditionAccepted, v1alpha1.ConditionReady, v1alpha1.ConditionDegraded} {
		old, now := meta.FindStatusCondition(before.Status.Conditions, t), meta.FindStatusCondition(p.Status.Conditions, t)
		if now == nil || old != nil && old.Status == now.Status {
			continue
		}
		kind := corev1.EventTypeNormal
		if (t == v1alpha1.ConditionDegraded) == (now.Status == "True") {
			kind = corev1.EventTypeWarning
		}
		if r.Recorder != nil {
			r.Recorder.Eventf(p, nil, kind, now.Reason, t, "%s is %s: %s", t, now.Status, now.Message)
		}
	}
	return nil
}

// SetupWithManager registers the controller: it owns the enforcer objects and watches Services,
// so that a target that appears or disappears is noticed.
func (r *RateLimitPolicyReconciler) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	if err := mgr.GetFieldIndexer().IndexField(ctx, &v1alpha1.RateLimitPolicy{}, targetIndex, func(o client.Object) []string {
		return []string{o.(*v1alpha1.RateLimitPolicy).Spec.TargetRef.Name}
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
	return ctrl.NewControllerManagedBy(mgr).
		WithOptions(controller.Options{MaxConcurrentReconciles: max(1, r.Workers)}).
		For(&v1alpha1.RateLimitPolicy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&corev1.ConfigMap{}).
		Owns(&appsv1.Deployment{}).
		Owns(&corev1.Service{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Watches(&corev1.Service{}, policiesTargeting(client.Object.GetName)).
		// A policy that goes away frees its target for the next policy in line.
		Watches(&v1alpha1.RateLimitPolicy{}, policiesTargeting(func(o client.Object) string {
			return o.(*v1alpha1.RateLimitPolicy).Spec.TargetRef.Name
		})).
		Complete(r)
}
