package controllers

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// Every policy is served by a pool, its home: the EnforcerPool its spec.enforcer.poolRef names,
// or, without one, its own pool of one, whose enforcers also proxy to its target. The policy
// reconciler writes the policy's config where its home reads it and reads what the home's
// replicas report of it; the pool reconciler renders and applies every pool's enforcers, an
// EnforcerPool's and a pool of one's alike. A policy moves between homes make-before-break: its
// new home is programmed, and its old one lets it go (removes its config, and a pool of one its
// enforcers) only once its status says that every replica of the new one serves it.

// Field indexes of the manager's cache.
const (
	// targetIndex indexes policies by the Service they target.
	targetIndex = "spec.targetRef.name"
	// poolRefIndex indexes policies by the "<namespace>/<name>" of the pool they join.
	poolRefIndex = "spec.enforcer.poolRef"
	// podHomeIndex indexes enforcer pods by their pool's key (homeKeyOfPod): finding a pool's
	// pods is a lookup, not a match of every pod of the namespace against a selector.
	podHomeIndex = "sluice.home"
	// configIndex indexes policies' configs, in any pool, by the "<namespace>/<name>" of their
	// policy.
	configIndex = "sluice.config.policy"
)

// oneKeyPrefix begins the name in the pool reconciler's key of a policy's pool of one: the
// policy's namespace and name behind it. No object name holds a slash, so the key of a pool of
// one is never an EnforcerPool's.
const oneKeyPrefix = "RateLimitPolicy/"

// oneKey is the pool reconciler's key of the pool of one of the policy of key p.
func oneKey(p types.NamespacedName) types.NamespacedName {
	return types.NamespacedName{Namespace: p.Namespace, Name: oneKeyPrefix + p.Name}
}

// policyOfOne is the policy whose pool of one key is, if it is one's.
func policyOfOne(key types.NamespacedName) (types.NamespacedName, bool) {
	name, ok := strings.CutPrefix(key.Name, oneKeyPrefix)
	return types.NamespacedName{Namespace: key.Namespace, Name: name}, ok
}

// poolKey is the EnforcerPool a policy joins: its poolRef, in the policy's namespace when it
// names none.
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

// homeKey is the pool reconciler's key of the home a policy's spec names.
func homeKey(p *v1alpha1.RateLimitPolicy) types.NamespacedName {
	if key, ok := poolKey(p); ok {
		return key
	}
	return oneKey(client.ObjectKeyFromObject(p))
}

// homeKeyOf is the pool reconciler's key of the pool an object belongs to: its controller's, a
// pool or a policy (its pool of one), or, for an enforcer pod, its labels'.
func homeKeyOf(o client.Object) (types.NamespacedName, bool) {
	if ref := metav1.GetControllerOfNoCopy(o); ref != nil && ref.APIVersion == v1alpha1.GroupVersion.String() {
		switch ref.Kind {
		case "EnforcerPool":
			return types.NamespacedName{Namespace: o.GetNamespace(), Name: ref.Name}, true
		case "RateLimitPolicy":
			return oneKey(types.NamespacedName{Namespace: o.GetNamespace(), Name: ref.Name}), true
		}
	}
	if name := render.PoolOfPod(o); name != "" {
		return types.NamespacedName{Namespace: o.GetNamespace(), Name: name}, true
	}
	if name := render.PolicyOfPod(o); name != "" {
		return oneKey(types.NamespacedName{Namespace: o.GetNamespace(), Name: name}), true
	}
	return types.NamespacedName{}, false
}

// policyOfConfig is the policy whose config a ConfigMap is, in its pool of one (controlled by
// the policy) or in an EnforcerPool (annotated with it).
func policyOfConfig(o client.Object) (types.NamespacedName, bool) {
	if id, ok := o.GetAnnotations()[report.PolicyAnnotation]; ok && o.GetLabels()[report.PoolLabel] != "" {
		return policyKey(id), true
	}
	if ref := metav1.GetControllerOfNoCopy(o); ref != nil && ref.Kind == "RateLimitPolicy" && ref.APIVersion == v1alpha1.GroupVersion.String() {
		return types.NamespacedName{Namespace: o.GetNamespace(), Name: ref.Name}, true
	}
	return types.NamespacedName{}, false
}

// policyKey is the key of a policy by its ID, "<namespace>/<name>".
func policyKey(id string) types.NamespacedName {
	ns, name, _ := strings.Cut(id, "/")
	return types.NamespacedName{Namespace: ns, Name: name}
}

// home is the pool that serves a policy: its rendering, its key in the pool reconciler, and its
// version: what of the pool its objects are rendered from, the pool's UID and generation, or a
// pool of one's policy's.
type home struct {
	*render.Pool
	key     types.NamespacedName
	version string
}

func poolHome(pool *v1alpha1.EnforcerPool, d render.Defaults) *home {
	return &home{Pool: render.PoolOf(pool, d), key: client.ObjectKeyFromObject(pool), version: fmt.Sprintf("%s/%d", pool.UID, pool.Generation)}
}

func oneHome(p *v1alpha1.RateLimitPolicy, d render.Defaults) *home {
	return &home{Pool: render.OneOf(p, d), key: oneKey(client.ObjectKeyFromObject(p)), version: fmt.Sprintf("%s/%d", p.UID, p.Generation)}
}

// verdict is what judging a policy found: why it may not be served, or its target Service and
// its home.
type verdict struct {
	// invalid is the validation error, if the spec is invalid.
	invalid string
	// conflictsWith names the older policy that targets the same Service.
	conflictsWith string
	// rejection is the reason the pool of spec.enforcer.poolRef does not take the policy
	// (PoolNotFound, NotAllowedByPool), and rejectionMessage says why.
	rejection, rejectionMessage string
	// target is the target Service, nil and targetMissing when it does not exist.
	target        *corev1.Service
	targetMissing bool
	// home serves the policy; nil when it may not be served.
	home *home
}

// judge judges the policy as the webhook does (a policy that bypassed admission is still
// judged), finds no older policy on its target, reads the target Service, and finds its home:
// the pool of its poolRef if it exists and admits the policy's namespace, or its pool of one.
func (r *RateLimitPolicyReconciler) judge(ctx context.Context, p *v1alpha1.RateLimitPolicy) (verdict, error) {
	var v verdict
	if errs := policy.Validate(p); len(errs) > 0 {
		v.invalid = errs.ToAggregate().Error()
		return v, nil
	}
	other, err := r.olderPolicyOnTarget(ctx, p)
	if err != nil || other != "" {
		v.conflictsWith = other
		return v, readFailure(err)
	}
	target := &corev1.Service{}
	switch err := r.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: p.Spec.TargetRef.Name}, target); {
	case apierrors.IsNotFound(err):
		v.targetMissing = true
	case err != nil:
		return v, &failure{errRead, err}
	default:
		v.target = target
	}
	key, pooled := poolKey(p)
	if !pooled {
		v.home = oneHome(p, r.Defaults)
		return v, nil
	}
	pool := &v1alpha1.EnforcerPool{}
	switch err := r.Get(ctx, key, pool); {
	case apierrors.IsNotFound(err):
		v.rejection = v1alpha1.ReasonPoolNotFound
		v.rejectionMessage = fmt.Sprintf("EnforcerPool %s does not exist: spec.enforcer.poolRef names no pool", key)
		return v, nil
	case err != nil:
		return v, &failure{errRead, err}
	}
	admitted, why, err := r.admits(ctx, pool, p.Namespace)
	if err != nil {
		return v, &failure{errRead, err}
	}
	if !admitted {
		v.rejection = v1alpha1.ReasonNotAllowedByPool
		v.rejectionMessage = fmt.Sprintf("EnforcerPool %s does not admit policies of namespace %s: %s", key, p.Namespace, why)
		return v, nil
	}
	v.home = poolHome(pool, r.Defaults)
	return v, nil
}

// readFailure is err as a failure to read, or nil.
func readFailure(err error) error {
	if err == nil {
		return nil
	}
	return &failure{errRead, err}
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

// moved tells whether a policy has left the pool whose ID is id (render.Pool's ID: "" for its
// pool of one) for a home that serves it: its status says it is Ready, at its current
// generation, in the home its spec names. Until then the pool it leaves serves it on.
func moved(p *v1alpha1.RateLimitPolicy, id string) bool {
	to := ""
	if key, ok := poolKey(p); ok {
		to = key.String()
	}
	ready := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
	return to != id && ready != nil && ready.Status == metav1.ConditionTrue && ready.ObservedGeneration == p.Generation &&
		p.Status.ObservedGeneration == p.Generation && p.Status.Enforcer != nil && p.Status.Enforcer.Pool == to
}
