package controllers_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// newPool is a pool of the namespace with two replicas on the tests' Redis, admitting from.
func newPool(ns, name string, from v1alpha1.FromNamespaces) *v1alpha1.EnforcerPool {
	return &v1alpha1.EnforcerPool{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.EnforcerPoolSpec{
			Replicas: ptr.To[int32](2),
			Storage: &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{
				Mode: v1alpha1.RedisStandalone, Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redisAddr)},
				CredentialsSecretRef: &v1alpha1.CredentialsSecretRef{Name: "redis-creds", PasswordKey: "password"},
			}},
			AllowedPolicies: &v1alpha1.AllowedPolicies{Namespaces: &v1alpha1.PolicyNamespaces{From: from}},
		},
	}
}

// pooled is newPolicy joining a pool (in its own namespace when poolNS is ""): no storage, no
// enforcer shape of its own.
func pooled(ns, name, target, poolNS, pool string) *v1alpha1.RateLimitPolicy {
	p := newPolicy(ns, name, target)
	p.Spec.Storage = nil
	p.Spec.Enforcer = &v1alpha1.EnforcerSpec{PoolRef: &v1alpha1.PoolRef{Name: pool, Namespace: poolNS}}
	return p
}

func poolCondition(t *testing.T, pool *v1alpha1.EnforcerPool, typ string) *metav1.Condition {
	t.Helper()
	if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(pool), pool); err != nil {
		t.Fatal(err)
	}
	return meta.FindStatusCondition(pool.Status.Conditions, typ)
}

func waitPoolCondition(t *testing.T, pool *v1alpha1.EnforcerPool, typ string, want metav1.ConditionStatus, reason string) {
	t.Helper()
	eventually(t, fmt.Sprintf("pool %s=%s (%s)", typ, want, reason), func() (bool, string) {
		c := poolCondition(t, pool, typ)
		return c != nil && c.Status == want && (reason == "" || c.Reason == reason) && pool.Status.ObservedGeneration == pool.Generation,
			fmt.Sprintf("%+v, observedGeneration %d of %d", c, pool.Status.ObservedGeneration, pool.Generation)
	})
}

// A pool runs its enforcers as a policy's own: a Deployment, a Service with the check and RLS
// ports and no proxy, a budget, an identity and a NetworkPolicy, all controlled by the pool; once
// its replicas run and report, it is Ready and kstatus Current. A policy that joins it renders
// no enforcer of its own, only its config in the pool's namespace, and is Ready once every
// replica of the pool reports serving its current revision; a policy with its own enforcer runs
// beside it as before.
func TestPoolWhenPoliciesJoinThenThePoolServesThemAndStatusSaysSoBesideOwnEnforcers(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "pool")
	runEnforcers(t, ns)
	targetService(t, ns, "api")
	targetService(t, ns, "other")
	pool := newPool(ns, "shared", v1alpha1.NamespacesFromSame)
	if err := k8s.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	p := pooled(ns, "in-pool", "api", "", "shared")
	own := newPolicy(ns, "own", "other")
	own.Spec.Enforcer.Replicas = ptr.To[int32](1)
	for _, o := range []client.Object{p, own} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	waitPoolCondition(t, pool, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	waitCondition(t, own, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)

	t.Run("when Ready then the pool's objects are its own, with the check and RLS ports and no proxy", func(t *testing.T) {
		name := client.ObjectKey{Namespace: ns, Name: "sluice-pool-shared"}
		dep, svc := &appsv1.Deployment{}, &corev1.Service{}
		for _, o := range []client.Object{dep, svc, &corev1.ServiceAccount{}, &rbacv1.Role{}, &rbacv1.RoleBinding{}} {
			if err := k8s.Get(ctx, name, o); err != nil {
				t.Fatalf("%T: %v", o, err)
			}
			if refs := o.GetOwnerReferences(); len(refs) != 1 || refs[0].UID != pool.UID || refs[0].Kind != "EnforcerPool" || !ptr.Deref(refs[0].Controller, false) {
				t.Errorf("%T owner references = %+v, want one controller reference to the pool", o, refs)
			}
		}
		var ports []string
		for _, port := range svc.Spec.Ports {
			ports = append(ports, fmt.Sprintf("%s/%d", port.Name, port.Port))
		}
		if !slices.Equal(ports, []string{"check/8081", "grpc-rls/8082", "metrics/9090"}) {
			t.Errorf("pool Service ports %v, want check, grpc-rls and metrics", ports)
		}
		if s := pool.Status; s.Ready != "2/2" || s.ServiceName != name.Name || s.Storage != "redis-standalone" || s.Policies == nil ||
			s.Policies.Served != 1 || s.Policies.Refused != 0 || len(s.ReplicaStatuses) != 2 {
			t.Errorf("pool status %+v, policies %+v", s, s.Policies)
		}
		for _, rs := range pool.Status.ReplicaStatuses {
			if !rs.Ready || rs.Policies != 1 || rs.Store != "connected" {
				t.Errorf("replica status %+v, want ready with 1 policy and its store connected", rs)
			}
		}
		u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(pool)
		if err != nil {
			t.Fatal(err)
		}
		if res, err := status.Compute(&unstructured.Unstructured{Object: u}); err != nil || res.Status != status.CurrentStatus {
			t.Errorf("kstatus of the Ready pool = %v (%v), want Current", res, err)
		}
	})

	t.Run("when a policy joins then it has no enforcer of its own and its config is in the pool's namespace", func(t *testing.T) {
		for _, o := range []client.Object{&appsv1.Deployment{}, &corev1.ConfigMap{}, &corev1.Service{}, &corev1.ServiceAccount{}} {
			if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sluice-in-pool"}, o); !apierrors.IsNotFound(err) {
				t.Errorf("%T sluice-in-pool: %v, want none", o, err)
			}
		}
		cm := &corev1.ConfigMap{}
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: render.PoolConfigMapName("shared", p)}, cm); err != nil {
			t.Fatal(err)
		}
		if cm.Labels[report.PoolLabel] != "shared" || cm.Annotations[report.PolicyAnnotation] != ns+"/in-pool" {
			t.Errorf("config labels %v, annotations %v", cm.Labels, cm.Annotations)
		}
		if refs := cm.OwnerReferences; len(refs) != 1 || refs[0].UID != pool.UID {
			t.Errorf("config owner references %+v, want the pool", refs)
		}
		if _, _, err := enforcer.Load([]byte(cm.Data[report.PolicyFileKey])); err != nil {
			t.Error(err)
		}
		e := p.Status.Enforcer
		if e == nil || e.Pool != ns+"/shared" || e.ServiceName != "sluice-pool-shared" || e.Ready != "2/2" || e.ConfigRevision != cm.Annotations[render.RevisionAnnotation] {
			t.Errorf("status.enforcer %+v, want the pool's Service, 2/2 serving the config's revision", e)
		}
		if c := condition(t, p, v1alpha1.ConditionReady); !strings.HasPrefix(c.Message, "2/2 replicas serve revision "+e.ConfigRevision) {
			t.Errorf("Ready %+v", c)
		}
	})

	t.Run("when the policy's config or the pool's Deployment is edited by hand then it is put back", func(t *testing.T) {
		cm := &corev1.ConfigMap{}
		key := client.ObjectKey{Namespace: ns, Name: render.PoolConfigMapName("shared", p)}
		if err := k8s.Get(ctx, key, cm); err != nil {
			t.Fatal(err)
		}
		want := cm.Data[report.PolicyFileKey]
		cm.Data[report.PolicyFileKey] = strings.Replace(want, "capacity: 10", "capacity: 99", 1)
		if err := k8s.Update(ctx, cm); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the config put back", func() (bool, string) {
			if err := k8s.Get(ctx, key, cm); err != nil {
				return false, err.Error()
			}
			return cm.Data[report.PolicyFileKey] == want, cm.Data[report.PolicyFileKey]
		})
		dep := &appsv1.Deployment{}
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sluice-pool-shared"}, dep); err != nil {
			t.Fatal(err)
		}
		dep.Spec.Replicas = ptr.To[int32](5)
		if err := k8s.Update(ctx, dep); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the pool's replicas put back", func() (bool, string) {
			if err := k8s.Get(ctx, client.ObjectKeyFromObject(dep), dep); err != nil {
				return false, err.Error()
			}
			return *dep.Spec.Replicas == 2, fmt.Sprint(*dep.Spec.Replicas)
		})
		eventually(t, "DriftCorrected events on the policy and the pool", func() (bool, string) {
			var events eventsv1.EventList
			if err := k8s.List(ctx, &events, client.InNamespace(ns)); err != nil {
				return false, err.Error()
			}
			var told []string
			for _, e := range events.Items {
				if e.Reason == "DriftCorrected" {
					told = append(told, e.Regarding.Kind+"/"+e.Regarding.Name)
				}
			}
			return slices.Contains(told, "RateLimitPolicy/in-pool") && slices.Contains(told, "EnforcerPool/shared"), fmt.Sprint(told)
		})
	})

	t.Run("when a pooled policy is deleted then its config leaves the pool", func(t *testing.T) {
		if err := k8s.Delete(ctx, p); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the config gone", func() (bool, string) {
			err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: render.PoolConfigMapName("shared", p)}, &corev1.ConfigMap{})
			return apierrors.IsNotFound(err), fmt.Sprint(err)
		})
		eventually(t, "the pool serving none", func() (bool, string) {
			if err := k8s.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
				return false, err.Error()
			}
			return pool.Status.Policies != nil && pool.Status.Policies.Served == 0, fmt.Sprintf("%+v", pool.Status.Policies)
		})
	})
}
