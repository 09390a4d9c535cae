// Package monitoring_test checks Sluice's alerts with the real promtool: the rules load, and
// their unit tests (config/prometheus/tests.yaml) see every alert fire, and not fire, when it
// should. The metric and label names of the alerts and the dashboard are checked against live
// scrapes in test/e2e.
package monitoring_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// rulesFile writes the groups of a PrometheusRule, as Prometheus loads them, to dir/rules.yaml.
func rulesFile(t *testing.T, dir string, prometheusRule []byte) {
	t.Helper()
	var pr struct {
		Spec map[string]any `json:"spec"`
	}
	if err := yaml.Unmarshal(prometheusRule, &pr); err != nil {
		t.Fatal(err)
	}
	out, err := yaml.Marshal(pr.Spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), out, 0o644); err != nil {
		t.Fatal(err)
	}
}

func promtool(t *testing.T, dir string, args ...string) string {
	t.Helper()
	bin, err := local.Tool("promtool")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func TestAlertsWhenCheckedAndUnitTestedByPromtoolThenEachFiresWhenItShould(t *testing.T) {
	tier.Needs(t, "promtool, built by hack/tool.sh")
	dir := t.TempDir()
	rule, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "prometheus", "prometheusrule.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	rulesFile(t, dir, rule)
	out := promtool(t, dir, "check", "rules", "rules.yaml")
	if !strings.Contains(out, "SUCCESS: 10 rules found") {
		t.Errorf("promtool check rules:\n%s", out)
	}
	tests, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "prometheus", "tests.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tests.yaml"), tests, 0o644); err != nil {
		t.Fatal(err)
	}
	out = promtool(t, dir, "test", "rules", "tests.yaml")
	if !strings.Contains(out, "SUCCESS") {
		t.Errorf("promtool test rules:\n%s", out)
	}
}

// The chart's PrometheusRule, with a threshold of its own, is as valid as config/'s.
func TestAlertsWhenRenderedByTheChartThenPromtoolAcceptsThem(t *testing.T) {
	tier.Needs(t, "helm and promtool, built by hack/tool.sh")
	helm, err := local.Tool("helm")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(helm, "template", "sluice", "charts/sluice", "--show-only", "templates/monitoring.yaml",
		"--set", "prometheusRule.enabled=true", "--set-json", "prometheusRule.refusedShareThreshold=0.2")
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	dir := t.TempDir()
	rulesFile(t, dir, out)
	check := promtool(t, dir, "check", "rules", "rules.yaml")
	if !strings.Contains(check, "SUCCESS: 10 rules found") {
		t.Errorf("promtool check rules:\n%s", check)
	}
	if rules, _ := os.ReadFile(filepath.Join(dir, "rules.yaml")); !strings.Contains(string(rules), "vector(0.2)") {
		t.Errorf("the chart's threshold is not in its rules:\n%s", rules)
	}
}

// Every alert links to its section of docs/runbooks.md, which says what to check and what to do;
// a renamed alert or section breaks the link, and this test.
func TestAlertsWhenTheyFireThenEachLinksToItsRunbookSection(t *testing.T) {
	rule, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "prometheus", "prometheusrule.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var pr struct {
		Spec struct {
			Groups []struct {
				Rules []struct {
					Alert       string            `json:"alert"`
					Annotations map[string]string `json:"annotations"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(rule, &pr); err != nil {
		t.Fatal(err)
	}
	runbooks, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "docs", "runbooks.md"))
	if err != nil {
		t.Fatal(err)
	}
	// GitHub's anchor of a heading is its text lowercased (alert names need no more).
	sections := map[string]bool{}
	for _, line := range strings.Split(string(runbooks), "\n") {
		if heading, ok := strings.CutPrefix(line, "## "); ok {
			sections[strings.ToLower(strings.TrimSpace(heading))] = true
		}
	}
	const base = "https://github.com/sluice-dev/sluice/blob/main/docs/runbooks.md#"
	alerts := 0
	for _, g := range pr.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			alerts++
			url := r.Annotations["runbook_url"]
			anchor, ok := strings.CutPrefix(url, base)
			if !ok || anchor != strings.ToLower(r.Alert) {
				t.Errorf("alert %s: runbook_url %q, want %s%s", r.Alert, url, base, strings.ToLower(r.Alert))
				continue
			}
			if !sections[anchor] {
				t.Errorf("alert %s: docs/runbooks.md has no section ## %s", r.Alert, r.Alert)
			}
		}
	}
	if alerts != 8 {
		t.Errorf("%d alerts, want 8: the test lost its alerts", alerts)
	}
}
