package limiter_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/policy"
)

// manyPolicies compiles n one-rule policies, test/p0 to test/p<n-1>, each with a limit of its
// own index plus one.
func manyPolicies(t testing.TB, n int) []*policy.Policy {
	t.Helper()
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, `---
apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p%d, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: per-client
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: %d, window: 1h}
`, i, i+1)
	}
	ps, _, err := enforcer.Load([]byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

// A request that names a policy is decided against that policy's rules alone, found by its ID;
// one that names a policy not in force is refused as Invalid, naming it: never decided against
// no rules, which would admit it unlimited.
func TestLimiterWhenARequestNamesAPolicyThenOnlyItsRulesDecideAndAnUnservedOneIsRefused(t *testing.T) {
	l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{})})
	l.SetPolicies(manyPolicies(t, 50))
	ctx := context.Background()
	for _, id := range []string{"test/p0", "test/p7", "test/p49"} {
		var limit int
		_, _ = fmt.Sscanf(id, "test/p%d", &limit)
		limit++
		for i := range limit + 1 {
			req := request("/", "192.0.2.1")
			req.Policy = id
			res := l.Decide(ctx, req)
			want := limiter.Allowed
			if i == limit {
				want = limiter.Limited
			}
			if res.Outcome != want {
				t.Fatalf("%s request %d: %v, want %v", id, i+1, res.Outcome, want)
			}
			if res.Policy != id {
				t.Fatalf("%s request %d decided by %q", id, i+1, res.Policy)
			}
		}
	}
	for _, id := range []string{"test/p50", "other/p0", "test/"} {
		req := request("/", "192.0.2.1")
		req.Policy = id
		res := l.Decide(ctx, req)
		if res.Outcome != limiter.Invalid || !strings.Contains(res.Reason, fmt.Sprintf("%q is not served here", id)) {
			t.Errorf("request for %q: %v %q, want Invalid naming it", id, res.Outcome, res.Reason)
		}
	}
	if l.Policy("test/p7") == nil || l.Policy("test/p50") != nil {
		t.Error("Policy does not find the policies by ID")
	}
}

// A pool changes its policies one at a time: a policy served as the same compiled policy keeps
// its series and counts untouched, a changed one loses only the series of rules it no longer
// has, and a removed one loses its series and its policy_info.
func TestMetricsWhenOnePolicyOfManyChangesThenOnlyItsSeriesChange(t *testing.T) {
	reg := prometheus.NewRegistry()
	l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{}), Metrics: limiter.NewMetrics(reg)})
	ps := manyPolicies(t, 3)
	l.SetPolicies(ps)
	req := request("/", "192.0.2.1")
	req.Policy = "test/p1"
	if res := l.Decide(context.Background(), req); res.Outcome != limiter.Allowed {
		t.Fatalf("first decision: %v", res.Outcome)
	}
	changed := policies(t, `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p0, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: renamed
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 5, window: 1h}
`)[0]
	l.SetPolicies([]*policy.Policy{changed, ps[1]}) // p0 changed, p1 the same, p2 gone
	got := series(t, reg, "sluice_decisions_total")
	for _, d := range got {
		if strings.Contains(d, "policy=p2,") || strings.Contains(d, "policy=p0,") && strings.Contains(d, "rule=per-client") {
			t.Errorf("series %s of a rule no longer served", d)
		}
	}
	if !slices.Contains(got, "namespace=test,policy=p0,result=allowed,rule=renamed") {
		t.Errorf("no series of the changed policy's new rule in %v", got)
	}
	if c := l.Counters()[limiter.RuleKey{Namespace: "test", Policy: "p1", Rule: "per-client"}]; c.Allowed != 1 {
		t.Errorf("the unchanged policy's count is %+v after the change of another, want its 1 allowed", c)
	}
	if info := series(t, reg, "sluice_enforcer_policy_info"); !slices.Equal(info, []string{"namespace=test,policy=p0", "namespace=test,policy=p1"}) {
		t.Errorf("policy info %v, want p0 and p1", info)
	}
}
