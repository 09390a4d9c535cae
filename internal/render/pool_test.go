package render_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// readPool reads the EnforcerPool of a sample.
func readPool(t *testing.T, name string) *v1alpha1.EnforcerPool {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "config", "samples", name))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range strings.Split(string(data), "\n---\n") {
		if strings.Contains(d, "\nkind: EnforcerPool\n") {
			p := &v1alpha1.EnforcerPool{}
			if err := yaml.UnmarshalStrict([]byte(d), p); err != nil {
				t.Fatal(err)
			}
			p.Namespace, p.UID = "gateways", "1f1e1d1c-1b1a-1918-1716-151413121110"
			return p
		}
	}
	t.Fatalf("no EnforcerPool in %s", name)
	return nil
}

// The pool sample renders to the objects pinned in testdata: the pool's identity, Deployment,
// Service, budget and NetworkPolicy, and the ConfigMap of the policy that joins it, in the pool's
// namespace. Run with -update after an intended change and review the diff.
func TestPoolWhenTheSampleRendersThenObjectsMatchTheGoldenFile(t *testing.T) {
	pool := readPool(t, "pool.yaml")
	p := readSample(t, "pool.yaml")
	objs, err := render.PoolOf(pool, defaults).Objects(defaults, nil)
	if err != nil {
		t.Fatal(err)
	}
	cm, rev, err := render.PoolOf(pool, defaults).Config(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	var docs []string
	for _, o := range append(objs.All(), cm) {
		out, err := yaml.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, string(out))
	}
	got := strings.Join(docs, "---\n")
	golden := filepath.Join("testdata", "pool.golden.yaml")
	if *update {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run go test ./internal/render -update)", err)
	}
	if diff := cmp.Diff(string(want), got); diff != "" {
		t.Errorf("rendered objects differ from %s (-want +got):\n%s", golden, diff)
	}
	// The pool's enforcers load the ConfigMap with the loader of standalone files, and the
	// revision is the one the policy's own enforcer would report.
	if ps, warnings, err := enforcer.Load([]byte(cm.Data[report.PolicyFileKey])); err != nil || len(warnings) > 0 || len(ps) != 1 || ps[0].ID != "shop/reviews" {
		t.Errorf("the pool's enforcers cannot load the config cleanly: %v, warnings %q", err, warnings)
	}
	if own, _ := render.PolicyRevision(p); own != rev {
		t.Errorf("pooled revision %s, own %s: the same policy file must have one revision", rev, own)
	}
}

// The pool's enforcers may list and watch ConfigMaps of the pool's namespace and read nothing
// else: no Secret, no get by name of anything else, nothing cluster-wide (a Role, not a
// ClusterRole).
func TestPoolWhenRenderedThenItsRoleGrantsOnlyConfigMapsOfItsNamespace(t *testing.T) {
	objs, err := render.PoolOf(readPool(t, "pool.yaml"), defaults).Objects(defaults, nil)
	if err != nil {
		t.Fatal(err)
	}
	if objs.Role.Namespace != "gateways" || objs.RoleBinding.Namespace != "gateways" {
		t.Errorf("Role in %q, binding in %q, want the pool's namespace", objs.Role.Namespace, objs.RoleBinding.Namespace)
	}
	if len(objs.Role.Rules) != 1 {
		t.Fatalf("rules %+v, want one", objs.Role.Rules)
	}
	r := objs.Role.Rules[0]
	if !cmp.Equal(r.APIGroups, []string{""}) || !cmp.Equal(r.Resources, []string{"configmaps"}) || !cmp.Equal(r.Verbs, []string{"list", "watch"}) {
		t.Errorf("rule %+v, want list and watch on configmaps alone", r)
	}
	if sa := objs.Deployment.Spec.Template.Spec.ServiceAccountName; sa != objs.ServiceAccount.Name || objs.RoleBinding.Subjects[0].Name != sa {
		t.Errorf("pods run as %q, bound %q", sa, objs.RoleBinding.Subjects[0].Name)
	}
}

// A pool's pods are never selected by a policy's selectors, nor a policy's by a pool's, even
// when a pool and a policy share a name.
func TestPoolWhenAPolicyHasThePoolsNameThenTheirPodsAreApart(t *testing.T) {
	pool := readPool(t, "pool.yaml")
	p := readSample(t, "pool.yaml")
	p.Name, p.Spec.Enforcer = pool.Name, nil
	_, own := poolOfOne(t, p)
	pooled, err := render.PoolOf(pool, defaults).Objects(defaults, nil)
	if err != nil {
		t.Fatal(err)
	}
	matches := func(selector, labels map[string]string) bool {
		for k, v := range selector {
			if labels[k] != v {
				return false
			}
		}
		return true
	}
	if matches(own.Deployment.Spec.Selector.MatchLabels, pooled.Deployment.Spec.Template.Labels) ||
		matches(pooled.Deployment.Spec.Selector.MatchLabels, own.Deployment.Spec.Template.Labels) {
		t.Errorf("selectors overlap: policy %v, pool %v", own.Deployment.Spec.Selector.MatchLabels, pooled.Deployment.Spec.Selector.MatchLabels)
	}
	if render.PolicyOfPod(&pooled.Deployment.Spec.Template) != "" || render.PoolOfPod(&own.Deployment.Spec.Template) != "" {
		t.Error("a pool's pod is taken for a policy's, or a policy's for a pool's")
	}
	if render.PoolOfPod(&pooled.Deployment.Spec.Template) != pool.Name {
		t.Error("a pool's pod is not found as its")
	}
}

// Every pooled policy's ConfigMap has a name of its own, a valid object name, however long and
// however alike the names of pools, namespaces and policies.
func TestPoolConfigMapNameWhenNamesAreLongOrAlikeThenNamesStayValidAndApart(t *testing.T) {
	long := strings.Repeat("a", 250)
	seen := map[string]string{}
	for _, c := range [][3]string{
		{"x.y", "z", "w"}, {"x", "y", "z.w"}, {"x", "y.z", "w"},
		{long, "ns", "p"}, {long + "b", "ns", "p"}, {"pool", "ns", long}, {"pool", "ns", long + "c"},
	} {
		p := &v1alpha1.RateLimitPolicy{}
		p.Namespace, p.Name = c[1], c[2]
		name := render.PoolConfigMapName(c[0], p)
		if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
			t.Errorf("%v: %q is not an object name: %v", c, name, errs)
		}
		if other, dup := seen[name]; dup {
			t.Errorf("%v and %s share the ConfigMap %q", c, other, name)
		}
		seen[name] = strings.Join(c[:], "/")
	}
}
