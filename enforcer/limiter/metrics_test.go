package limiter_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluice-dev/sluice/enforcer/limiter"
	"github.com/sluice-dev/sluice/enforcer/store"
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
	if len(decisions) != 10 {
		t.Errorf("decision series %v, want 2 rules x 5 results", decisions)
	}
	for _, want := range []string{"policy=test/unit,result=failed_closed,rule=closed", "policy=test/unit,result=allowed,rule=open"} {
		if !slices.Contains(decisions, want) {
			t.Errorf("no series %s in %v", want, decisions)
		}
	}
	if got := series(t, reg, "sluice_store_errors_total"); !slices.Equal(got, []string{"cause=fault", "cause=unavailable"}) {
		t.Errorf("store error series %v", got)
	}
	if got := series(t, reg, "sluice_enforcer_policy_info"); !slices.Equal(got, []string{"policy=test/unit"}) {
		t.Errorf("policy info %v", got)
	}

	other := strings.NewReplacer("name: unit", "name: other", "name: open", "name: kept", "name: closed", "name: gone").Replace(twoRules)
	l.SetPolicies(policies(t, fmt.Sprintf(other, 5))[:1])
	decisions = series(t, reg, "sluice_decisions_total")
	for _, d := range decisions {
		if !strings.HasPrefix(d, "policy=test/other,") {
			t.Errorf("series %s of a policy no longer served", d)
		}
	}
	if len(decisions) != 10 {
		t.Errorf("decision series %v, want the new policy's 2 rules x 5 results", decisions)
	}
	if got := series(t, reg, "sluice_enforcer_policy_info"); !slices.Equal(got, []string{"policy=test/other"}) {
		t.Errorf("policy info %v after the reload", got)
	}
}
