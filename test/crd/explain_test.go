package crd_test

import (
	"github.com/sluice-dev/sluice/test/tier"

	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// kubectl explain prints the CRD's field docs, the API's doc comments: they must say what the
// code does. Run through the real kubectl against the real API server's OpenAPI.
func TestExplainWhenUsersReadTheFieldDocsThenTheySayWhatTheCodeDoes(t *testing.T) {
	tier.Needs(t, "the test control plane and kubectl")
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig); err != nil {
		t.Fatal(err)
	}
	explain := func(t *testing.T, field string) string {
		t.Helper()
		out, err := exec.Command(env.Kubectl(), "--kubeconfig", kubeconfig, "explain", field).CombinedOutput()
		if err != nil {
			t.Fatalf("kubectl explain %s: %v\n%s", field, err, out)
		}
		// Explanations are wrapped: read them as one line of words.
		return strings.Join(strings.Fields(string(out)), " ")
	}
	for _, c := range []struct {
		name, field   string
		want, notWant []string
	}{
		{
			name:    "when credentials are explained then they are mounted files, not environment variables",
			field:   "rlp.spec.storage.redis.credentialsSecretRef",
			want:    []string{"mounted into the enforcer pods as files"},
			notWant: []string{"reads it as environment variables"},
		},
		{
			name:  "when conditions are explained then all six types are named",
			field: "rlp.status.conditions",
			want:  []string{"Accepted", "Programmed", "Ready", "Degraded", "Reconciling", "Stalled"},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			out := explain(t, c.field)
			for _, w := range c.want {
				if !strings.Contains(out, w) {
					t.Errorf("kubectl explain %s does not say %q:\n%s", c.field, w, out)
				}
			}
			for _, w := range c.notWant {
				if strings.Contains(out, w) {
					t.Errorf("kubectl explain %s still says %q:\n%s", c.field, w, out)
				}
			}
		})
	}
}
