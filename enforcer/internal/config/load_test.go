package config_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/sluice-dev/sluice/enforcer/internal/config"
	"github.com/sluice-dev/sluice/internal/test/testenv"
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
			_, _, err = config.Load(data)
			if err == nil || !strings.Contains(err.Error(), c.Field) {
				t.Errorf("err = %v, want it to name %s (%s)", err, c.Field, c.Message)
			}
		})
	}
}

// Outside the API server the loader holds a file to the CRD's own schema: a value outside an
// enum is never read as the default (failureMode: closed as Open, an unknown path type as every
// path), and the amounts' and lists' bounds that the algorithms and Redis keys rely on hold.
func TestLoadWhenAFileBreaksTheSchemaThenTheFieldIsNamed(t *testing.T) {
	manyRules := ""
	for i := range 33 {
		manyRules += "    - {name: r" + strconv.Itoa(i) + ", fixedWindow: {limit: 5, window: 1s}}\n"
	}
	cases := []struct {
		name, spec, field string
	}{
		{"when a limit is zero then the limit is named", "  rules:\n    - {name: a, slidingLog: {limit: 0, window: 1s}}\n", "spec.rules[0].slidingLog.limit"},
		{"when failureMode is misspelt then failureMode is named", "  rules:\n    - {name: a, failureMode: closed, fixedWindow: {limit: 5, window: 1s}}\n", "spec.rules[0].failureMode"},
		{"when mode is unknown then mode is named", "  rules:\n    - {name: a, mode: Audit, fixedWindow: {limit: 5, window: 1s}}\n", "spec.rules[0].mode"},
		{"when the path type is unknown then the type is named", "  rules:\n    - {name: a, match: {path: {type: PathPrefix, value: /a}}, fixedWindow: {limit: 5, window: 1s}}\n", "spec.rules[0].match.path.type"},
		{"when a method is not a method then it is named", "  rules:\n    - {name: a, match: {methods: [GET, get]}, fixedWindow: {limit: 5, window: 1s}}\n", "spec.rules[0].match.methods[1]"},
		{"when a key type is unknown then it is named", "  rules:\n    - {name: a, key: [{type: ClientIP}], fixedWindow: {limit: 5, window: 1s}}\n", "spec.rules[0].key[0].type"},
		{"when a rule name is not a DNS label then the name is named", "  rules:\n    - {name: Burst Limit, fixedWindow: {limit: 5, window: 1s}}\n", "spec.rules[0].name"},
		{"when a limit is over a billion then the limit is named", "  rules:\n    - {name: a, fixedWindow: {limit: 5000000000, window: 1s}}\n", "spec.rules[0].fixedWindow.limit"},
		{"when a queue is over a million then the capacity is named", "  rules:\n    - {name: a, leakyBucket: {capacity: 2000000, drain: {requests: 1, period: 1s}}}\n", "spec.rules[0].leakyBucket.capacity"},
		{"when there are 33 rules then rules is named", "  rules:\n" + manyRules, "spec.rules"},
		{"when defaultFailureMode is misspelt then it is named", "  defaultFailureMode: closed\n  rules:\n    - {name: a, fixedWindow: {limit: 5, window: 1s}}\n", "spec.defaultFailureMode"},
		{"when the metadata name is not a name then it is named", "  rules:\n    - {name: a, fixedWindow: {limit: 5, window: 1s}}\n", "metadata.name"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			name := "api"
			if c.field == "metadata.name" {
				name = "Not_A_Name"
			}
			doc := "apiVersion: ratelimit.sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: " + name + ", namespace: shop}\nspec:\n  targetRef: {name: api, port: 80}\n" + c.spec
			_, _, err := config.Load([]byte(doc))
			if err == nil || !strings.Contains(err.Error(), c.field+":") {
				t.Errorf("err = %v, want it to name %s", err, c.field)
			}
		})
	}
}

// A file made for kubectl loads as it is: documents of other kinds are skipped and spec.storage
// is ignored, each said in a warning (the store comes from flags), never in silence. A
// RateLimitPolicy of a version the enforcer cannot read is refused, and a file of no policy too.
func TestLoadWhenAFileHoldsOtherKindsOrAStorageThenTheyAreSkippedWithAWarning(t *testing.T) {
	policy := "apiVersion: ratelimit.sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: api, namespace: shop}\nspec:\n  targetRef: {name: api, port: 80}\n" +
		"  storage: {redis: {addresses: [\"redis:6379\"]}}\n  rules:\n    - {name: a, fixedWindow: {limit: 5, window: 1s}}\n"
	service := "apiVersion: v1\nkind: Service\nmetadata: {name: api}\nspec: {ports: [{port: 80}]}\n"
	deployment := "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: api}\n"
	ps, warnings, err := config.Load([]byte(service + "---\n" + policy + "---\n" + deployment))
	if err != nil || len(ps) != 1 || ps[0].ID != "shop/api" {
		t.Fatalf("Load = %v, %v, want the one policy", ps, err)
	}
	want := []string{
		"document 1: skipped v1 Service: not a RateLimitPolicy",
		"policy shop/api: spec.storage ignored: an enforcer takes its store from flags",
		"document 3: skipped apps/v1 Deployment: not a RateLimitPolicy",
	}
	if len(warnings) != len(want) {
		t.Fatalf("warnings %q, want %q", warnings, want)
	}
	for i := range want {
		if !strings.HasPrefix(warnings[i], want[i]) {
			t.Errorf("warning %d = %q, want it to start %q", i, warnings[i], want[i])
		}
	}
	for name, doc := range map[string]string{
		"another version of the kind": strings.Replace(policy, "v1alpha1", "v1beta1", 1),
		"only other kinds":            service + "---\n" + deployment,
		"a policy with no apiVersion": strings.Replace(policy, "apiVersion: ratelimit.sluice.dev/v1alpha1\n", "", 1),
	} {
		if _, _, err := config.Load([]byte(doc)); err == nil {
			t.Errorf("%s: loaded, want refused", name)
		}
	}
}

// The target's TLS server name is taken at 253 bytes, its bound, as the schema says; one more
// is refused (test/testdata/invalid/target-server-name-over-253.yaml).
func TestLoadWhenTheTargetServerNameIsAtItsBoundThenAccepted(t *testing.T) {
	doc := `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: edge, namespace: test}
spec:
  targetRef: {name: api, port: 443, appProtocol: https, tls: {serverName: ` + strings.Repeat("a", 253) + `, caSecretRef: {name: ca, key: ca.crt}}}
  rules:
    - name: a
      fixedWindow: {limit: 10, window: 1s}
`
	if _, _, err := config.Load([]byte(doc)); err != nil {
		t.Fatalf("a 253-byte server name: %v, want it accepted", err)
	}
}
