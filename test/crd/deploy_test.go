package crd_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// What `make deploy` applies must be accepted by a real API server, in both certificate modes.
// cert-manager's own kinds are left out: its CRDs are not installed here.
func TestKustomizationsWhenAppliedThenTheAPIServerAcceptsEveryObject(t *testing.T) {
	tier.Needs(t, "the test control plane")
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "sluice-system"}}
	if err := k8s.Create(context.Background(), ns); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for _, overlay := range []string{"config/default", "config/cert-manager"} {
		t.Run(overlay, func(t *testing.T) {
			cmd := exec.Command("go", "tool", "-modfile=hack/tools/go.mod", "kustomize", "build", overlay)
			cmd.Dir = testenv.RepoRoot()
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("kustomize build %s: %v", overlay, err)
			}
			dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
			kinds := map[string]bool{}
			certDir, injected := false, 0
			for {
				u := &unstructured.Unstructured{}
				if err := dec.Decode(&u.Object); err != nil {
					if errors.Is(err, io.EOF) {
						break
					}
					t.Fatal(err)
				}
				kinds[u.GetKind()] = true
				if u.GetKind() == "Deployment" {
					args, _, _ := unstructured.NestedSlice(u.Object, "spec", "template", "spec", "containers")
					certDir = strings.Contains(fmt.Sprint(args), "--webhook-cert-dir=")
				}
				if u.GetAnnotations()["cert-manager.io/inject-ca-from"] == "sluice-system/sluice-webhook-cert" {
					injected++
				}
				if u.GroupVersionKind().Group == "cert-manager.io" {
					continue
				}
				if err := k8s.Patch(context.Background(), u, client.Apply, client.FieldOwner("deploy-test"), client.DryRunAll, client.ForceOwnership); err != nil { //nolint:staticcheck // unstructured apply
					t.Errorf("%s %s: %v", u.GetKind(), u.GetName(), err)
				}
			}
			// Built-in certificates by default; cert-manager's mounted Secret and CA injection in
			// its overlay.
			if wantCM := overlay == "config/cert-manager"; certDir != wantCM || (injected == 1) != wantCM {
				t.Errorf("manager reads a cert dir: %v, configurations with CA injection: %d; want cert-manager mode %v", certDir, injected, wantCM)
			}
			if kinds["MutatingWebhookConfiguration"] {
				t.Errorf("%s installs a MutatingWebhookConfiguration: the spec must stay as the user wrote it", overlay)
			}
			for _, k := range []string{"CustomResourceDefinition", "Deployment", "ClusterRole", "Role", "ValidatingWebhookConfiguration", "Service"} {
				if !kinds[k] {
					t.Errorf("no %s in %s", k, overlay)
				}
			}
		})
	}
}
