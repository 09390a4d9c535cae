package node_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/poll"
)

// TestStatusWhenAPodCannotRunThenReadyNamesItsCause runs policies whose enforcer pods cannot run,
// each for a cause only a real node gives, and reads what their status and kubectl say.
func TestStatusWhenAPodCannotRunThenReadyNamesItsCause(t *testing.T) {
	installSluice(t)
	ns := namespace(t, "causes", true)
	apply(t, echo(ns, "api", 1))
	apply(t, `apiVersion: v1
kind: Secret
metadata: {name: not-a-ca, namespace: `+ns+`}
stringData: {ca.crt: "not a certificate"}
`)
	cases := []struct {
		name, spec string
		// reason is Ready's; message what its message must hold.
		reason  string
		message []string
	}{{
		name:    "missing-secret",
		spec:    `storage: {redis: {addresses: ["10.88.0.1:1"], credentialsSecretRef: {name: absent}}}`,
		reason:  v1alpha1.ReasonContainerConfigError,
		message: []string{`secret "absent" not found`},
	}, {
		name:    "unpullable",
		spec:    `enforcer: {image: sluice.test/absent:1}`,
		reason:  v1alpha1.ReasonImagePullFailed,
		message: []string{"sluice.test/absent:1"},
	}, {
		name:    "crashing",
		spec:    `storage: {redis: {addresses: ["10.88.0.1:1"], tls: {caSecretRef: {name: not-a-ca, key: ca.crt}}}}`,
		reason:  v1alpha1.ReasonCrashLooping,
		message: []string{"CrashLoopBackOff", "last exited with code 2", "no PEM certificate found"},
	}, {
		name:    "unschedulable",
		spec:    `enforcer: {resources: {requests: {cpu: "64"}}}`,
		reason:  v1alpha1.ReasonUnschedulable,
		message: []string{"Unschedulable", "Insufficient cpu"},
	}}
	// One Service each, all in front of the echo pods: two policies on one Service conflict.
	for _, c := range cases {
		apply(t, fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: %[2]s, namespace: %[1]s}
spec:
  selector: {app: api}
  ports: [{name: http, port: 80, targetPort: http}]
`, ns, c.name))
		apply(t, policyYAML(ns, c.name, c.name, c.spec))
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var ready *metav1.Condition
			poll.WaitFor(t, 3*time.Minute, func() error {
				p := policy(t, ns, c.name)
				ready = meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
				if ready == nil || ready.Reason != c.reason {
					return fmt.Errorf("Ready %+v, want reason %s%s", ready, c.reason, podStates(ns))
				}
				for _, m := range c.message {
					if !strings.Contains(ready.Message, m) {
						return fmt.Errorf("Ready's message %q does not hold %q", ready.Message, m)
					}
				}
				return nil
			})
			// kubectl shows the reason of the first failing condition.
			out, err := cluster.Kubectl(context.Background(), nil, "get", "rlp", c.name, "-n", ns, "--no-headers", "-o", "custom-columns=REASON:.status.reason")
			if err != nil || strings.TrimSpace(string(out)) != c.reason {
				t.Errorf("kubectl get rlp %s: REASON %q (%v), want %s", c.name, out, err, c.reason)
			}
		})
	}
}

// TestStatusWhenTheStoreIsUnreachableThenDegradedShowsItWhateverElseFails runs a policy whose
// Redis does not answer and whose target does not exist: Degraded tells of the store, which the
// missing target does not hide, and kubectl's STORE column says it too.
func TestStatusWhenTheStoreIsUnreachableThenDegradedShowsItWhateverElseFails(t *testing.T) {
	installSluice(t)
	ns := namespace(t, "dead-store", true)
	apply(t, policyYAML(ns, "dead-store", "absent", `storage: {redis: {addresses: ["10.88.0.1:1"]}}`))
	poll.WaitFor(t, 3*time.Minute, func() error {
		p := policy(t, ns, "dead-store")
		d := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionDegraded)
		if d == nil || d.Status != metav1.ConditionTrue || d.Reason != v1alpha1.ReasonRedisUnreachable {
			return fmt.Errorf("Degraded %+v, want True RedisUnreachable%s", d, podStates(ns))
		}
		if !strings.Contains(d.Message, "absent") {
			return fmt.Errorf("Degraded's message %q does not also tell of the missing target", d.Message)
		}
		if p.Status.Enforcer == nil || p.Status.Enforcer.StoreHealth == "" || p.Status.Enforcer.StoreHealth == "Connected" {
			return fmt.Errorf("status.enforcer %+v: want the store's failure in storeHealth", p.Status.Enforcer)
		}
		return nil
	})
	out, err := cluster.Kubectl(context.Background(), nil, "get", "rlp", "dead-store", "-n", ns)
	if err != nil || !strings.Contains(string(out), "STORE") || strings.Contains(string(out), "Connected") {
		t.Errorf("kubectl get rlp:\n%s%v\nwant a STORE column that does not say Connected", out, err)
	}
}

// policyYAML is a policy on target with one rule and spec's further fields (one line of flow YAML
// each).
func policyYAML(ns, name, target, spec string) string {
	return fmt.Sprintf(`apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: %s, namespace: %s}
spec:
  targetRef: {name: %s, port: 80}
  rules:
  - name: per-client
    tokenBucket: {capacity: 5, refill: {tokens: 1, period: 1s}}
    key: [{type: RemoteAddress}]
  %s
`, name, ns, target, spec)
}

// installSluice installs the chart with the node's images, unless it is installed, and uninstalls
// it when the test ends.
func installSluice(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	if _, err := runHelm(ctx, "status", release, "--namespace", system); err == nil {
		return
	}
	if out, err := runHelm(ctx, "install", release, "charts/sluice", "--namespace", system, "--create-namespace",
		"--set", "manager.image.repository="+registry+"/sluice-manager", "--set", "enforcer.image.repository="+registry+"/sluice-enforcer",
		"--set", "managedRedis.image="+redisImage, "--wait", "--timeout=5m"); err != nil {
		t.Fatalf("helm install: %v\n%s\n%s", err, out, podStates(system))
	}
	t.Cleanup(func() {
		if t.Failed() {
			managerLogs(t)
		}
		if out, err := runHelm(ctx, "uninstall", release, "--namespace", system, "--wait", "--timeout=5m"); err != nil {
			t.Errorf("helm uninstall: %v\n%s", err, out)
		}
	})
}

// managerLogs logs the last lines of the manager pods' logs, for a failure's story.
func managerLogs(t *testing.T) {
	t.Helper()
	out, err := cluster.Kubectl(context.Background(), nil, "logs", "--namespace", system, "--selector", "app.kubernetes.io/component=manager",
		"--all-containers", "--prefix", "--tail=60")
	t.Logf("the manager's logs (%v):\n%s", err, out)
}
