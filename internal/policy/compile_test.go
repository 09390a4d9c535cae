package policy_test

import (
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"k8s.io/utils/ptr"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

func newPolicy(rules ...v1alpha1.Rule) *v1alpha1.RateLimitPolicy {
	p := &v1alpha1.RateLimitPolicy{}
	p.Namespace, p.Name = "shop", "api"
	p.Spec.TargetRef = v1alpha1.TargetRef{Name: "api", Port: 80}
	p.Spec.Rules = rules
	return p
}

func TestCompileWhenPolicyIsValidThenRulesCarryParametersInRuntimeUnits(t *testing.T) {
	p := newPolicy(
		v1alpha1.Rule{Name: "burst", TokenBucket: &v1alpha1.TokenBucket{Capacity: 10, Refill: v1alpha1.TokenRefill{Tokens: 5, Period: "1s"}},
			Key: []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("x-api-key")}}},
		v1alpha1.Rule{Name: "queue", LeakyBucket: &v1alpha1.LeakyBucket{Capacity: 20, Drain: v1alpha1.DrainRate{Requests: 10, Period: "1s"}},
			Mode: v1alpha1.ModeShadow, FailureMode: v1alpha1.FailClosed, Cost: ptr.To[int64](2)},
	)
	p.Spec.TrustedProxies = []v1alpha1.CIDR{"10.1.2.3/8"}
	c, err := policy.Compile(p)
	if err != nil {
		t.Fatal(err)
	}
	if c.ID != "shop/api" || len(c.Rules) != 2 || c.TrustedProxies[0].String() != "10.0.0.0/8" {
		t.Fatalf("compiled = %+v", c)
	}
	burst, queue := c.Rules[0], c.Rules[1]
	if burst.Limit != (algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 10, Rate: 5, Period: time.Second}) || burst.Cost != 1 || !burst.Enforce || !burst.FailOpen {
		t.Errorf("burst = %+v", burst)
	}
	if burst.Key[0].Header != "X-Api-Key" {
		t.Errorf("header key %q, want canonical X-Api-Key", burst.Key[0].Header)
	}
	if queue.Limit.MaxWait != 2*time.Second || queue.Enforce || queue.FailOpen || queue.Cost != 2 {
		t.Errorf("queue = %+v; want maxWait defaulted to a full queue's drain time (2s), shadow, fail closed, cost 2", queue)
	}
}

// What the schema says (costs within limits, duration bounds, unique rule names, the sliding log's
// bound) is the corpus of test/testdata/invalid, judged by the API server and the loader; Compile
// names what only Go can say, and what it cannot compile at all.
func TestCompileWhenPolicyCanNeverWorkThenErrorNamesTheField(t *testing.T) {
	window := func(limit int64, w v1alpha1.Duration) *v1alpha1.Window {
		return &v1alpha1.Window{Limit: limit, Window: w}
	}
	cases := []struct {
		name  string
		rules []v1alpha1.Rule
		want  string
	}{
		{"when period does not parse then period is named", []v1alpha1.Rule{{Name: "a",
			LeakyBucket: &v1alpha1.LeakyBucket{Capacity: 1, Drain: v1alpha1.DrainRate{Requests: 1, Period: "soon"}}}},
			"spec.rules[0].leakyBucket.drain.period: Invalid value: \"soon\""},
		{"when maxWait exceeds the drain time then maxWait is named", []v1alpha1.Rule{{Name: "a",
			LeakyBucket: &v1alpha1.LeakyBucket{Capacity: 5, Drain: v1alpha1.DrainRate{Requests: 10, Period: "1s"}, MaxWait: ptr.To[v1alpha1.Duration]("1s")}}},
			"spec.rules[0].leakyBucket.maxWait: Invalid value: \"1s\": must not exceed 500ms"},
		{"when no algorithm is set then the rule is named", []v1alpha1.Rule{{Name: "a"}},
			"spec.rules[0]: Required value: exactly one algorithm"},
		{"when the path expression is invalid then the value is named", []v1alpha1.Rule{{Name: "a", FixedWindow: window(5, "1s"),
			Match: &v1alpha1.Match{Path: &v1alpha1.PathMatch{Type: v1alpha1.PathMatchRegularExpression, Value: "/v[0-9"}}}},
			"spec.rules[0].match.path.value: Invalid value: \"/v[0-9\": must be a valid RE2 regular expression"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := policy.Compile(newPolicy(c.rules...))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("err = %v, want it to contain %q", err, c.want)
			}
		})
	}
}

// A concurrency rule is a limit of slots whose leases last leaseTimeout, 30s when absent; a rule
// charged by the response carries the statuses it charges, codes and classes, and the canonical
// name of the field its cost comes from.
func TestCompileWhenRulesAreChargedByTheResponseOrHoldSlotsThenTheyCarryWhatTheProxyNeeds(t *testing.T) {
	p := newPolicy(
		v1alpha1.Rule{Name: "in-flight", Concurrency: &v1alpha1.Concurrency{Limit: 10}},
		v1alpha1.Rule{Name: "slow", Concurrency: &v1alpha1.Concurrency{Limit: 3, LeaseTimeout: ptr.To[v1alpha1.Duration]("2m")}},
		v1alpha1.Rule{Name: "failures", FixedWindow: &v1alpha1.Window{Limit: 5, Window: "1h"},
			Charge: &v1alpha1.Charge{When: v1alpha1.ChargeWhenResponse, Statuses: []v1alpha1.StatusPattern{"401", "403", "5xx"}}},
		v1alpha1.Rule{Name: "tokens", TokenBucket: &v1alpha1.TokenBucket{Capacity: 1000, Refill: v1alpha1.TokenRefill{Tokens: 1000, Period: "1h"}},
			Charge: &v1alpha1.Charge{When: v1alpha1.ChargeWhenResponse}, CostFrom: &v1alpha1.CostFrom{ResponseHeader: "x-tokens-used", Max: 1000}},
		v1alpha1.Rule{Name: "requests", FixedWindow: &v1alpha1.Window{Limit: 5, Window: "1h"}, Charge: &v1alpha1.Charge{When: v1alpha1.ChargeWhenRequest}},
	)
	c, err := policy.Compile(p)
	if err != nil {
		t.Fatal(err)
	}
	inFlight, slow, failures, tokens, requests := &c.Rules[0], &c.Rules[1], &c.Rules[2], &c.Rules[3], &c.Rules[4]
	if inFlight.Limit != (algorithm.Limit{Kind: algorithm.Concurrency, Limit: 10, Period: 30 * time.Second}) || !inFlight.SeesResponse() || inFlight.OnResponse {
		t.Errorf("in-flight = %+v", inFlight)
	}
	if slow.Limit.Period != 2*time.Minute {
		t.Errorf("slow's lease = %v, want 2m", slow.Limit.Period)
	}
	for code, want := range map[int]bool{401: true, 403: true, 500: true, 503: true, 599: true, 200: false, 402: false, 404: false, 499: false, 600: false} {
		if got := failures.Charges(code); got != want {
			t.Errorf("failures charges %d: %v, want %v", code, got, want)
		}
	}
	if !failures.OnResponse || !failures.SeesResponse() || failures.CostFrom != nil {
		t.Errorf("failures = %+v", failures)
	}
	if !tokens.Charges(200) || !tokens.Charges(500) || tokens.CostFrom == nil || *tokens.CostFrom != (policy.CostFrom{Header: "X-Tokens-Used", Max: 1000}) {
		t.Errorf("tokens = %+v, cost from %+v", tokens, tokens.CostFrom)
	}
	if requests.OnResponse || requests.SeesResponse() {
		t.Errorf("a rule charged when Request is decided as any other: %+v", requests)
	}
}

// A lease carries its max and its expiry, 1s when absent; a rule without one has none.
func TestCompileWhenARuleHasALeaseThenItCarriesItsMaxAndExpiry(t *testing.T) {
	bucket := &v1alpha1.TokenBucket{Capacity: 100, Refill: v1alpha1.TokenRefill{Tokens: 10, Period: "1s"}}
	p := newPolicy(
		v1alpha1.Rule{Name: "leased", TokenBucket: bucket, Lease: &v1alpha1.Lease{Max: 10}},
		v1alpha1.Rule{Name: "short", FixedWindow: &v1alpha1.Window{Limit: 1000, Window: "1m"},
			Lease: &v1alpha1.Lease{Max: 1000, Expiry: ptr.To[v1alpha1.Duration]("250ms")}},
		v1alpha1.Rule{Name: "plain", TokenBucket: bucket},
	)
	c, err := policy.Compile(p)
	if err != nil {
		t.Fatal(err)
	}
	want := []*policy.Lease{{Max: 10, Expiry: time.Second}, {Max: 1000, Expiry: 250 * time.Millisecond}, nil}
	for i, w := range want {
		if diff := cmp.Diff(w, c.Rules[i].Lease); diff != "" {
			t.Errorf("%s's lease (-want +got):\n%s", c.Rules[i].Name, diff)
		}
	}
}
