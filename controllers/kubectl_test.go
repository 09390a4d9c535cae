package controllers_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// kubectl get rlp prints what the controller wrote: the RULES column is status.ruleNames, which
// names every rule while they fit and counts the rest. Through the real kubectl's table, as the
// API server serves it from the CRD's printer columns.
func TestKubectlGetWhenAPolicyHasSeveralRulesThenTheRULESColumnShowsEveryOneThatFits(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "kubectl")
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig); err != nil {
		t.Fatal(err)
	}
	rulesColumn := func(name string) (string, error) {
		out, err := exec.Command(env.Kubectl(), "--kubeconfig", kubeconfig, "-n", ns, "get", "rlp", name).CombinedOutput()
		if err != nil {
			return "", fmt.Errorf("kubectl get rlp %s: %w\n%s", name, err, out)
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		if len(lines) != 2 {
			return "", fmt.Errorf("kubectl get rlp %s: want a header and one row:\n%s", name, out)
		}
		// A cell may hold a space ("+24 more"): read the row at the header's offsets, from
		// RULES to the next column.
		start := strings.Index(lines[0], " RULES ") + 1
		end := strings.Index(lines[0], " READY ") + 1
		if start == 0 || end < start || len(lines[1]) < end {
			return "", fmt.Errorf("kubectl get rlp %s: no RULES column before READY:\n%s", name, out)
		}
		return strings.TrimSpace(lines[1][start:end]), nil
	}
	wantColumn := func(name, want string) {
		t.Helper()
		poll.WaitFor(t, 10*time.Second, func() error {
			got, err := rulesColumn(name)
			if err != nil {
				return err
			}
			if got != want {
				return fmt.Errorf("kubectl get rlp %s: RULES %q, want %q", name, got, want)
			}
			return nil
		})
	}
	withRules := func(p *v1alpha1.RateLimitPolicy, names ...string) *v1alpha1.RateLimitPolicy {
		first := p.Spec.Rules[0]
		p.Spec.Rules = nil
		for _, n := range names {
			r := *first.DeepCopy()
			r.Name = n
			p.Spec.Rules = append(p.Spec.Rules, r)
		}
		return p
	}

	three := withRules(newPolicy(ns, "three", "api"), "burst", "per-minute", "per-hour")
	if err := k8s.Create(ctx, three); err != nil {
		t.Fatal(err)
	}
	wantColumn("three", "burst,per-minute,per-hour")

	t.Run("when a rule is removed then the column follows", func(t *testing.T) {
		updateSpec(t, three, func(p *v1alpha1.RateLimitPolicy) { p.Spec.Rules = p.Spec.Rules[:2] })
		wantColumn("three", "burst,per-minute")
	})

	t.Run("when 32 rules do not fit then those that do and the rest counted", func(t *testing.T) {
		var names []string
		for i := range 32 {
			names = append(names, fmt.Sprintf("rule-%d", i))
		}
		many := withRules(newPolicy(ns, "many", "many"), names...)
		if err := k8s.Create(ctx, many); err != nil {
			t.Fatal(err)
		}
		// 64 characters, the bound: the API server accepts the status at its maxLength.
		wantColumn("many", "rule-0,rule-1,rule-2,rule-3,rule-4,rule-5,rule-6,rule-7,+24 more")
	})
}
