package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/managedfields"
	"k8s.io/client-go/applyconfigurations"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/apiutil"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/structured-merge-diff/v6/fieldpath"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
)

// An applier brings each object an owner renders to what server-side apply of its request
// leaves. An object is applied when its request differs from the one last applied, or when the
// live object does not hold what the request makes it (see applyReason): a changed or removed
// field, a hand edit, a deleted object. Otherwise nothing is sent, and an object whose request and
// resourceVersion are both those of the last look is not even compared again: a report-only
// reconcile costs no apply. A hand edit is put back with an event that says what. Its owner is a
// policy, which applies its config, or a pool, which applies its enforcers; each object's
// controller, as rendered, is the one it must have: a pooled policy's config is the pool's.
type applier struct {
	client client.Client
	// uncached reads the API server itself: the client's cache may not yet hold an object the
	// last apply created, and that is not a deletion.
	uncached client.Reader
	recorder events.EventRecorder
	cache    *appliedCache
	// key names the owner in cache; events about its objects are recorded on on.
	key types.NamespacedName
	on  runtime.Object
	// programmed is that the owner's spec is the one already programmed: a difference is then
	// drift, put back with an event; after a change of the spec, new and changed objects are
	// simply the change.
	programmed bool
}

// programmedAt tells whether the conditions of an object of generation gen say it is programmed
// as it is.
func programmedAt(conds []metav1.Condition, observed, gen int64) bool {
	return meta.IsStatusConditionTrue(conds, v1alpha1.ConditionProgrammed) && observed == gen
}

// apply applies the objects of each wave at once, and wave after wave.
func (a *applier) apply(ctx context.Context, waves ...[]client.Object) error {
	for _, wave := range waves {
		errs := make([]error, len(wave))
		var wg sync.WaitGroup
		for i, obj := range wave {
			wg.Go(func() { errs[i] = a.applyOne(ctx, obj) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return err
		}
	}
	return nil
}

// waves are a pool's objects in the order they are applied, those of a wave at once: first what
// the enforcer pods need to start (their ServiceAccount and its Role, the managed Redis), then the
// Deployment that makes them, its Service and its budget, and the bypass protection, which admits
// the pods the Deployment makes. A pool costs two round trips, not nine.
func waves(objs *render.PoolObjects) [2][]client.Object {
	var w [2][]client.Object
	for _, obj := range objs.All() {
		second := obj == client.Object(objs.Deployment) || obj == client.Object(objs.Service) ||
			objs.PDB != nil && obj == client.Object(objs.PDB) || objs.Bypass != nil && obj == client.Object(objs.Bypass)
		if second {
			w[1] = append(w[1], obj)
		} else {
			w[0] = append(w[0], obj)
		}
	}
	return w
}

// poolObjects are, by name, every object a pool's enforcers may have, in the order they are
// deleted: the Deployment first, so that its pods stop serving before anything they read goes.
func poolObjects(ns, name string) []client.Object {
	on := func(n string) metav1.ObjectMeta { return metav1.ObjectMeta{Namespace: ns, Name: n} }
	redis, bypass := render.RedisName(name), render.BypassName(name)
	return []client.Object{
		&appsv1.Deployment{ObjectMeta: on(name)}, &corev1.Service{ObjectMeta: on(name)}, &policyv1.PodDisruptionBudget{ObjectMeta: on(name)},
		&networkingv1.NetworkPolicy{ObjectMeta: on(name)}, &networkingv1.NetworkPolicy{ObjectMeta: on(bypass)},
		&rbacv1.RoleBinding{ObjectMeta: on(name)}, &rbacv1.Role{ObjectMeta: on(name)}, &corev1.ServiceAccount{ObjectMeta: on(name)},
		&appsv1.Deployment{ObjectMeta: on(redis)}, &corev1.Service{ObjectMeta: on(redis)}, &policyv1.PodDisruptionBudget{ObjectMeta: on(redis)},
		&corev1.Secret{ObjectMeta: on(redis)}, &networkingv1.NetworkPolicy{ObjectMeta: on(redis)},
	}
}

// unwanted are the objects a pool no longer renders, by name: its budget once it runs one
// replica, its NetworkPolicies once they are turned off, its managed Redis once it has another
// store, its bypass protection once it is not asked for. They are deleted if the pool owns them.
func unwanted(objs *render.PoolObjects) []client.Object {
	rendered := map[objectKey]bool{}
	for _, o := range objs.All() {
		rendered[keyOf(o)] = true
	}
	var out []client.Object
	for _, o := range poolObjects(objs.Deployment.Namespace, objs.Deployment.Name) {
		if !rendered[objectKey{kind: kindOf(o), namespace: o.GetNamespace(), name: o.GetName()}] {
			out = append(out, o)
		}
	}
	return out
}

// kindOf is the kind of one of the built-in objects the controllers render.
func kindOf(o client.Object) string {
	gvk, _ := apiutil.GVKForObject(o, clientgoscheme.Scheme)
	return gvk.Kind
}

// cloneDefaults copies d, so that what a reconcile remembers does not move with a later change
// of the reconciler's defaults.
func cloneDefaults(d render.Defaults) render.Defaults {
	if np := d.NetworkPolicy; np != nil {
		c := *np
		c.MonitoringNamespaces = slices.Clone(np.MonitoringNamespaces)
		c.CheckNamespaces = slices.Clone(np.CheckNamespaces)
		c.ProxyNamespaces = slices.Clone(np.ProxyNamespaces)
		d.NetworkPolicy = &c
	}
	return d
}

// unchanged tells whether every object is at the resourceVersion the last apply of the owner
// key left it at. Only the resourceVersion is read: the cache's own object, not a deep copy of it
// (a Deployment's is most of this check's cost, a hundred times a second at 1,000 policies).
func unchanged(ctx context.Context, c client.Reader, cache *appliedCache, key types.NamespacedName, objects []objectKey) bool {
	for _, o := range objects {
		live := newObject(o.kind)
		last, ok := cache.get(key, o)
		if live == nil || !ok || c.Get(ctx, client.ObjectKey{Namespace: o.namespace, Name: o.name}, live, client.UnsafeDisableDeepCopy) != nil ||
			live.GetResourceVersion() != last.resourceVersion {
			return false
		}
	}
	return true
}

// newObject is an empty object of one of the kinds the controller renders.
func newObject(kind string) client.Object {
	switch kind {
	case "ConfigMap":
		return &corev1.ConfigMap{}
	case "Secret":
		return &corev1.Secret{}
	case "ServiceAccount":
		return &corev1.ServiceAccount{}
	case "Role":
		return &rbacv1.Role{}
	case "RoleBinding":
		return &rbacv1.RoleBinding{}
	case "Deployment":
		return &appsv1.Deployment{}
	case "Service":
		return &corev1.Service{}
	case "PodDisruptionBudget":
		return &policyv1.PodDisruptionBudget{}
	case "NetworkPolicy":
		return &networkingv1.NetworkPolicy{}
	}
	return nil
}

// applyOne applies obj when applying would change it (see apply).
func (a *applier) applyOne(ctx context.Context, obj client.Object) error {
	desired, request, err := applyRequest(obj)
	if err != nil {
		return err
	}
	key := keyOf(obj)
	last, seen := a.cache.get(a.key, key)
	live := obj.DeepCopyObject().(client.Object)
	reason, err := a.why(ctx, desired, live, request, last, seen)
	if err != nil || reason == "" {
		return err
	}
	if err := a.client.Apply(ctx, client.ApplyConfigurationFromUnstructured(desired), client.FieldOwner(FieldOwner), client.ForceOwnership); err != nil {
		return fmt.Errorf("apply %s %s: %w", desired.GetKind(), desired.GetName(), err)
	}
	appliesTotal.WithLabelValues(desired.GetKind()).Inc()
	// The answer is the object as applied; its resourceVersion is the one the cache will show.
	a.cache.set(a.key, key, applied{request: request, resourceVersion: desired.GetResourceVersion(), uid: desired.GetUID()})
	drift := ""
	if a.programmed && (!seen || last.request == request) {
		drift = reason
	}
	logf.FromContext(ctx).Info("Applied enforcer object", "kind", desired.GetKind(), "object", klog.KObj(desired), "reason", reason, "drift", drift)
	if drift != "" && a.recorder != nil {
		a.recorder.Eventf(a.on, live, corev1.EventTypeWarning, EventDriftCorrected, "Apply",
			"Put back %s %s: %s", desired.GetKind(), desired.GetName(), drift)
	}
	return nil
}

// created tells whether the API server holds the very object of desired's name that the last
// apply left (its uid), which the cache does not. One deleted and made again by someone else is
// not it: that is applied again, and its owner checked.
func (a *applier) created(ctx context.Context, desired *unstructured.Unstructured, uid types.UID) bool {
	if a.uncached == nil || uid == "" {
		return false
	}
	obj := &metav1.PartialObjectMetadata{}
	obj.SetGroupVersionKind(desired.GroupVersionKind())
	return a.uncached.Get(ctx, client.ObjectKeyFromObject(desired), obj) == nil && obj.UID == uid
}

// why reads the live object into live and says why desired must be applied: it does not exist,
// the rendered request changed, or the live object does not hold what applying it leaves (the
// fields sluice owns and their values); "" when nothing would change. An object that belongs to
// someone else is in the way.
func (a *applier) why(ctx context.Context, desired *unstructured.Unstructured, live client.Object,
	request [sha256.Size]byte, last applied, seen bool) (string, error) {
	switch err := a.client.Get(ctx, client.ObjectKeyFromObject(desired), live); {
	case apierrors.IsNotFound(err) && desired.GetKind() == "Secret":
		// The managed Redis's Secret is created by the reconcile that generates its password
		// (redisPassword), never brought back by an apply: a reconcile that read it before it was
		// deleted would bring back the old password that the deletion was to replace.
		return "", nil
	case apierrors.IsNotFound(err) && seen && a.created(ctx, desired, last.uid):
		// The cache has not caught up with what the last apply created (a second reconcile of
		// the same second finds this): nothing was deleted.
		if last.request != request {
			return "the rendered request changed", nil
		}
		return "", nil
	case apierrors.IsNotFound(err):
		if !a.programmed {
			return "the object does not exist", nil
		}
		return "the object was deleted", nil
	case err != nil:
		return "", err
	}
	want := metav1.GetControllerOfNoCopy(desired)
	if owner := metav1.GetControllerOf(live); owner == nil || want == nil || owner.UID != want.UID {
		if live.GetDeletionTimestamp() != nil || owner != nil && want != nil && owner.Kind == want.Kind && owner.Name == want.Name {
			// An owner deleted and created again: garbage collection is about to remove the old
			// one's objects, and their deletion brings us back here.
			return "", fmt.Errorf("%s %s still belongs to the earlier %s %s, which is being deleted", desired.GetKind(), desired.GetName(), want.Kind, want.Name)
		}
		return "", &notOwnedError{kind: desired.GetKind(), name: desired.GetName(), owner: ownerKind(want)}
	}
	if seen && last.request == request && last.resourceVersion == live.GetResourceVersion() {
		return "", nil // nothing changed on either side since the last look
	}
	if seen && last.request != request {
		return "the rendered request changed", nil
	}
	reason, err := applyReason(desired, live)
	if err == nil && reason == "" {
		a.cache.set(a.key, objectKey{kind: desired.GetKind(), namespace: desired.GetNamespace(), name: desired.GetName()},
			applied{request: request, resourceVersion: live.GetResourceVersion(), uid: live.GetUID()})
	}
	return reason, err
}

// applyRequest is the apply request of a rendered object, as unstructured, and its digest.
func applyRequest(obj client.Object) (*unstructured.Unstructured, [sha256.Size]byte, error) {
	u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, [sha256.Size]byte{}, err
	}
	desired := &unstructured.Unstructured{Object: u}
	unstructured.RemoveNestedField(desired.Object, "status")
	unstructured.RemoveNestedField(desired.Object, "metadata", "creationTimestamp")
	unstructured.RemoveNestedField(desired.Object, "spec", "template", "metadata", "creationTimestamp")
	data, err := json.Marshal(desired.Object) // map keys sorted: the same request, the same bytes
	if err != nil {
		return nil, [sha256.Size]byte{}, err
	}
	return desired, sha256.Sum256(data), nil
}

// applyReason tells why applying want would change live, or "" when it would not. Server-side
// apply makes FieldOwner own exactly the fields of the request, at the request's values: so live
// is current when the fields FieldOwner owns are exactly those of want (none missing: taken by
// another manager's edit, or added to the rendering; none extra: removed from the rendering,
// which applying deletes) and every value of want is live's. Fields others own beyond want,
// such as defaults and status, do not count.
func applyReason(want *unstructured.Unstructured, live client.Object) (string, error) {
	tv, err := typeConverter().ObjectToTyped(want)
	if err != nil {
		return "", fmt.Errorf("type %s %s: %w", want.GetKind(), want.GetName(), err)
	}
	wantSet, err := tv.ToFieldSet()
	if err != nil {
		return "", fmt.Errorf("fields of %s %s: %w", want.GetKind(), want.GetName(), err)
	}
	wantSet = wantSet.Difference(strippedFields)
	owned, err := ownedFields(live.GetManagedFields(), FieldOwner)
	if err != nil {
		return "", err
	}
	if owned == nil {
		return "it has no fields applied by " + FieldOwner, nil
	}
	if extra := owned.Difference(wantSet).Leaves(); !extra.Empty() {
		return firstPath(extra) + " is no longer rendered", nil
	}
	if missing := wantSet.Difference(owned).Leaves(); !missing.Empty() {
		path := firstPath(missing)
		for _, m := range live.GetManagedFields() {
			if set, err := ownedFields([]metav1.ManagedFieldsEntry{m}, m.Manager); err == nil && set != nil && set.Has(pathOf(missing)) {
				return path + " was set by " + m.Manager, nil
			}
		}
		return path + " is not applied", nil
	}
	liveU, err := runtime.DefaultUnstructuredConverter.ToUnstructured(live)
	if err != nil {
		return "", err
	}
	if field, differs := firstDifference(liveU, want.Object, ""); differs {
		return field[1:] + " differed from the policy", nil
	}
	return "", nil
}

// strippedFields are the fields the API server leaves out of managed fields.
var strippedFields = fieldpath.NewSet(
	fieldpath.MakePathOrDie("apiVersion"),
	fieldpath.MakePathOrDie("kind"),
	fieldpath.MakePathOrDie("metadata"),
	fieldpath.MakePathOrDie("metadata", "name"),
	fieldpath.MakePathOrDie("metadata", "namespace"),
	fieldpath.MakePathOrDie("metadata", "creationTimestamp"),
	fieldpath.MakePathOrDie("metadata", "uid"),
	fieldpath.MakePathOrDie("metadata", "generation"),
	fieldpath.MakePathOrDie("metadata", "resourceVersion"),
	fieldpath.MakePathOrDie("metadata", "managedFields"),
)

// typeConverter types the built-in kinds with the schema client-go's apply configurations carry,
// the one the API server uses; made once, on first use.
var typeConverter = sync.OnceValue(func() managedfields.TypeConverter {
	return applyconfigurations.NewTypeConverter(clientgoscheme.Scheme)
})

// ownedFields is the union of the fields manager applied (not updated) to the object itself
// (not a subresource), or nil when it applied none.
func ownedFields(entries []metav1.ManagedFieldsEntry, manager string) (*fieldpath.Set, error) {
	var owned *fieldpath.Set
	for _, e := range entries {
		if e.Manager != manager || e.Subresource != "" || e.FieldsV1 == nil ||
			manager == FieldOwner && e.Operation != metav1.ManagedFieldsOperationApply {
			continue
		}
		set := &fieldpath.Set{}
		if err := set.FromJSON(e.FieldsV1.GetRawReader()); err != nil {
			return nil, fmt.Errorf("managed fields of %s: %w", manager, err)
		}
		if owned == nil {
			owned = set
		} else {
			owned = owned.Union(set)
		}
	}
	return owned, nil
}

// pathOf is the first path of a set, in its own order.
func pathOf(s *fieldpath.Set) fieldpath.Path {
	var first fieldpath.Path
	s.Iterate(func(p fieldpath.Path) {
		if first == nil {
			first = p.Copy()
		}
	})
	return first
}

// firstPath names the first path of a set without its leading dot.
func firstPath(s *fieldpath.Set) string { return strings.TrimPrefix(pathOf(s).String(), ".") }

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

// objectKey names one of an owner's objects.
type objectKey struct{ kind, namespace, name string }

func keyOf(o client.Object) objectKey {
	return objectKey{kind: o.GetObjectKind().GroupVersionKind().Kind, namespace: o.GetNamespace(), name: o.GetName()}
}

// applied is what the controller last knew of an object it applies: the digest of the request
// it last applied, and the object's resourceVersion when it last held what that request makes it.
type applied struct {
	request         [sha256.Size]byte
	resourceVersion string
	// uid is the object's that the apply created or changed.
	uid types.UID
}

// appliedCache remembers applied per object, by policy, as cluster-api's SSA cache does. It lives
// in the manager's memory: after a restart every object is compared once.
type appliedCache struct {
	mu       sync.Mutex
	policies map[types.NamespacedName]map[objectKey]applied
}

func (c *appliedCache) get(policy types.NamespacedName, key objectKey) (applied, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	a, ok := c.policies[policy][key]
	return a, ok
}

func (c *appliedCache) set(policy types.NamespacedName, key objectKey, a applied) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.policies == nil {
		c.policies = map[types.NamespacedName]map[objectKey]applied{}
	}
	if c.policies[policy] == nil {
		c.policies[policy] = map[objectKey]applied{}
	}
	c.policies[policy][key] = a
}

func (c *appliedCache) forget(policy types.NamespacedName) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.policies, policy)
}

// stalledRecheck is how often a policy stalled by an object in its way looks again.
const stalledRecheck = 5 * time.Minute

// notOwnedError says that an object an owner renders exists and belongs to something else.
// The controller never takes such an object over.
type notOwnedError struct{ kind, name, owner string }

func (e *notOwnedError) Error() string {
	owner := e.owner
	if owner == "" {
		owner = "policy"
	}
	return fmt.Sprintf("%s %s exists and is not owned by this %s: delete or rename it, or rename the %s", e.kind, e.name, owner, owner)
}

// ownerKind names the kind of a controller reference for people: policy or pool.
func ownerKind(ref *metav1.OwnerReference) string {
	if ref != nil && ref.Kind == "EnforcerPool" {
		return "pool"
	}
	return "policy"
}

// deleteOwned deletes obj if it exists and the owner of this UID controls it.
func deleteOwned(ctx context.Context, c client.Client, owner types.UID, obj client.Object) error {
	if err := c.Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
		return client.IgnoreNotFound(err)
	}
	if ref := metav1.GetControllerOf(obj); ref == nil || ref.UID != owner {
		return nil
	}
	if err := c.Delete(ctx, obj, client.Preconditions{UID: ptr.To(obj.GetUID())}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	logf.FromContext(ctx).Info("Deleted enforcer object that the policy no longer renders", "object", klog.KObj(obj))
	return nil
}
