package enforcer_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/test/testenv"
)

// A standalone policy file never passes through the API server: every policy that the schema or
// the webhook rejects, the enforcer's loader rejects too, naming the same field. The corpus is
// the one the CRD and webhook suites send to a real API server.
func TestLoadWhenPolicyIsInvalidThenRefusedNamingTheFieldAsTheAPIServerDoes(t *testing.T) {
	root := testenv.RepoRoot()
	cases := append(testenv.ReadInvalidCases(t, filepath.Join(root, "test", "testdata", "invalid")),
		testenv.ReadInvalidCases(t, filepath.Join(root, "webhook", "testdata", "invalid"))...)
	if len(cases) < 30 {
		t.Fatalf("found %d invalid policies, want at least 30", len(cases))
	}
	for _, c := range cases {
		t.Run(filepath.Base(c.File), func(t *testing.T) {
			data, err := os.ReadFile(c.File)
			if err != nil {
				t.Fatal(err)
			}
			_, err = enforcer.Load(data)
			if err == nil || !strings.Contains(err.Error(), c.Field) {
				t.Errorf("err = %v, want it to name %s (%s)", err, c.Field, c.Message)
			}
		})
	}
}
