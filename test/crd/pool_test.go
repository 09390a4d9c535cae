package crd_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// The EnforcerPool's own CEL rules and bounds, each refused at the field it names.
func TestInvalidPoolsWhenCreatedThenRejectedNamingTheField(t *testing.T) {
	cases := testenv.ReadInvalidCases(t, filepath.Join(testenv.RepoRoot(), "test", "testdata", "invalid-pools"))
	if len(cases) < 6 {
		t.Fatalf("found %d invalid pools, want at least 6", len(cases))
	}
	ns := testenv.Namespace(t, k8s, "crd")
	for _, c := range cases {
		t.Run(filepath.Base(c.File), func(t *testing.T) {
			objs := testenv.ReadObjects(t, c.File)
			if len(objs) != 1 {
				t.Fatalf("want one pool per file, got %d", len(objs))
			}
			u := objs[0]
			u.SetNamespace(ns)
			testenv.RequireInvalid(t, k8s.Create(context.Background(), u), c.Field, c.Message)
		})
	}
}

// The edges the schema admits: a pool with nothing set (memory, one replica, its own namespace),
// each way to admit namespaces, and a policy that joins a pool with nothing else of the
// enforcer's set, in its own namespace or another.
func TestPoolsWhenValidThenAdmittedWithDefaults(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "crd")
	pools := []*v1alpha1.EnforcerPool{
		{ObjectMeta: metav1.ObjectMeta{Name: "bare"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "all"}, Spec: v1alpha1.EnforcerPoolSpec{
			Replicas:        ptr.To[int32](100),
			Storage:         &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{"redis:6379"}}},
			AllowedPolicies: &v1alpha1.AllowedPolicies{Namespaces: &v1alpha1.PolicyNamespaces{From: v1alpha1.NamespacesFromAll}},
		}},
		{ObjectMeta: metav1.ObjectMeta{Name: "selected.pool"}, Spec: v1alpha1.EnforcerPoolSpec{
			AllowedPolicies: &v1alpha1.AllowedPolicies{Namespaces: &v1alpha1.PolicyNamespaces{
				From: v1alpha1.NamespacesFromSelector, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"team": "shop"}}}},
		}},
		{ObjectMeta: metav1.ObjectMeta{Name: "same-by-default"}, Spec: v1alpha1.EnforcerPoolSpec{
			AllowedPolicies: &v1alpha1.AllowedPolicies{Namespaces: &v1alpha1.PolicyNamespaces{}},
		}},
	}
	for _, p := range pools {
		p.Namespace = ns
		if err := k8s.Create(ctx, p); err != nil {
			t.Fatalf("pool %s refused: %v", p.Name, err)
		}
	}
	got := &v1alpha1.EnforcerPool{}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "same-by-default"}, got); err != nil {
		t.Fatal(err)
	}
	if from := got.Spec.AllowedPolicies.Namespaces.From; from != v1alpha1.NamespacesFromSame {
		t.Errorf("allowedPolicies.namespaces.from = %q, want the schema's default Same", from)
	}
	for i, ref := range []v1alpha1.PoolRef{{Name: "bare"}, {Name: "selected.pool", Namespace: "gateways"}} {
		p := validPolicy(ns, "pooled-"+string(rune('a'+i)))
		p.Spec.Enforcer = &v1alpha1.EnforcerSpec{PoolRef: &ref}
		if err := k8s.Create(ctx, p); err != nil {
			t.Errorf("policy with poolRef %+v refused: %v", ref, err)
		}
	}
}

func TestPoolCRDWhenInstalledThenHasShortNameColumnsAndStatusSubresource(t *testing.T) {
	tier.Needs(t, "the test control plane")
	crd := &apiextensionsv1.CustomResourceDefinition{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: "enforcerpools.ratelimit.sluice.dev"}, crd); err != nil {
		t.Fatal(err)
	}
	// Not "ep": kubectl gives that to Endpoints.
	if diff := cmp.Diff([]string{"epool"}, crd.Spec.Names.ShortNames); diff != "" {
		t.Errorf("short names (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"sluice"}, crd.Spec.Names.Categories); diff != "" {
		t.Errorf("categories (-want +got):\n%s", diff)
	}
	if crd.Spec.Scope != apiextensionsv1.NamespaceScoped {
		t.Errorf("scope = %s, want Namespaced", crd.Spec.Scope)
	}
	v := crd.Spec.Versions[0]
	if v.Subresources == nil || v.Subresources.Status == nil {
		t.Error("no status subresource")
	}
	var columns []string
	for _, c := range v.AdditionalPrinterColumns {
		if c.Priority > 0 {
			columns = append(columns, c.Name+" (wide)")
		} else {
			columns = append(columns, c.Name)
		}
	}
	want := []string{"Ready", "Policies", "Refused", "Reason", "Age", "Storage (wide)", "Service (wide)"}
	if diff := cmp.Diff(want, columns); diff != "" {
		t.Errorf("printer columns (-want +got):\n%s", diff)
	}
}
