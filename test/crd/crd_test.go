// Package crd_test proves the RateLimitPolicy schema on a real kube-apiserver: samples are
// accepted, invalid policies are rejected by their CEL rules with human messages, and the
// status subresource, printer columns, short name and server-side apply behave as designed.
package crd_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

var (
	k8s client.Client
	env *testenv.Env
)

func TestMain(m *testing.M) {
	flag.Parse()
	tier.RunFast(m)
	var err error
	// kube-controller-manager's ClusterRole aggregation fills the built-in roles for the RBAC
	// test.
	env, err = testenv.Start(testenv.WithControllers("clusterrole-aggregation-controller"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := apiextensionsv1.AddToScheme(clientgoscheme.Scheme); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	k8s = env.Client
	code := m.Run()
	if err := env.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	os.Exit(code)
}

func TestSamplesWhenAppliedThenAcceptedWithDefaults(t *testing.T) {
	files := testenv.Samples(t)
	ns := testenv.Namespace(t, k8s, "crd")
	ctx := context.Background()
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			for _, u := range testenv.ReadObjects(t, file) {
				if u.GroupVersionKind() != testenv.GVK {
					continue
				}
				u.SetNamespace(ns)
				written := u.DeepCopy()
				if err := k8s.Patch(ctx, u, client.Apply, client.FieldOwner("test"), client.ForceOwnership); err != nil { //nolint:staticcheck // unstructured apply
					t.Fatalf("apply %s: %v", u.GetName(), err)
				}
				got := &v1alpha1.RateLimitPolicy{}
				if err := k8s.Get(ctx, client.ObjectKeyFromObject(u), got); err != nil {
					t.Fatal(err)
				}
				// Defaults inside rules are applied when the policy is compiled, never stored: a
				// stored default in a list item makes every client-side kubectl apply a change.
				for i, r := range got.Spec.Rules {
					if w := testenv.RuleOf(t, written, i); (r.Cost == nil) != (w["cost"] == nil) || (r.Mode == "") != (w["mode"] == nil) {
						t.Errorf("rule %s: cost %v, mode %q; want them as written: %v", r.Name, r.Cost, r.Mode, w)
					}
				}
				if got.Spec.DefaultFailureMode == "" {
					t.Error("defaultFailureMode not defaulted")
				}
			}
		})
	}
}

func TestInvalidPoliciesWhenCreatedThenRejectedNamingTheField(t *testing.T) {
	cases := testenv.ReadInvalidCases(t, filepath.Join(testenv.RepoRoot(), "test", "testdata", "invalid"))
	if len(cases) < 15 {
		t.Fatalf("found %d invalid policies, want at least 15", len(cases))
	}
	ns := testenv.Namespace(t, k8s, "crd")
	for _, c := range cases {
		t.Run(filepath.Base(c.File), func(t *testing.T) {
			objs := testenv.ReadObjects(t, c.File)
			if len(objs) != 1 {
				t.Fatalf("want one policy per file, got %d", len(objs))
			}
			u := objs[0]
			u.SetNamespace(ns)
			testenv.RequireInvalid(t, k8s.Create(context.Background(), u), c.Field, c.Message)
		})
	}
}

func TestCRDWhenInstalledThenHasShortNameColumnsAndStatusSubresource(t *testing.T) {
	tier.Needs(t, "the test control plane")
	crd := &apiextensionsv1.CustomResourceDefinition{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: "ratelimitpolicies.ratelimit.sluice.dev"}, crd); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"rlp"}, crd.Spec.Names.ShortNames); diff != "" {
		t.Errorf("short names (-want +got):\n%s", diff)
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
	want := []string{"Target", "Rules", "Ready", "Limited", "Reason", "Store", "Age", "Storage (wide)", "Revision (wide)"}
	if diff := cmp.Diff(want, columns); diff != "" {
		t.Errorf("printer columns (-want +got):\n%s", diff)
	}
}

func validPolicy(ns, name string) *v1alpha1.RateLimitPolicy {
	return &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080},
			Rules: []v1alpha1.Rule{{
				Name:        "a",
				FixedWindow: &v1alpha1.Window{Limit: 10, Window: "1s"},
			}},
		},
	}
}

func TestStatusWhenWrittenThroughMainResourceThenIgnoredAndThroughSubresourceThenKept(t *testing.T) {
	ctx := context.Background()
	p := validPolicy(testenv.Namespace(t, k8s, "crd"), "status")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	p.Status.ObservedGeneration = 7
	if err := k8s.Update(ctx, p); err != nil {
		t.Fatal(err)
	}
	if p.Status.ObservedGeneration != 0 {
		t.Errorf("status written through the main resource: observedGeneration = %d", p.Status.ObservedGeneration)
	}
	p.Status.ObservedGeneration = 7
	p.Status.Conditions = []metav1.Condition{{
		Type: v1alpha1.ConditionReady, Status: metav1.ConditionFalse, Reason: v1alpha1.ReasonRollingOut,
		Message: "waiting", LastTransitionTime: metav1.Now(),
	}}
	if err := k8s.Status().Update(ctx, p); err != nil {
		t.Fatal(err)
	}
	got := &v1alpha1.RateLimitPolicy{}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(p), got); err != nil {
		t.Fatal(err)
	}
	if got.Status.ObservedGeneration != 7 || len(got.Status.Conditions) != 1 {
		t.Errorf("status after subresource update = %+v", got.Status)
	}
}

// Rules are a map list keyed by name, so two appliers can own different rules of one policy.
func TestRulesWhenAppliedByTwoManagersThenMergedByName(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "crd")
	apply := func(owner string, rule map[string]any) {
		t.Helper()
		u := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": v1alpha1.GroupVersion.String(), "kind": "RateLimitPolicy",
			"metadata": map[string]any{"name": "merged", "namespace": ns},
			"spec": map[string]any{
				"targetRef": map[string]any{"name": "api", "port": int64(8080)},
				"rules":     []any{rule},
			},
		}}
		if err := k8s.Patch(ctx, u, client.Apply, client.FieldOwner(owner)); err != nil { //nolint:staticcheck // unstructured apply
			t.Fatalf("apply as %s: %v", owner, err)
		}
	}
	apply("team-a", map[string]any{"name": "a", "fixedWindow": map[string]any{"limit": int64(10), "window": "1s"}})
	apply("team-b", map[string]any{"name": "b", "slidingLog": map[string]any{"limit": int64(5), "window": "1m"}})

	got := &v1alpha1.RateLimitPolicy{}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "merged"}, got); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range got.Spec.Rules {
		names = append(names, r.Name)
	}
	if diff := cmp.Diff([]string{"a", "b"}, names); diff != "" {
		t.Errorf("rule names (-want +got):\n%s", diff)
	}
}

// Durations in the schema are the ones Go parses the same way.
func TestDurationWhenAcceptedByTheSchemaThenParsesInGo(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "crd")
	for i, d := range []v1alpha1.Duration{"1ms", "500ms", "1m30s", "720h", "1h1m1s1ms"} {
		p := validPolicy(ns, fmt.Sprintf("d%d", i))
		p.Spec.Rules[0].FixedWindow.Window = d
		p.Spec.Rules[0].Cost = ptr.To[int64](1)
		if err := k8s.Create(ctx, p); err != nil {
			t.Errorf("window %q rejected: %v", d, err)
			continue
		}
		if _, err := d.Parse(); err != nil {
			t.Errorf("window %q accepted by the schema but not by Go: %v", d, err)
		}
	}
}

// What a user reads when admission refuses a policy: a field left out is "Required value" at
// that field, also when a typed Go client sends the struct's zero values; a duration in the
// milliseconds the API documents is accepted up to its bound; one wrong value is reported once.
func TestAdmissionMessagesWhenAPolicyIsIncompleteOrWrongThenEachFieldIsNamedOnceAsUsersExpect(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "messages")
	causes := func(err error) map[string][]string {
		t.Helper()
		var status apierrors.APIStatus
		if !errors.As(err, &status) || status.Status().Details == nil {
			t.Fatalf("got %v, want an Invalid error with causes", err)
		}
		out := map[string][]string{}
		for _, c := range status.Status().Details.Causes {
			if c.Field != "" && c.Field != "<nil>" {
				out[c.Field] = append(out[c.Field], c.Message)
			}
		}
		return out
	}

	empty := &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "empty"}}
	got := causes(k8s.Create(ctx, empty, client.DryRunAll))
	want := map[string][]string{"spec.targetRef.name": {"Required value"}, "spec.targetRef.port": {"Required value"}, "spec.rules": {"Required value"}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("a typed client's empty policy (-want +got):\n%s", diff)
	}

	withWindow := func(window string) *v1alpha1.RateLimitPolicy {
		return &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "ms"}, Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "api", Port: 80},
			Rules:     []v1alpha1.Rule{{Name: "a", FixedWindow: &v1alpha1.Window{Limit: 5, Window: v1alpha1.Duration(window)}}},
		}}
	}
	for _, w := range []string{"100000ms", "2592000000ms", "1h100000ms"} {
		if err := k8s.Create(ctx, withWindow(w), client.DryRunAll); err != nil {
			t.Errorf("window %s: %v, want accepted", w, err)
		}
	}
	got = causes(k8s.Create(ctx, withWindow("2592000001ms"), client.DryRunAll))
	if m := got["spec.rules[0].fixedWindow.window"]; len(m) != 1 || !strings.Contains(m[0], "at most 720h") {
		t.Errorf("a window over 720h: %v, want one message at the window saying at most 720h", got)
	}

	wrong := withWindow("1s")
	wrong.Spec.DefaultFailureMode = "closed"
	got = causes(k8s.Create(ctx, wrong, client.DryRunAll))
	if len(got) != 1 || len(got["spec.defaultFailureMode"]) != 1 {
		t.Errorf("a misspelt defaultFailureMode: %v, want one message, at spec.defaultFailureMode", got)
	}
}

// A misspelt field is refused as the unknown field it is, by the API server under kubectl's
// strict field validation and by the standalone enforcer's loader alike, and not as the field it
// left out ("capacity: Required value" for a "capcity").
func TestUnknownFieldsWhenCreatedStrictlyThenTheLoaderNamesThemAsTheAPIServerDoes(t *testing.T) {
	tier.Needs(t, "the test control plane")
	ns := testenv.Namespace(t, k8s, "crd")
	cases := []struct{ name, doc, field string }{
		{"a misspelt capacity", "spec:\n  targetRef: {name: api, port: 80}\n  rules:\n    - {name: a, tokenBucket: {capcity: 5, refill: {tokens: 1, period: 1s}}}\n", "spec.rules[0].tokenBucket.capcity"},
		{"a field beside the rules", "spec:\n  targetRef: {name: api, port: 80}\n  rule: []\n  rules:\n    - {name: a, fixedWindow: {limit: 5, window: 1s}}\n", "spec.rule"},
		{"a field of the status", "spec:\n  targetRef: {name: api, port: 80}\n  rules:\n    - {name: a, fixedWindow: {limit: 5, window: 1s}}\nstatus: {enforced: true}\n", "status.enforced"},
		{"a field of the metadata", "spec:\n  targetRef: {name: api, port: 80}\n  rules:\n    - {name: a, fixedWindow: {limit: 5, window: 1s}}\n", "metadata.label"},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			meta := fmt.Sprintf("metadata:\n  name: unknown-%d\n  namespace: %s\n", i, ns)
			if c.field == "metadata.label" {
				meta += "  label: {a: b}\n"
			}
			doc := "apiVersion: ratelimit.sluice.dev/v1alpha1\nkind: RateLimitPolicy\n" + meta + c.doc
			u := &unstructured.Unstructured{}
			if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
				t.Fatal(err)
			}
			want := fmt.Sprintf("unknown field %q", c.field)
			err := k8s.Create(context.Background(), u, client.FieldValidation(metav1.FieldValidationStrict))
			if !apierrors.IsBadRequest(err) || !strings.Contains(err.Error(), want) {
				t.Fatalf("the API server: %v, want BadRequest with %s", err, want)
			}
			_, _, err = enforcer.Load([]byte(doc))
			if err == nil || !strings.Contains(err.Error(), "strict decoding error: "+want) || strings.Contains(err.Error(), "Required") {
				t.Errorf("the loader: %v, want the strict decoding error %s alone, as the API server says", err, want)
			}
		})
	}
}
