package controllers_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// A hand edit of any owned object, or its deletion, is put back within 10 s, and an event says
// what was put back.
func TestReconcileWhenAnOwnedObjectIsEditedOrDeletedThenItIsPutBack(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "drift")
	targetService(t, ns, "api")
	p := newPolicy(ns, "drift", "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	key := client.ObjectKey{Namespace: ns, Name: "sluice-drift"}
	cm := &corev1.ConfigMap{}
	if err := k8s.Get(ctx, key, cm); err != nil {
		t.Fatal(err)
	}
	policyFile := cm.Data["policy.yaml"]

	edits := []struct {
		name    string
		edit    func() error
		putBack func() (bool, string)
	}{
		{"when the Deployment is scaled by hand then its replicas are put back", func() error {
			d := &appsv1.Deployment{}
			if err := k8s.Get(ctx, key, d); err != nil {
				return err
			}
			d.Spec.Replicas = ptr.To[int32](5)
			return k8s.Update(ctx, d)
		}, func() (bool, string) {
			d := &appsv1.Deployment{}
			err := k8s.Get(ctx, key, d)
			return err == nil && *d.Spec.Replicas == 3, "replicas not back to 3"
		}},
		{"when the image is set by hand then it is put back", func() error {
			d := &appsv1.Deployment{}
			if err := k8s.Get(ctx, key, d); err != nil {
				return err
			}
			d.Spec.Template.Spec.Containers[0].Image = "x:1"
			return k8s.Update(ctx, d)
		}, func() (bool, string) {
			d := &appsv1.Deployment{}
			err := k8s.Get(ctx, key, d)
			return err == nil && d.Spec.Template.Spec.Containers[0].Image == "example.com/enforcer:test", "image not put back"
		}},
		{"when the rendered policy is edited then it is put back", func() error {
			c := &corev1.ConfigMap{}
			if err := k8s.Get(ctx, key, c); err != nil {
				return err
			}
			c.Data["policy.yaml"] = strings.Replace(c.Data["policy.yaml"], "capacity: 10", "capacity: 10000000", 1)
			return k8s.Update(ctx, c)
		}, func() (bool, string) {
			c := &corev1.ConfigMap{}
			err := k8s.Get(ctx, key, c)
			return err == nil && c.Data["policy.yaml"] == policyFile, "policy file not put back"
		}},
		{"when the Service is deleted then it is created again", func() error {
			return k8s.Delete(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: key.Name}})
		}, func() (bool, string) {
			s := &corev1.Service{}
			err := k8s.Get(ctx, key, s)
			return err == nil && s.DeletionTimestamp == nil, "Service not created again"
		}},
		{"when the NetworkPolicy's admin port is opened to every namespace by hand then it is put back", func() error {
			np := &networkingv1.NetworkPolicy{}
			if err := k8s.Get(ctx, key, np); err != nil {
				return err
			}
			np.Spec.Ingress[len(np.Spec.Ingress)-1].From = nil
			return k8s.Update(ctx, np)
		}, func() (bool, string) {
			np := &networkingv1.NetworkPolicy{}
			err := k8s.Get(ctx, key, np)
			return err == nil && len(np.Spec.Ingress[len(np.Spec.Ingress)-1].From) == 1, "admin rule not narrowed again"
		}},
		{"when the NetworkPolicy is deleted then it is created again", func() error {
			return k8s.Delete(ctx, &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: key.Name}})
		}, func() (bool, string) {
			np := &networkingv1.NetworkPolicy{}
			err := k8s.Get(ctx, key, np)
			return err == nil && np.DeletionTimestamp == nil, "NetworkPolicy not created again"
		}},
		{"when the ConfigMap is deleted then it is created again", func() error {
			return k8s.Delete(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: key.Name}})
		}, func() (bool, string) {
			c := &corev1.ConfigMap{}
			err := k8s.Get(ctx, key, c)
			return err == nil && c.Data["policy.yaml"] == policyFile, "ConfigMap not created again"
		}},
	}
	for _, e := range edits {
		t.Run(e.name, func(t *testing.T) {
			before := driftEvents(t, ns)
			// The Deployment controller writes the Deployment's status meanwhile.
			if err := retry.RetryOnConflict(retry.DefaultRetry, e.edit); err != nil {
				t.Fatal(err)
			}
			eventually(t, "put back", e.putBack)
			eventually(t, "a DriftCorrected event", func() (bool, string) {
				n := driftEvents(t, ns)
				return n > before, "no new event"
			})
		})
	}
}

// A change of the spec changes the objects too, and that is no drift: no DriftCorrected event.
func TestReconcileWhenTheSpecChangesThenNoDriftIsReported(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "nodrift")
	targetService(t, ns, "api")
	p := newPolicy(ns, "change", "api")
	p.Spec.Storage = nil // memory: a managed Redis appears below
	p.Spec.Enforcer.Replicas = nil
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) {
		p.Spec.Rules[0].TokenBucket.Capacity = 20
		p.Spec.Storage = &v1alpha1.Storage{ManagedRedis: &v1alpha1.ManagedRedis{}}
	})
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	c := &corev1.ConfigMap{}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sluice-change"}, c); err != nil || !strings.Contains(c.Data["policy.yaml"], "capacity: 20") {
		t.Fatalf("the changed policy is not rendered: %v", err)
	}
	if n := driftEvents(t, ns); n != 0 {
		t.Errorf("%d DriftCorrected events after a change of the spec, want none", n)
	}
}

func driftEvents(t *testing.T, ns string) int {
	t.Helper()
	var events eventsv1.EventList
	if err := k8s.List(context.Background(), &events, client.InNamespace(ns)); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range events.Items {
		if e.Reason == controllers.EventDriftCorrected && strings.HasPrefix(e.Note, "Put back ") {
			n++
		}
	}
	return n
}

// Objects the policy no longer renders are deleted: the managed Redis when storage moves to a
// Redis of one's own, and the PodDisruptionBudget when replicas drop to one.
func TestReconcileWhenStorageAndReplicasChangeThenObjectsNoLongerRenderedAreDeleted(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "prune")
	targetService(t, ns, "api")
	p := newPolicy(ns, "prune", "api")
	p.Spec.Storage = &v1alpha1.Storage{ManagedRedis: &v1alpha1.ManagedRedis{}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	redis := client.ObjectKey{Namespace: ns, Name: render.RedisName("sluice-prune")}
	for _, o := range []client.Object{&appsv1.Deployment{}, &corev1.Service{}} {
		if err := k8s.Get(ctx, redis, o); err != nil {
			t.Fatalf("managed Redis %T: %v", o, err)
		}
	}
	updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) {
		p.Spec.Storage = newPolicy(ns, "x", "api").Spec.Storage
		p.Spec.Enforcer.Replicas = ptr.To[int32](1)
	})
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	gone := func(o client.Object, key client.ObjectKey) func() (bool, string) {
		return func() (bool, string) {
			err := k8s.Get(ctx, key, o)
			return apierrors.IsNotFound(err) || err == nil && o.GetDeletionTimestamp() != nil, "still there"
		}
	}
	eventually(t, "the managed Redis Deployment deleted", gone(&appsv1.Deployment{}, redis))
	eventually(t, "the managed Redis Service deleted", gone(&corev1.Service{}, redis))
	eventually(t, "the PodDisruptionBudget deleted", gone(&policyv1.PodDisruptionBudget{}, client.ObjectKey{Namespace: ns, Name: "sluice-prune"}))
}

// A policy whose name has dots, which no Service may have, is programmed all the same.
func TestReconcileWhenThePolicyNameHasDotsThenItIsProgrammed(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "dots")
	targetService(t, ns, "api")
	p := newPolicy(ns, "shop.v2", "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	svc := &corev1.Service{}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: render.Name(p)}, svc); err != nil {
		t.Errorf("the enforcer Service %s: %v", render.Name(p), err)
	}
}

// An object in the way that the policy does not own is never taken over: the policy is Stalled
// with the reason, so kstatus reports Failed and `kubectl wait` and Flux stop waiting, and the
// object is left as it was.
func TestReconcileWhenAnObjectItDoesNotOwnIsInTheWayThenStalledAndLeftAlone(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "stalled")
	targetService(t, ns, "api")
	squatter := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sluice-squat"}, Data: map[string]string{"mine": "yes"}}
	if err := k8s.Create(ctx, squatter); err != nil {
		t.Fatal(err)
	}
	inTheWay := map[string]string{"reason": "ObjectInTheWay"}
	before, _ := metric(t, "sluice_manager_reconcile_errors_total", inTheWay)
	p := newPolicy(ns, "squat", "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionStalled, metav1.ConditionTrue, v1alpha1.ReasonApplyFailed)
	if after, _ := metric(t, "sluice_manager_reconcile_errors_total", inTheWay); after <= before {
		t.Errorf("sluice_manager_reconcile_errors_total{reason=ObjectInTheWay} = %v, was %v: the failure is not counted", after, before)
	}
	if c := condition(t, p, v1alpha1.ConditionStalled); !strings.Contains(c.Message, "ConfigMap sluice-squat exists and is not owned by this policy") {
		t.Errorf("Stalled message %q does not name the object in the way", c.Message)
	}
	if s := kstatus(t, p); s != status.FailedStatus {
		t.Errorf("kstatus = %s, want Failed", s)
	}
	got := &corev1.ConfigMap{}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(squatter), got); err != nil {
		t.Fatal(err)
	}
	if got.Data["mine"] != "yes" || len(got.OwnerReferences) != 0 {
		t.Errorf("the ConfigMap in the way was changed: %+v", got)
	}
}

// A policy deleted and created again under the same name meets the old objects until garbage
// collection removes them: it waits, Reconciling and not Stalled, and is programmed once they are
// gone. A finalizer of someone else holds the old ConfigMap, so the wait is certain to happen.
func TestReconcileWhenAPolicyIsCreatedAgainThenItWaitsForTheOldObjectsInsteadOfStalling(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "again")
	targetService(t, ns, "api")
	p := newPolicy(ns, "again", "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	const hold = "test.sluice.dev/hold"
	cm := &corev1.ConfigMap{}
	key := client.ObjectKey{Namespace: ns, Name: "sluice-again"}
	setFinalizers := func(f ...string) {
		t.Helper()
		if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			if err := k8s.Get(ctx, key, cm); err != nil {
				return err
			}
			cm.Finalizers = f
			return k8s.Update(ctx, cm)
		}); err != nil {
			t.Fatal(err)
		}
	}
	setFinalizers(hold)
	if err := k8s.Delete(ctx, p); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the garbage collector deleting the old ConfigMap", func() (bool, string) {
		err := k8s.Get(ctx, key, cm)
		return err == nil && cm.DeletionTimestamp != nil, fmt.Sprintf("%v", err)
	})
	p = newPolicy(ns, "again", "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	// observedGeneration moves only on success, so wait for the condition alone.
	eventually(t, "Programmed=False ApplyFailed", func() (bool, string) {
		c := condition(t, p, v1alpha1.ConditionProgrammed)
		return c != nil && c.Status == metav1.ConditionFalse && c.Reason == v1alpha1.ReasonApplyFailed, fmt.Sprintf("%+v", c)
	})
	if c := condition(t, p, v1alpha1.ConditionStalled); c == nil || c.Status != metav1.ConditionFalse {
		t.Errorf("Stalled = %+v while the old objects wait for garbage collection, want False", c)
	}
	setFinalizers()
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
}

// A field the policy no longer renders disappears from the live object: dropping
// spec.enforcer.resources.limits.cpu removes the limit from the Deployment, as server-side apply
// of the new rendering does, and no DriftCorrected event is recorded for it.
func TestReconcileWhenALimitIsRemovedFromTheSpecThenItIsRemovedFromTheDeployment(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "remove")
	targetService(t, ns, "api")
	p := newPolicy(ns, "remove", "api")
	p.Spec.Enforcer.Resources = &corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m")},
		Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1"), corev1.ResourceMemory: resource.MustParse("256Mi")},
	}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	key := client.ObjectKey{Namespace: ns, Name: "sluice-remove"}
	limits := func() corev1.ResourceList {
		d := &appsv1.Deployment{}
		if err := k8s.Get(ctx, key, d); err != nil {
			t.Fatal(err)
		}
		return d.Spec.Template.Spec.Containers[0].Resources.Limits
	}
	if _, ok := limits()[corev1.ResourceCPU]; !ok {
		t.Fatalf("limits %v before the change, want a CPU limit", limits())
	}
	updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) {
		delete(p.Spec.Enforcer.Resources.Limits, corev1.ResourceCPU)
	})
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	eventually(t, "limits.cpu removed from the Deployment", func() (bool, string) {
		l := limits()
		_, cpu := l[corev1.ResourceCPU]
		return !cpu && l.Memory().String() == "256Mi", fmt.Sprintf("limits %v", l)
	})
	if n := driftEvents(t, ns); n != 0 {
		t.Errorf("%d DriftCorrected events after a change of the spec, want none", n)
	}
}

// policyName is a DNS subdomain of n characters with dots, such as "policy.v2.policy.v2.po".
func policyName(n int) string {
	return strings.Repeat("policy.v2.", n/10+1)[:n-1] + "z"
}

// Every name the API server admits is programmed and its enforcer found: names of 63 characters
// (the longest label value), 64, 200 and 253 (the longest name), with dots, all sharing their
// first 54 characters. Ready comes from the reports of the pods, which the controller finds
// through their labels and, for the names too long for a label, their annotation.
func TestReconcileWhenTheNameIsUpTo253CharactersThenItIsProgrammedAndReady(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "names")
	runEnforcers(t, ns)
	var policies []*v1alpha1.RateLimitPolicy
	for i, n := range []int{63, 64, 200, 253} {
		target := fmt.Sprintf("api-%d", i)
		targetService(t, ns, target)
		p := newPolicy(ns, policyName(n), target)
		p.Spec.Storage, p.Spec.Enforcer.Replicas = nil, ptr.To[int32](1)
		if err := k8s.Create(ctx, p); err != nil {
			t.Fatalf("create a policy named with %d characters: %v", n, err)
		}
		policies = append(policies, p)
	}
	for _, p := range policies {
		waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
		waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
		if c := condition(t, p, v1alpha1.ConditionReady); !strings.HasPrefix(c.Message, "1/1 replicas serve revision ") {
			t.Errorf("policy of %d characters: Ready message %q, want its one replica serving", len(p.Name), c.Message)
		}
	}
}
