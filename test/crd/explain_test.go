package crd_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/tier"
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
		// The API server publishes a new CRD's OpenAPI a moment after the CRD is established.
		var out []byte
		var err error
		_ = poll.Until(30*time.Second, func() error {
			out, err = exec.Command(env.Kubectl(), "--kubeconfig", kubeconfig, "explain", field).CombinedOutput()
			if err == nil || !strings.Contains(string(out), "couldn't find resource") {
				return nil
			}
			return err
		}) // on a timeout, the last answer fails the test below
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
			name:  "when the target's appProtocol is explained then each protocol and the default are named",
			field: "rlp.spec.targetRef.appProtocol",
			want:  []string{"http (HTTP/1.1 in cleartext", "https (TLS", "HTTP/2 when the port offers it by ALPN", "h2c (cleartext HTTP/2 with prior knowledge", "Absent means the Service port's appProtocol", "and else http"},
		},
		{
			name:  "when the target's TLS is explained then the CA Secret is mounted and the default name is the Service's",
			field: "rlp.spec.targetRef.tls",
			want:  []string{"mounted into the enforcer pods", "NAME.NAMESPACE.svc"},
		},
		{
			name:    "when credentials are explained then they are mounted files, not environment variables",
			field:   "rlp.spec.storage.redis.credentialsSecretRef",
			want:    []string{"mounted into the enforcer pods as files"},
			notWant: []string{"reads it as environment variables"},
		},
		{
			name:  "when bypass protection is explained then its consequences and needs are said",
			field: "rlp.spec.targetRef.bypassProtection",
			want: []string{"All other traffic to those pods on that port stops", "needs a network plugin that enforces NetworkPolicy",
				"a numeric targetPort", "allowedSources"},
		},
		{
			name:  "when the managed Redis is explained then its password, budget and what it loses are said",
			field: "rlp.spec.storage.managedRedis",
			want:  []string{"password that the manager generates once", "PodDisruptionBudget", "without persistence", "fail-open rules admit every request"},
		},
		{
			name:    "when a rule's cost, mode and path type are explained then their defaults are the description's, not the schema's",
			field:   "rlp.spec.rules.cost",
			want:    []string{"Defaults to 1"},
			notWant: []string{"default: 1", "DEFAULT"},
		},
		{
			name:    "when a rule's mode is explained then its default is the description's",
			field:   "rlp.spec.rules.mode",
			want:    []string{"Defaults to Enforce"},
			notWant: []string{"default: Enforce"},
		},
		{
			name:    "when a path match's type is explained then its default is the description's",
			field:   "rlp.spec.rules.match.path.type",
			want:    []string{"Defaults to Prefix"},
			notWant: []string{"default: Prefix"},
		},
		// kubectl explain prints no schema default: the descriptions of the fields that have one
		// name it.
		{name: "when defaultFailureMode is explained then its default is named", field: "rlp.spec.defaultFailureMode", want: []string{"Defaults to Open"}},
		{name: "when the Redis mode is explained then its default is named", field: "rlp.spec.storage.redis.mode", want: []string{"Defaults to Standalone"}},
		{name: "when the Redis timeout is explained then its default is named", field: "rlp.spec.storage.redis.timeout", want: []string{"Defaults to 50ms"}},
		{name: "when passwordKey is explained then its default is named", field: "rlp.spec.storage.redis.credentialsSecretRef.passwordKey", want: []string{"Defaults to password"}},
		{name: "when a managed Redis's maxMemory is explained then its default is named", field: "rlp.spec.storage.managedRedis.maxMemory", want: []string{"Defaults to 256Mi"}},
		{
			name:  "when memory storage is explained then what it does not keep is said",
			field: "rlp.spec.storage.memory",
			want:  []string{"Exact only with one enforcer replica", "at most 1,000,000 keys and 128 MiB", "none across a restart", "while a rollout runs"},
		},
		{
			name:    "when the sliding log is explained then its memory is per admitted request",
			field:   "rlp.spec.rules.slidingLog",
			want:    []string{"one entry each whatever its cost", "limit is at most 10000"},
			notWant: []string{"bytes per unit"},
		},
		{
			name:  "when a concurrency rule is explained then its slots, leases, refusal and front ends are said",
			field: "rlp.spec.rules.concurrency",
			want: []string{"at most limit requests of a client in flight at once", "until its response ends", "every third of leaseTimeout",
				"frees their slots within leaseTimeout", "Retry-After: 1, which promises no time", "skip the rule and count it as skipped"},
		},
		{name: "when a lease timeout is explained then its bounds and default are named", field: "rlp.spec.rules.concurrency.leaseTimeout",
			want: []string{"From 1s to 1h", "Defaults to 30s"}},
		{name: "when a concurrency limit is explained then its bound is named", field: "rlp.spec.rules.concurrency.limit", want: []string{"At most 10000"}},
		{
			name:  "when charge is explained then the response, its statuses and the overshoot are said",
			field: "rlp.spec.rules.charge",
			want:  []string{"when Response, once its response ends", `"5xx"`, "checked before the request is forwarded", "at most that many beyond the limit", "skip such a rule"},
		},
		{name: "when charge.when is explained then why it is not on is said", field: "rlp.spec.rules.charge.when", want: []string{"Not \"on\"", "YAML 1.1"}},
		{name: "when charged statuses are explained then codes, classes and the default are said", field: "rlp.spec.rules.charge.statuses",
			want: []string{`"401"`, `"5xx"`, "Absent: every response"}},
		{
			name:  "when costFrom is explained then the field, its bounds and what an invalid value costs are said",
			field: "rlp.spec.rules.costFrom",
			want:  []string{"response header or trailer", "a larger one is charged as max", "is charged cost instead, and counted", "takes it to exhaustion"},
		},
		{name: "when costFrom.max is explained then its bound is named", field: "rlp.spec.rules.costFrom.max", want: []string{"At most the rule's capacity or limit"}},
		{
			name:  "when a lease is explained then its early refusals, exactness, algorithms, memory and a killed enforcer's units are said",
			field: "rlp.spec.rules.lease",
			want: []string{"decide from them locally", "up to max-1 of the client's units unused", "never more than the limit is admitted across enforcer replicas",
				"tokenBucket and fixedWindow only", "On memory storage every decision is local already", "on a fixed window they count until the window ends",
				"stop counting against the bucket at the lease's expiry and refill from then"},
		},
		{name: "when a lease's max is explained then its bounds are named", field: "rlp.spec.rules.lease.max",
			want: []string{"From 2 to 1000000", "at most the rule's capacity or limit"}},
		{name: "when a lease's expiry is explained then its bounds and default are named", field: "rlp.spec.rules.lease.expiry",
			want: []string{"From 100ms to 1m", "Defaults to 1s"}},
		{name: "when a rule's skipped count is explained then the front ends are named", field: "rlp.status.rules.skipped", want: []string{"check API", "rate limit service"}},
		{name: "when a rule's charged count is explained then it is the responses", field: "rlp.status.rules.charged", want: []string{"responses the rule charged"}},
		{
			name:  "when conditions are explained then all six types are named",
			field: "rlp.status.conditions",
			want:  []string{"Accepted", "Programmed", "Ready", "Degraded", "Reconciling", "Stalled"},
		},
		{
			name:  "when the RULES column's field is explained then it says what happens past its bound",
			field: "rlp.status.ruleNames",
			want:  []string{"RULES column of kubectl get", "at most 64 characters", `"+N more" for the N rules left out`},
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

// The RULES column of kubectl get counts the rules past 64 characters (controllers' kubectl
// test), so README gives the command that lists every rule. Through the real kubectl.
func TestKubectlGetWhenAPolicyHasSeveralRulesThenTheREADMECommandListsThemAll(t *testing.T) {
	tier.Needs(t, "the test control plane and kubectl")
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig); err != nil {
		t.Fatal(err)
	}
	key := []v1alpha1.KeySource{{Type: v1alpha1.KeyRemoteAddress}}
	p := &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "three-rules"},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080},
			Rules: []v1alpha1.Rule{
				{Name: "burst", Key: key, FixedWindow: &v1alpha1.Window{Limit: 10, Window: "1s"}},
				{Name: "per-minute", Key: key, FixedWindow: &v1alpha1.Window{Limit: 100, Window: "1m"}},
				{Name: "per-hour", Key: key, FixedWindow: &v1alpha1.Window{Limit: 1000, Window: "1h"}},
			},
		},
	}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), p) })
	kubectl := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(env.Kubectl(), append([]string{"--kubeconfig", kubeconfig, "-n", "default"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	if got := kubectl("get", "rlp", "three-rules", "-o", "jsonpath={.spec.rules[*].name}"); got != "burst per-minute per-hour" {
		t.Errorf("kubectl get rlp -o jsonpath='{.spec.rules[*].name}': %q, want every rule", got)
	}
}
