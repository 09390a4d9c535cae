package controllers_test

import (
	"context"
	"testing"

	lua "github.com/yuin/gopher-lua"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/config/argocd"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// The Argo CD health check, run by gopher-lua (the interpreter Argo CD embeds) on policies read
// back from the real API server in each state the controller reports.
func TestArgoCDHealthWhenThePolicyIsInEachStateThenItMapsToArgosHealth(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "argocd")
	for _, svc := range []string{"api", "api-rolling", "api-stalled"} {
		targetService(t, ns, svc) // one policy per Service: a second would be Conflicted
	}

	ready := newPolicy(ns, "ready", "api")
	rolling := newPolicy(ns, "rolling", "api-rolling")
	// Its pods cannot start, as on a cluster, until the Secret it names exists.
	rolling.Spec.Storage.Redis.CredentialsSecretRef.Name = "not-yet-created"
	degraded := newPolicy(ns, "degraded", "missing-service")
	stalled := newPolicy(ns, "stalled", "api-stalled")
	if err := k8s.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sluice-stalled"}}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*v1alpha1.RateLimitPolicy{ready, rolling, degraded, stalled} {
		if err := k8s.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	waitCondition(t, ready, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	runEnforcers(t, ns)
	waitCondition(t, rolling, v1alpha1.ConditionReconciling, metav1.ConditionTrue, "")
	waitCondition(t, degraded, v1alpha1.ConditionDegraded, metav1.ConditionTrue, v1alpha1.ReasonTargetNotFound)
	waitCondition(t, stalled, v1alpha1.ConditionStalled, metav1.ConditionTrue, "")
	// Last, just before it is read: under load a replica's report may carry a Redis call that
	// timed out, and Degrade the policy until its next report.
	waitCondition(t, ready, v1alpha1.ConditionReady, metav1.ConditionTrue, "")
	fresh := newPolicy(ns, "fresh", "api") // no status yet: never read from the API server

	cases := []struct {
		name   string
		policy *v1alpha1.RateLimitPolicy
		want   string
	}{
		{"when every replica is ready then Healthy", ready, "Healthy"},
		{"when the enforcer rolls out then Progressing", rolling, "Progressing"},
		{"when the target Service is missing then Degraded", degraded, "Degraded"},
		{"when an object is in the way then Degraded", stalled, "Degraded"},
		{"when the controller has not written a status then Progressing", fresh, "Progressing"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			obj := &unstructured.Unstructured{}
			if c.policy != fresh {
				obj.SetGroupVersionKind(testenv.GVK)
				if err := k8s.Get(ctx, client.ObjectKeyFromObject(c.policy), obj); err != nil {
					t.Fatal(err)
				}
			} else {
				obj.Object = map[string]any{"metadata": map[string]any{"name": "fresh", "generation": int64(1)}}
			}
			status, message := argoHealth(t, obj.Object)
			if status != c.want {
				t.Errorf("health %s (%q), want %s", status, message, c.want)
			}
			if message == "" {
				t.Error("no message")
			}
		})
	}
}

// argoHealth runs config/argocd/health.lua as Argo CD does: obj is a global, the script returns
// a table with status and message.
func argoHealth(t *testing.T, obj map[string]any) (status, message string) {
	t.Helper()
	L := lua.NewState()
	defer L.Close()
	L.SetGlobal("obj", toLua(L, obj))
	if err := L.DoString(argocd.HealthLua); err != nil {
		t.Fatal(err)
	}
	res, ok := L.Get(-1).(*lua.LTable)
	if !ok {
		t.Fatalf("the script returned %v, want a table", L.Get(-1))
	}
	return res.RawGetString("status").String(), res.RawGetString("message").String()
}

// toLua converts a decoded JSON value to Lua values, as Argo CD hands objects to its scripts.
func toLua(ls *lua.LState, v any) lua.LValue {
	switch v := v.(type) {
	case map[string]any:
		t := ls.NewTable()
		for k, x := range v {
			t.RawSetString(k, toLua(ls, x))
		}
		return t
	case []any:
		t := ls.NewTable()
		for _, x := range v {
			t.Append(toLua(ls, x))
		}
		return t
	case string:
		return lua.LString(v)
	case bool:
		return lua.LBool(v)
	case int64:
		return lua.LNumber(v)
	case float64:
		return lua.LNumber(v)
	}
	return lua.LNil
}
