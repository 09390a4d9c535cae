package e2e_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// targetLabels are the labels Prometheus adds to every series from its target, as the chart's
// ServiceMonitor and PodMonitor scrape the manager and the enforcers.
var targetLabels = []string{"namespace", "pod", "container", "endpoint", "service", "job", "instance"}

// Every PromQL expression of the alerts and the dashboard is parsed with Prometheus's own
// parser, and every metric and label it names must be one that the manager or an enforcer
// exports, as a live scrape of the real binaries shows, or one that a recording rule makes.
func TestMonitoringWhenScrapedLiveThenAlertsAndDashboardNameOnlyExportedSeries(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	k8s := c.env.Client
	logs := newProcessLog(t)
	metricsAddr, err := local.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	mgr, err := local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, logs, "--enforcer-image=sluice-enforcer:monitoring",
		"--redis-probe-interval=0", "--report-interval=1s", "--metrics-bind-address="+metricsAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mgr.Stop)
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "monitoring-"}}
	if err := k8s.Create(ctx, ns); err != nil {
		t.Fatal(err)
	}
	c.runPods(t, ns.Name, okUpstream(t).URL, logs)
	p := testenv.ReadObjects(t, filepath.Join(testenv.RepoRoot(), "config", "samples", "token-bucket.yaml"))[0]
	p.SetNamespace(ns.Name)
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitReady(t, k8s, types.NamespacedName{Namespace: ns.Name, Name: p.GetName()}, 2*time.Minute)
	pods, err := local.EnforcerPods(ctx, k8s, ns.Name, p.GetName())
	if err != nil || len(pods) == 0 {
		t.Fatalf("enforcer pods: %v, %v", pods, err)
	}

	exported := map[string][]string{} // metric name -> its label names
	managerExported, enforcerExported := map[string][]string{}, map[string][]string{}
	scrape(t, "http://"+metricsAddr+"/metrics", managerExported)
	scrape(t, local.PodURL(&pods[0], "admin")+"/metrics", enforcerExported)
	for _, m := range []map[string][]string{managerExported, enforcerExported} {
		for name, labels := range m {
			exported[name] = append(exported[name], labels...)
		}
	}
	// Per-policy series name the policy's namespace in the label namespace, which Prometheus
	// also sets from the target: without honorLabels it renames the series' own to
	// exported_namespace, and the manager's series would name its namespace, not the policy's.
	honors := monitorsHonoringLabels(t)
	for monitor, m := range map[string]map[string][]string{"ServiceMonitor/sluice-manager": managerExported, "PodMonitor/sluice-enforcers": enforcerExported} {
		for name, labels := range m {
			for _, l := range labels {
				if slices.Contains(targetLabels, l) && !honors[monitor] {
					t.Errorf("%s exports the target label %s, but %s does not set honorLabels: Prometheus renames it exported_%s", name, l, monitor, l)
				}
			}
		}
	}
	for binary, m := range map[string]map[string][]string{"manager": managerExported, "enforcer": enforcerExported} {
		if got := m["sluice_build_info"]; !slices.Contains(got, "version") || !slices.Contains(got, "commit") || !slices.Contains(got, "go_version") {
			t.Errorf("the %s's sluice_build_info has labels %v, want version, commit and go_version", binary, got)
		}
	}
	if !slices.Contains(managerExported["sluice_policy_replicas_serving"], "namespace") ||
		!slices.Contains(enforcerExported["sluice_decisions_total"], "namespace") {
		t.Errorf("per-policy series without a namespace label: manager %v, enforcer %v",
			managerExported["sluice_policy_replicas_serving"], enforcerExported["sluice_decisions_total"])
	}
	// The series this test relies on are there: the manager's and the enforcer's own.
	for _, name := range []string{"sluice_policy_replicas_serving", "sluice_manager_reconcile_errors_total", "sluice_decisions_total", "sluice_store_latency_seconds_bucket"} {
		if _, ok := exported[name]; !ok {
			t.Fatalf("the scrapes have no %s", name)
		}
	}

	var exprs []namedExpr
	var rule struct {
		Spec struct {
			Groups []struct {
				Rules []struct{ Record, Alert, Expr string }
			}
		}
	}
	readYAML(t, filepath.Join("config", "prometheus", "prometheusrule.yaml"), &rule)
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			exprs = append(exprs, namedExpr{"rule " + r.Record + r.Alert, r.Expr})
			if r.Record != "" {
				// A recording rule's series has the labels its expression keeps.
				e, err := promql.ParseExpr(r.Expr)
				if err != nil {
					t.Fatalf("%s: %v", r.Record, err)
				}
				exported[r.Record] = outputLabels(e)
			}
		}
	}
	var dashboard struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
		Templating struct {
			List []struct {
				Name  string
				Query any
			}
		}
	}
	readJSON(t, filepath.Join("config", "grafana", "sluice.json"), &dashboard)
	for _, p := range dashboard.Panels {
		for _, tg := range p.Targets {
			exprs = append(exprs, namedExpr{"panel " + p.Title, tg.Expr})
		}
	}
	labelValues := regexp.MustCompile(`^label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$`)
	for _, v := range dashboard.Templating.List {
		q, ok := v.Query.(map[string]any)
		if !ok {
			continue
		}
		m := labelValues.FindStringSubmatch(fmt.Sprint(q["query"]))
		if m == nil {
			t.Errorf("variable %s: query %v is not label_values(<selector>, <label>)", v.Name, q["query"])
			continue
		}
		exprs = append(exprs, namedExpr{"variable " + v.Name, fmt.Sprintf("count by (%s) (%s)", m[2], m[1])})
	}
	if len(exprs) < 20 {
		t.Fatalf("found %d expressions; the files lost theirs", len(exprs))
	}

	// Grafana's variables, as Grafana replaces them before it sends a query.
	vars := strings.NewReplacer("$__rate_interval", "5m", "${datasource}", "", "$namespace", ".+", "$policy", ".+", "$rule", ".+")
	for _, e := range exprs {
		expr, err := promql.ParseExpr(vars.Replace(e.expr))
		if err != nil {
			t.Errorf("%s: %v\n%s", e.name, err, e.expr)
			continue
		}
		for _, problem := range unknownNames(expr, exported) {
			t.Errorf("%s: %s\n%s", e.name, problem, e.expr)
		}
	}
}

type namedExpr struct{ name, expr string }

// monitorsHonoringLabels reads config/prometheus/monitor.yaml (the chart renders the same specs,
// test/chart compares them) and tells, by "Kind/name", the monitors whose every endpoint sets
// honorLabels.
func monitorsHonoringLabels(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, u := range testenv.ReadObjects(t, filepath.Join(testenv.RepoRoot(), "config", "prometheus", "monitor.yaml")) {
		var field string
		switch u.GetKind() {
		case "ServiceMonitor":
			field = "endpoints"
		case "PodMonitor":
			field = "podMetricsEndpoints"
		default:
			continue
		}
		endpoints, _, _ := unstructured.NestedSlice(u.Object, "spec", field)
		honors := len(endpoints) > 0
		for _, e := range endpoints {
			if h, _ := e.(map[string]any)["honorLabels"].(bool); !h {
				honors = false
			}
		}
		out[u.GetKind()+"/"+u.GetName()] = honors
	}
	return out
}

// promql is Prometheus's PromQL parser with its default options, as Prometheus itself runs.
var promql = parser.NewParser(parser.Options{})

// scrape reads a /metrics page and adds every sample's name and label names to exported.
func scrape(t *testing.T, url string, exported map[string][]string) {
	t.Helper()
	resp, err := http.Get(url) //nolint:gosec,noctx // a loopback URL of the test's own processes
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	dec := expfmt.NewDecoder(strings.NewReader(string(body)), expfmt.NewFormat(expfmt.TypeTextPlain))
	samples, err := expfmt.ExtractSamples(&expfmt.DecodeOptions{Timestamp: model.Now()}, decodeAll(t, dec)...)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range samples {
		name := string(s.Metric[model.MetricNameLabel])
		for l := range s.Metric {
			if l != model.MetricNameLabel && !slices.Contains(exported[name], string(l)) {
				exported[name] = append(exported[name], string(l))
			}
		}
		if _, ok := exported[name]; !ok {
			exported[name] = []string{}
		}
	}
}

func decodeAll(t *testing.T, dec expfmt.Decoder) []*dto.MetricFamily {
	t.Helper()
	var out []*dto.MetricFamily
	for {
		f := &dto.MetricFamily{}
		if err := dec.Decode(f); err != nil {
			if errors.Is(err, io.EOF) {
				return out
			}
			t.Fatal(err)
		}
		out = append(out, f)
	}
}

// unknownNames lists the metrics and labels an expression names that are not exported. A label
// is known if the metric it selects has it, or, for groupings and vector matchings, if any
// metric of the expression has it; target labels are always known.
func unknownNames(expr parser.Expr, exported map[string][]string) []string {
	var problems []string
	known := map[string]bool{"le": true}
	for _, l := range targetLabels {
		known[l] = true
	}
	var selectors []*parser.VectorSelector
	parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			selectors = append(selectors, vs)
		}
		return nil
	})
	for _, vs := range selectors {
		labels, ok := exported[vs.Name]
		if !ok {
			problems = append(problems, fmt.Sprintf("metric %s is not exported", vs.Name))
			continue
		}
		for _, l := range labels {
			known[l] = true
		}
		for _, m := range vs.LabelMatchers {
			if m.Name != model.MetricNameLabel && !slices.Contains(labels, m.Name) && !slices.Contains(targetLabels, m.Name) {
				problems = append(problems, fmt.Sprintf("metric %s has no label %s", vs.Name, m.Name))
			}
		}
	}
	parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
		var names []string
		switch n := n.(type) {
		case *parser.AggregateExpr:
			names = n.Grouping
		case *parser.BinaryExpr:
			if n.VectorMatching != nil {
				names = append(slices.Clone(n.VectorMatching.MatchingLabels), n.VectorMatching.Include...)
			}
		}
		for _, l := range names {
			if !known[l] {
				problems = append(problems, fmt.Sprintf("label %s is on none of its metrics", l))
			}
		}
		return nil
	})
	return problems
}

// outputLabels are the labels an expression's result keeps: its outermost aggregation's
// grouping.
func outputLabels(e parser.Expr) []string {
	var out []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if a, ok := n.(*parser.AggregateExpr); ok && out == nil && !a.Without {
			out = slices.Clone(a.Grouping)
		}
		return nil
	})
	return out
}

func readYAML(t *testing.T, rel string, v any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), rel))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, v); err != nil {
		t.Fatal(err)
	}
}

func readJSON(t *testing.T, rel string, v any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), rel))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatal(err)
	}
}
