package crd_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// The samples apply together, as `kubectl apply -f config/samples/` applies them into one
// namespace, with no two policies on one Service (the later would be Conflicted), and each says
// in its opening comment, on a line that begins "Needs:", what it needs that it does not carry:
// the Services its policies target, the Secrets they name, and a Redis when its storage names one.
func TestSamplesWhenAppliedTogetherThenNoTwoTargetOneServiceAndEachSaysWhatItNeeds(t *testing.T) {
	ns := testenv.Namespace(t, k8s, "samples")
	ctx := context.Background()
	targets := map[string]string{} // target Service -> sample
	for _, file := range testenv.Samples(t) {
		name := filepath.Base(file)
		objs := testenv.ReadObjects(t, file)
		needs := needsOf(t, file)
		carried := map[string]bool{}
		for _, u := range objs {
			carried[u.GetKind()+" "+u.GetName()] = true
		}
		for _, u := range objs {
			u.SetNamespace(ns)
			if err := k8s.Patch(ctx, u, client.Apply, client.FieldOwner("test"), client.ForceOwnership); err != nil { //nolint:staticcheck // unstructured apply
				t.Fatalf("%s: apply %s %s: %v", name, u.GetKind(), u.GetName(), err)
			}
			for _, need := range needed(t, u) {
				if !carried[need] && !strings.Contains(needs, need) {
					t.Errorf("%s: its Needs line does not name the %s it needs: %q", name, need, needs)
				}
			}
			if u.GroupVersionKind() != testenv.GVK {
				continue
			}
			target, _, _ := unstructured.NestedString(u.Object, "spec", "targetRef", "name")
			if other, ok := targets[target]; ok {
				t.Errorf("%s and %s both target the Service %s: applied together, the later is Conflicted", other, name, target)
			}
			targets[target] = name
		}
	}
	var list v1alpha1.RateLimitPolicyList
	if err := k8s.List(ctx, &list, client.InNamespace(ns)); err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != len(targets) {
		t.Errorf("%d policies in the namespace, want the %d of the samples", len(list.Items), len(targets))
	}
}

// needsOf is what a sample's opening comment says it needs: its line that begins "Needs:" and
// the comment lines that go on from it.
func needsOf(t *testing.T, file string) string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var needs []string
	for _, line := range strings.Split(string(data), "\n") {
		text, comment := strings.CutPrefix(line, "# ")
		if !comment {
			break
		}
		if strings.HasPrefix(text, "Needs:") || len(needs) > 0 {
			needs = append(needs, text)
		}
	}
	if len(needs) == 0 {
		t.Errorf("%s: no opening comment line says what it Needs:", filepath.Base(file))
	}
	return strings.Join(needs, " ")
}

// needed is what a sample object needs beside it, as its Needs line names it: "Service <name>"
// for a policy's target, "Secret <name>" for every Secret it names, "Redis" for a storage.redis.
func needed(t *testing.T, u *unstructured.Unstructured) []string {
	t.Helper()
	var storage *v1alpha1.Storage
	var out []string
	switch u.GetKind() {
	case "RateLimitPolicy":
		p := &v1alpha1.RateLimitPolicy{}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, p); err != nil {
			t.Fatal(err)
		}
		out = append(out, "Service "+p.Spec.TargetRef.Name)
		if tls := p.Spec.TargetRef.TLS; tls != nil && tls.CASecretRef != nil {
			out = append(out, "Secret "+tls.CASecretRef.Name)
		}
		if tls := p.Spec.TargetRef.TLS; tls != nil && tls.ClientCertificateSecretRef != nil {
			out = append(out, "Secret "+tls.ClientCertificateSecretRef.Name)
		}
		storage = p.Spec.Storage
	case "EnforcerPool":
		pool := &v1alpha1.EnforcerPool{}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, pool); err != nil {
			t.Fatal(err)
		}
		storage = pool.Spec.Storage
	}
	if storage == nil || storage.Redis == nil {
		return out
	}
	out = append(out, "Redis")
	if ref := storage.Redis.CredentialsSecretRef; ref != nil {
		out = append(out, "Secret "+ref.Name)
	}
	if tls := storage.Redis.TLS; tls != nil && tls.CASecretRef != nil {
		out = append(out, "Secret "+tls.CASecretRef.Name)
	}
	return out
}
