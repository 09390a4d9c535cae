package limiter_test

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/policy"
)

// series lists the series of a metric family as "label=value,..." strings.
func series(t *testing.T, reg *prometheus.Registry, name string) []string {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			out = append(out, strings.Join(labels, ","))
		}
	}
	slices.Sort(out)
	return out
}

// The rules in force have their decision series at zero before their first decision, so that an
// alert on increase() sees a first failure; a reload drops the series of rules that went, and
// sluice_enforcer_policy_info names the policies served.
func TestMetricsWhenPoliciesAreSetThenTheirSeriesExistAndOldOnesGo(t *testing.T) {
	reg := prometheus.NewRegistry()
	l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{}), Metrics: limiter.NewMetrics(reg)})
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 5)))
	decisions := series(t, reg, "sluice_decisions_total")
	if len(decisions) != 12 {
		t.Errorf("decision series %v, want 2 rules x 6 results", decisions)
	}
	for _, want := range []string{"namespace=test,policy=unit,result=failed_closed,rule=closed", "namespace=test,policy=unit,result=allowed,rule=open"} {
		if !slices.Contains(decisions, want) {
			t.Errorf("no series %s in %v", want, decisions)
		}
	}
	if got := series(t, reg, "sluice_store_errors_total"); !slices.Equal(got, []string{"cause=fault", "cause=unavailable"}) {
		t.Errorf("store error series %v", got)
	}
	if got := series(t, reg, "sluice_enforcer_policy_info"); !slices.Equal(got, []string{"namespace=test,policy=unit"}) {
		t.Errorf("policy info %v", got)
	}

	other := strings.NewReplacer("name: unit", "name: other", "name: open", "name: kept", "name: closed", "name: gone").Replace(twoRules)
	l.SetPolicies(policies(t, fmt.Sprintf(other, 5))[:1])
	decisions = series(t, reg, "sluice_decisions_total")
	for _, d := range decisions {
		if !strings.HasPrefix(d, "namespace=test,policy=other,") {
			t.Errorf("series %s of a policy no longer served", d)
		}
	}
	if len(decisions) != 12 {
		t.Errorf("decision series %v, want the new policy's 2 rules x 6 results", decisions)
	}
	if got := series(t, reg, "sluice_enforcer_policy_info"); !slices.Equal(got, []string{"namespace=test,policy=other"}) {
		t.Errorf("policy info %v after the reload", got)
	}
}

// Policies of one name in two namespaces are two policies: namespace and policy are labels apart,
// decisions are counted for the policy that made them, and a reload that drops one drops only
// its series.
func TestMetricsWhenTwoNamespacesHoldAPolicyOfOneNameThenTheirSeriesAreApart(t *testing.T) {
	reg := prometheus.NewRegistry()
	l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{}), Metrics: limiter.NewMetrics(reg)})
	inProd := strings.Replace(twoRules, "namespace: test", "namespace: prod", 1)
	both := append(policies(t, fmt.Sprintf(twoRules, 5)), policies(t, fmt.Sprintf(inProd, 5))...)
	l.SetPolicies(both)
	if got := series(t, reg, "sluice_enforcer_policy_info"); !slices.Equal(got, []string{"namespace=prod,policy=unit", "namespace=test,policy=unit"}) {
		t.Errorf("policy info %v, want unit in prod and in test", got)
	}
	if res := l.Decide(t.Context(), &limiter.Request{Method: "GET", Path: "/open", Policy: "prod/unit", Peer: netip.MustParseAddr("192.0.2.1")}); res.Policy != "prod/unit" {
		t.Fatalf("decided by %q, want prod/unit", res.Policy)
	}
	counters := l.Counters()
	if got := counters[limiter.RuleKey{Namespace: "prod", Policy: "unit", Rule: "open"}].Allowed; got != 1 {
		t.Errorf("prod/unit's rule open allowed %d, want 1", got)
	}
	if got := counters[limiter.RuleKey{Namespace: "test", Policy: "unit", Rule: "open"}].Allowed; got != 0 {
		t.Errorf("test/unit's rule open allowed %d, want 0: the decision was prod's", got)
	}

	l.SetPolicies([]*policy.Policy{both[0]})
	for _, d := range series(t, reg, "sluice_decisions_total") {
		if !strings.HasPrefix(d, "namespace=test,policy=unit,") {
			t.Errorf("series %s of prod/unit, no longer served", d)
		}
	}
	if got := series(t, reg, "sluice_decisions_total"); len(got) != 12 {
		t.Errorf("decision series %v, want test/unit's 2 rules x 6 results", got)
	}
}
