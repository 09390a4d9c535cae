package controllers_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/test/local"
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

// labelNamespace sets or removes (value "") a label of a namespace.
func labelNamespace(t *testing.T, name, key, value string) {
	t.Helper()
	ns := &corev1.Namespace{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: name}, ns); err != nil {
		t.Fatal(err)
	}
	if ns.Labels == nil {
		ns.Labels = map[string]string{}
	}
	if value == "" {
		delete(ns.Labels, key)
	} else {
		ns.Labels[key] = value
	}
	if err := k8s.Update(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
}

// served lists the policies every replica of a pool reports serving, from the pool's status.
func poolServes(t *testing.T, pool *v1alpha1.EnforcerPool) int32 {
	t.Helper()
	if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(pool), pool); err != nil {
		t.Fatal(err)
	}
	if pool.Status.Policies == nil {
		return -1
	}
	return pool.Status.Policies.Served
}

// A pool admits the policies of the namespaces its allowedPolicies say, as a Gateway's listener
// admits routes: one of another namespace is Accepted=False NotAllowedByPool until the pool's
// selector matches its namespace's labels, and loses its place, its config removed from the pool,
// when they no longer do; a policy naming a pool that does not exist is Accepted=False
// PoolNotFound until it does; a pool deleted takes its policies' configs with it.
func TestPoolWhenPoliciesOfTwoNamespacesJoinThenTheNamespacesItAdmitsDecide(t *testing.T) {
	ctx := context.Background()
	gw := testenv.Namespace(t, k8s, "gw")
	runEnforcers(t, gw)
	teamA, teamB := testenv.Namespace(t, k8s, "team-a"), testenv.Namespace(t, k8s, "team-b")
	targetService(t, teamA, "api")
	targetService(t, teamB, "api")
	pool := newPool(gw, "shared", v1alpha1.NamespacesFromSelector)
	pool.Spec.AllowedPolicies.Namespaces.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "shared"}}
	if err := k8s.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	labelNamespace(t, teamA, "pool", "shared")
	a, b := pooled(teamA, "a", "api", gw, "shared"), pooled(teamB, "b", "api", gw, "shared")
	lost := pooled(teamA, "lost", "api", gw, "later")
	lost.Spec.TargetRef.Name = "lost"
	for _, o := range []client.Object{a, b, lost} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}

	waitCondition(t, a, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	waitCondition(t, b, v1alpha1.ConditionAccepted, metav1.ConditionFalse, v1alpha1.ReasonNotAllowedByPool)
	if c := condition(t, b, v1alpha1.ConditionAccepted); !strings.Contains(c.Message, "EnforcerPool "+gw+"/shared does not admit policies of namespace "+teamB) {
		t.Errorf("Accepted of the refused policy: %+v, want a message naming the pool and the namespace", c)
	}
	if c := condition(t, b, v1alpha1.ConditionProgrammed); c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonNotAccepted {
		t.Errorf("Programmed of the refused policy: %+v", c)
	}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: gw, Name: render.PoolConfigMapName("shared", b)}, &corev1.ConfigMap{}); !apierrors.IsNotFound(err) {
		t.Errorf("the refused policy's config in the pool: %v, want none", err)
	}
	waitCondition(t, lost, v1alpha1.ConditionAccepted, metav1.ConditionFalse, v1alpha1.ReasonPoolNotFound)
	if c := condition(t, lost, v1alpha1.ConditionAccepted); !strings.Contains(c.Message, "EnforcerPool "+gw+"/later does not exist") {
		t.Errorf("Accepted of the policy of a missing pool: %+v", c)
	}

	t.Run("when the refused namespace gets the pool's label then its policy joins", func(t *testing.T) {
		labelNamespace(t, teamB, "pool", "shared")
		waitCondition(t, b, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
		eventually(t, "the pool serving both", func() (bool, string) { n := poolServes(t, pool); return n == 2, fmt.Sprint(n) })
	})

	t.Run("when a namespace loses the label then its policy leaves the pool", func(t *testing.T) {
		labelNamespace(t, teamA, "pool", "")
		waitCondition(t, a, v1alpha1.ConditionAccepted, metav1.ConditionFalse, v1alpha1.ReasonNotAllowedByPool)
		eventually(t, "its config removed from the pool", func() (bool, string) {
			err := k8s.Get(ctx, client.ObjectKey{Namespace: gw, Name: render.PoolConfigMapName("shared", a)}, &corev1.ConfigMap{})
			return apierrors.IsNotFound(err), fmt.Sprint(err)
		})
		eventually(t, "the pool serving one", func() (bool, string) { n := poolServes(t, pool); return n == 1, fmt.Sprint(n) })
	})

	t.Run("when the missing pool is created then the policy naming it joins", func(t *testing.T) {
		later := newPool(gw, "later", v1alpha1.NamespacesFromAll)
		later.Spec.Replicas, later.Spec.Storage = nil, nil // memory, one replica
		if err := k8s.Create(ctx, later); err != nil {
			t.Fatal(err)
		}
		waitCondition(t, lost, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
		if e := lost.Status.Enforcer; e.Ready != "1/1" || e.Storage != "memory" || e.Pool != gw+"/later" {
			t.Errorf("status.enforcer %+v, want the memory pool's 1/1", e)
		}
	})

	t.Run("when a pool is deleted then its policies' configs go with it and they are PoolNotFound", func(t *testing.T) {
		if err := k8s.Delete(ctx, pool); err != nil {
			t.Fatal(err)
		}
		waitCondition(t, b, v1alpha1.ConditionAccepted, metav1.ConditionFalse, v1alpha1.ReasonPoolNotFound)
		eventually(t, "the pool's configs collected", func() (bool, string) {
			var cms corev1.ConfigMapList
			if err := k8s.List(ctx, &cms, client.InNamespace(gw), client.MatchingLabels{report.PoolLabel: "shared"}); err != nil {
				return false, err.Error()
			}
			return len(cms.Items) == 0, fmt.Sprintf("%d left", len(cms.Items))
		})
	})
}

// One policy's problem is its own: a policy whose config no ConfigMap can hold is refused before
// delivery (Programmed=False, Stalled), one whose rules are invalid is not accepted, and a
// config a replica cannot load is reported by the pool (Degraded PoliciesRefused), while the
// pool's other policies stay Ready and served.
func TestPoolWhenOnePolicyIsOversizedOrInvalidThenItAloneIsRefused(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "pool-iso")
	runEnforcers(t, ns)
	targetService(t, ns, "api")
	pool := newPool(ns, "shared", v1alpha1.NamespacesFromSame)
	if err := k8s.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	good := pooled(ns, "good", "api", "", "shared")
	big := pooled(ns, "big", "big", "", "shared")
	value := strings.Repeat("v", 4096)
	big.Spec.Rules = nil
	for i := range 18 {
		var headers []v1alpha1.HeaderMatch
		for j := range 16 {
			headers = append(headers, v1alpha1.HeaderMatch{Name: v1alpha1.HeaderName(fmt.Sprintf("X-H%d", j)), Value: ptr.To(value)})
		}
		big.Spec.Rules = append(big.Spec.Rules, v1alpha1.Rule{Name: fmt.Sprintf("r%d", i), Match: &v1alpha1.Match{Headers: headers},
			FixedWindow: &v1alpha1.Window{Limit: 1, Window: "1s"}})
	}
	// What only Go can say: the webhook would refuse it; the controller does too.
	invalid := pooled(ns, "invalid", "invalid", "", "shared")
	invalid.Spec.Rules[0].Match = &v1alpha1.Match{Path: &v1alpha1.PathMatch{Type: v1alpha1.PathMatchRegularExpression, Value: "(unclosed"}}
	for _, o := range []client.Object{good, big, invalid} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatalf("create %s: %v", o.GetName(), err)
		}
	}
	waitCondition(t, good, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	waitCondition(t, big, v1alpha1.ConditionProgrammed, metav1.ConditionFalse, v1alpha1.ReasonApplyFailed)
	if c := condition(t, big, v1alpha1.ConditionProgrammed); !strings.Contains(c.Message, "a ConfigMap holds") {
		t.Errorf("Programmed of the oversized policy: %+v", c)
	}
	if c := condition(t, big, v1alpha1.ConditionStalled); c.Status != metav1.ConditionTrue {
		t.Errorf("Stalled of the oversized policy: %+v, want True", c)
	}
	waitCondition(t, invalid, v1alpha1.ConditionAccepted, metav1.ConditionFalse, v1alpha1.ReasonInvalid)
	for _, p := range []*v1alpha1.RateLimitPolicy{big, invalid} {
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: render.PoolConfigMapName("shared", p)}, &corev1.ConfigMap{}); !apierrors.IsNotFound(err) {
			t.Errorf("%s's config delivered to the pool: %v", p.Name, err)
		}
	}

	// A config the manager did not write, labelled for the pool: its replicas refuse it and
	// the pool says so; the good policy is served on.
	rogue := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "rogue", Labels: map[string]string{report.PoolLabel: "shared"},
		Annotations: map[string]string{report.PolicyAnnotation: ns + "/rogue"}}, Data: map[string]string{report.PolicyFileKey: "kind: Nonsense\n"}}
	if err := k8s.Create(ctx, rogue); err != nil {
		t.Fatal(err)
	}
	waitPoolCondition(t, pool, v1alpha1.ConditionDegraded, metav1.ConditionTrue, v1alpha1.ReasonPoliciesRefused)
	eventually(t, "the refused policy listed", func() (bool, string) {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
			return false, err.Error()
		}
		ps := pool.Status.Policies
		return ps != nil && ps.Refused == 1 && len(ps.RefusedPolicies) == 1 && ps.RefusedPolicies[0].Policy == ns+"/rogue" && ps.Served == 1,
			fmt.Sprintf("%+v", ps)
	})
	if c := condition(t, good, v1alpha1.ConditionReady); c.Status != metav1.ConditionTrue {
		t.Errorf("the good policy beside a refused one: %+v, want Ready", c)
	}
	if err := k8s.Delete(ctx, rogue); err != nil {
		t.Fatal(err)
	}
	waitPoolCondition(t, pool, v1alpha1.ConditionDegraded, metav1.ConditionFalse, v1alpha1.ReasonAsExpected)
}

// home is one place that may decide a policy's requests: its own enforcer's check API, or a
// pool's, asked for it by path.
type home struct {
	name string
	// urls finds the check API URLs of the home's running pods.
	urls func() []string
}

// decidedBy asks every pod of a home to decide a request of the policy, as a gateway would, and
// reports whether each did (the policy's RateLimit fields on a 200 or 429): a pod that is gone,
// or does not serve the policy (404), did not.
func decidedBy(hc *http.Client, urls []string, client string) []bool {
	out := make([]bool, len(urls))
	for i, u := range urls {
		req, _ := http.NewRequest(http.MethodGet, u, nil)
		req.Header.Set("X-Forwarded-Method", "GET")
		req.Header.Set("X-Forwarded-Uri", "/")
		req.Header.Set("X-Api-Key", client)
		resp, err := hc.Do(req)
		if err != nil {
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		out[i] = (resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusTooManyRequests) && resp.Header.Get("RateLimit-Policy") != ""
	}
	return out
}

// A policy moves on a live cluster, under traffic, from its own enforcer into a pool, to another
// pool, and back to an enforcer of its own: make-before-break, its new home serves its current
// revision on every replica before its old one stops, so that at every moment some home decides
// its requests. Both homes count in one Redis under the policy's keys, so a client limited before
// a move is limited after it.
func TestPoolWhenAPolicyMovesInAndOutUnderTrafficThenSomeHomeDecidesThroughout(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "move")
	runEnforcers(t, ns)
	targetService(t, ns, "api")
	first, second := newPool(ns, "first", v1alpha1.NamespacesFromSame), newPool(ns, "second", v1alpha1.NamespacesFromSame)
	p := newPolicy(ns, "mover", "api")
	p.Spec.Enforcer.Replicas = ptr.To[int32](1)
	p.Spec.Rules[0].TokenBucket = &v1alpha1.TokenBucket{Capacity: 3, Refill: v1alpha1.TokenRefill{Tokens: 1, Period: "1h"}}
	for _, o := range []client.Object{first, second, p} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	waitPoolCondition(t, first, v1alpha1.ConditionReady, metav1.ConditionTrue, "")
	waitPoolCondition(t, second, v1alpha1.ConditionReady, metav1.ConditionTrue, "")
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)

	podURLs := func(selector map[string]string, path string) func() []string {
		return func() []string {
			var pods corev1.PodList
			if err := k8s.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(selector)); err != nil {
				return nil
			}
			var urls []string
			for i := range pods.Items {
				if pod := &pods.Items[i]; pod.Status.PodIP != "" && pod.DeletionTimestamp == nil {
					urls = append(urls, local.PodURL(pod, "check")+path)
				}
			}
			slices.Sort(urls)
			return urls
		}
	}
	byPath := "/policies/" + ns + "/mover" + enforcer.ForwardAuthPath
	homes := []home{
		{"own", podURLs(render.PodLabels(p), enforcer.ForwardAuthPath)},
		{"first", podURLs(render.PoolPodLabels(first), byPath)},
		{"second", podURLs(render.PoolPodLabels(second), byPath)},
	}

	// The traffic: every few milliseconds each pod of each home is asked, each time for a new
	// client, so that no limit refuses; a round is covered when some pod of some home decided.
	type round struct {
		at      time.Time
		decided []string // the pods' check URLs that decided
	}
	var mu sync.Mutex
	var rounds []round
	stop := make(chan struct{})
	var wg sync.WaitGroup
	hc := &http.Client{Timeout: 2 * time.Second}
	wg.Go(func() {
		var urls []string
		refreshed := time.Time{}
		deadline := time.Now().Add(3 * time.Minute) // bounded, whatever the test does
		for n := 0; time.Now().Before(deadline); n++ {
			select {
			case <-stop:
				return
			default:
			}
			if time.Since(refreshed) > 50*time.Millisecond {
				urls = nil
				for _, h := range homes {
					urls = append(urls, h.urls()...)
				}
				refreshed = time.Now()
			}
			r := round{at: time.Now()}
			for i, ok := range decidedBy(hc, urls, fmt.Sprintf("traffic-%d", n)) {
				if ok {
					r.decided = append(r.decided, urls[i])
				}
			}
			mu.Lock()
			rounds = append(rounds, r)
			mu.Unlock()
			time.Sleep(5 * time.Millisecond) // the traffic's pace while the policy moves, not an order of events
		}
	})
	t.Cleanup(func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	})

	// A client spends its limit of 3 at its own enforcer, before any move.
	limited := func(urls []string) []int {
		var out []int
		for _, u := range urls {
			req, _ := http.NewRequest(http.MethodGet, u, nil)
			req.Header.Set("X-Forwarded-Method", "GET")
			req.Header.Set("X-Forwarded-Uri", "/")
			req.Header.Set("X-Api-Key", "spender")
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			out = append(out, resp.StatusCode)
		}
		return out
	}
	ownURL := homes[0].urls()
	if len(ownURL) != 1 {
		t.Fatalf("own enforcer pods %v, want 1", ownURL)
	}
	if got := limited([]string{ownURL[0], ownURL[0], ownURL[0], ownURL[0]}); !slices.Equal(got, []int{200, 200, 200, 429}) {
		t.Fatalf("the spender at its own enforcer: %v, want its 3 then 429", got)
	}

	move := func(to string, change func(*v1alpha1.RateLimitPolicy), done func() (bool, string)) {
		t.Helper()
		start := time.Now()
		updateSpec(t, p, change)
		eventually(t, "the move to "+to, done)
		waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
		t.Logf("moved to %s in %v", to, time.Since(start).Round(time.Millisecond))
	}
	gone := func(o client.Object) (bool, string) {
		err := k8s.Get(ctx, client.ObjectKeyFromObject(o), o)
		return apierrors.IsNotFound(err), fmt.Sprintf("%T %s: %v", o, o.GetName(), err)
	}
	own := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sluice-mover"}}
	configIn := func(pool string) *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: render.PoolConfigMapName(pool, p)}}
	}

	move("the pool first", func(p *v1alpha1.RateLimitPolicy) {
		p.Spec.Storage, p.Spec.Enforcer = nil, &v1alpha1.EnforcerSpec{PoolRef: &v1alpha1.PoolRef{Name: "first"}}
	}, func() (bool, string) { return gone(own) })
	if got := limited(homes[1].urls()); !slices.Equal(got, []int{429, 429}) {
		t.Errorf("the spender at the pool's replicas: %v, want 429 from both: its counter moved with it", got)
	}
	move("the pool second", func(p *v1alpha1.RateLimitPolicy) { p.Spec.Enforcer.PoolRef.Name = "second" },
		func() (bool, string) { return gone(configIn("first")) })
	move("its own enforcer", func(p *v1alpha1.RateLimitPolicy) {
		p.Spec.Enforcer = &v1alpha1.EnforcerSpec{Replicas: ptr.To[int32](1)}
		p.Spec.Storage = newPolicy(ns, "x", "x").Spec.Storage
	}, func() (bool, string) { return gone(configIn("second")) })
	// The traffic goes on until there is enough of it to judge, however fast the moves were on
	// this machine: rounds after the last move are its home's to decide too.
	eventually(t, "100 rounds of traffic", func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		return len(rounds) >= 100, fmt.Sprintf("%d rounds", len(rounds))
	})
	close(stop)
	wg.Wait()

	// Every round was decided by some home, and every pod of each new home decided before the
	// last pod of the home before it stopped.
	mu.Lock()
	defer mu.Unlock()
	if len(rounds) < 100 {
		t.Fatalf("only %d rounds of traffic", len(rounds))
	}
	var uncovered []string
	served := map[string][2]time.Time{} // pod -> first and last round it decided
	for _, r := range rounds {
		for _, u := range r.decided {
			w := served[u]
			if w[0].IsZero() {
				w[0] = r.at
			}
			w[1] = r.at
			served[u] = w
		}
		if len(r.decided) == 0 {
			uncovered = append(uncovered, r.at.Format("15:04:05.000"))
		}
	}
	if len(uncovered) > 0 {
		t.Errorf("%d of %d rounds decided by no home, at %v", len(uncovered), len(rounds), uncovered)
	}
	var finalOwn []string
	for u := range served {
		if !strings.Contains(u, "/policies/") && u != ownURL[0] {
			finalOwn = append(finalOwn, u)
		}
	}
	if len(finalOwn) != 1 {
		t.Errorf("own enforcer pods that decided after the move back: %v, want one", finalOwn)
	}
	firstPods, secondPods := homes[1].urls(), homes[2].urls()
	steps := [][2][]string{{{ownURL[0]}, firstPods}, {firstPods, secondPods}, {secondPods, finalOwn}}
	for i, step := range steps {
		var newest, oldest time.Time // the new home's last first decision, the old home's first last one
		for _, u := range step[1] {
			if served[u][0].After(newest) {
				newest = served[u][0]
			}
		}
		for _, u := range step[0] {
			if oldest.IsZero() || served[u][1].Before(oldest) {
				oldest = served[u][1]
			}
		}
		// In one round (one time) both homes decided: they overlapped there, make-before-break.
		if len(step[0]) == 0 || len(step[1]) == 0 || newest.After(oldest) {
			t.Errorf("move %d: every pod of the new home %v decided by %v, the old home %v stopped at %v: not make-before-break",
				i+1, step[1], newest.Format("15:04:05.000"), step[0], oldest.Format("15:04:05.000"))
		}
	}
	t.Logf("%d rounds of traffic, %d decided by no home", len(rounds), len(uncovered))
}

// countingClient is c, counting every request that could change something.
func countingClient(c client.Client, writes *atomic.Int64) client.Client {
	count := func() { writes.Add(1) }
	return interceptor.NewClient(noWatch{c}, interceptor.Funcs{
		Create: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.CreateOption) error {
			count()
			return c.Create(ctx, o, opts...)
		},
		Update: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.UpdateOption) error {
			count()
			return c.Update(ctx, o, opts...)
		},
		Patch: func(ctx context.Context, c client.WithWatch, o client.Object, patch client.Patch, opts ...client.PatchOption) error {
			count()
			return c.Patch(ctx, o, patch, opts...)
		},
		Apply: func(ctx context.Context, c client.WithWatch, o runtime.ApplyConfiguration, opts ...client.ApplyOption) error {
			count()
			return c.Apply(ctx, o, opts...)
		},
		Delete: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.DeleteOption) error {
			count()
			return c.Delete(ctx, o, opts...)
		},
		SubResourcePatch: func(ctx context.Context, c client.Client, sub string, o client.Object, patch client.Patch, opts ...client.SubResourcePatchOption) error {
			count()
			return c.SubResource(sub).Patch(ctx, o, patch, opts...)
		},
		SubResourceUpdate: func(ctx context.Context, c client.Client, sub string, o client.Object, opts ...client.SubResourceUpdateOption) error {
			count()
			return c.SubResource(sub).Update(ctx, o, opts...)
		},
	})
}

// A second reconcile of an unchanged pool, and of an unchanged policy in it, writes nothing: no
// request that changes anything is sent, and no resourceVersion moves.
func TestPoolWhenNothingChangedThenZeroWrites(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "pool-steady")
	runEnforcers(t, ns)
	targetService(t, ns, "api")
	pool := newPool(ns, "shared", v1alpha1.NamespacesFromSame)
	p := pooled(ns, "steady", "api", "", "shared")
	for _, o := range []client.Object{pool, p} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	waitPoolCondition(t, pool, v1alpha1.ConditionReady, metav1.ConditionTrue, "")
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, "")
	// Settled: the pool's counts are written at most once per interval.
	eventually(t, "the pool's status settled", func() (bool, string) { n := poolServes(t, pool); return n == 1, fmt.Sprint(n) })

	versions := func() string {
		var out []string
		for _, o := range []client.Object{
			&appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sluice-pool-shared"}},
			&corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sluice-pool-shared"}},
			&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: render.PoolConfigMapName("shared", p)}},
			&v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "shared"}},
			&v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "steady"}},
		} {
			if err := k8s.Get(ctx, client.ObjectKeyFromObject(o), o); err != nil {
				t.Fatal(err)
			}
			out = append(out, fmt.Sprintf("%T=%s", o, o.GetResourceVersion()))
		}
		return strings.Join(out, " ")
	}
	before := versions()
	var writes atomic.Int64
	counting := countingClient(mgrClient, &writes)
	r := *reconciler
	r.Client = counting
	pools := reconciler.PoolReconciler(counting)
	for range 3 {
		if _, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(p)}); err != nil {
			t.Fatal(err)
		}
		if _, err := pools.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(pool)}); err != nil {
			t.Fatal(err)
		}
	}
	if n := writes.Load(); n != 0 {
		t.Errorf("%d writes in 3 reconciles of an unchanged pool and policy, want 0", n)
	}
	if after := versions(); after != before {
		t.Errorf("resourceVersions moved: %s -> %s", before, after)
	}
}

// A new policy's first status waits up to ProgressHold for its enforcers: a pool that serves it
// within that time gets one status write, already Ready, and no event (nothing changed that the
// status had said); one whose enforcers take longer is first written Reconciling, no sooner
// than the hold. Either way nothing is written Reconciling first and Ready just after, the
// two writes a policy cost the API server in a rollout of thousands.
func TestPoolWhenANewPolicyIsServedWithinTheHoldThenItsFirstStatusIsReady(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "pool-first")
	runEnforcers(t, ns)
	targetService(t, ns, "api")
	pool := newPool(ns, "shared", v1alpha1.NamespacesFromSame)
	if err := k8s.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	waitPoolCondition(t, pool, v1alpha1.ConditionReady, metav1.ConditionTrue, "")
	watcher, err := client.NewWithWatch(env.Config, client.Options{Scheme: k8s.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	w, err := watcher.Watch(ctx, &v1alpha1.RateLimitPolicyList{}, client.InNamespace(ns))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	p := pooled(ns, "first", "api", "", "shared")
	created := time.Now()
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	type written struct {
		after time.Duration
		ready *metav1.Condition
	}
	var writes []written
	timeout := time.After(30 * time.Second)
	for len(writes) == 0 || writes[len(writes)-1].ready.Status != metav1.ConditionTrue {
		select {
		case ev := <-w.ResultChan():
			if got, ok := ev.Object.(*v1alpha1.RateLimitPolicy); ok && got.Name == p.Name && len(got.Status.Conditions) > 0 {
				writes = append(writes, written{time.Since(created), meta.FindStatusCondition(got.Status.Conditions, v1alpha1.ConditionReady)})
			}
		case <-timeout:
			t.Fatalf("no Ready status in 30 s: %+v", writes)
		}
	}
	if first := writes[0]; first.ready.Status != metav1.ConditionTrue && first.after < controllers.ProgressHold {
		t.Errorf("the first status, %s after the create, says Ready=%s (%s): written before the %s hold", first.after, first.ready.Status, first.ready.Message, controllers.ProgressHold)
	}
	if len(writes) == 1 {
		// Served within the hold: nothing was announced, so nothing is told.
		var events eventsv1.EventList
		if err := k8s.List(ctx, &events, client.InNamespace(ns)); err != nil {
			t.Fatal(err)
		}
		for _, e := range events.Items {
			if e.Regarding.Kind == "RateLimitPolicy" {
				t.Errorf("event %s %s %s of a policy whose first status was Ready", e.Type, e.Reason, e.Action)
			}
		}
	} else {
		t.Logf("the pool served the policy after the hold: %d status writes", len(writes))
	}
}
