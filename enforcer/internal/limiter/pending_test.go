package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/test/poll"
)

const responseRules = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: unit, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: in-flight
      match: {path: {value: /slow}}
      key: [{type: RemoteAddress}]
      concurrency: {limit: 2, leaseTimeout: 3s}
    - name: failures
      match: {path: {value: /login}}
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 3, window: 1h}
      charge: {when: Response, statuses: ["401", "5xx"]}
    - name: tokens
      match: {path: {value: /chat}}
      key: [{type: RemoteAddress}]
      tokenBucket: {capacity: 1000, refill: {tokens: 1000, period: 24h}}
      charge: {when: Response}
      costFrom: {responseHeader: X-Tokens-Used, max: 500}
    - name: plain
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 1000, window: 1h}
`

// responseLimiter is a limiter on the memory store with responseRules, whose clock (the store's
// and the renewals') the test drives, and its metrics' registry.
func responseLimiter(t *testing.T) (*limiter.Limiter, *clocktesting.FakeClock, *prometheus.Registry) {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	s := store.NewMemory(store.MemoryOptions{Now: clk.Now, SweepInterval: -1})
	t.Cleanup(func() { _ = s.Close() })
	reg := prometheus.NewRegistry()
	l := limiter.New(limiter.Options{Store: s, Metrics: limiter.NewMetrics(reg), Now: clk.Now, Clock: clk})
	l.SetPolicies(policies(t, responseRules))
	return l, clk, reg
}

func proxied(path string) *limiter.Request {
	r := request(path, "192.0.2.1")
	r.SeesResponse = true
	return r
}

func settle(t *testing.T, l *limiter.Limiter) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := l.Settle(ctx); err != nil {
		t.Fatal(err)
	}
}

// A concurrency limit of 2 admits two requests in flight, each with what it owes once it ends;
// the third is refused, with no Retry-After of its own (no clock frees a slot) and a decision
// that says none remains; once one ends, the next is admitted.
func TestLimiterWhenRequestsHoldSlotsThenTheyAreFreedWhenTheirResponsesEnd(t *testing.T) {
	l, _, _ := responseLimiter(t)
	ctx := context.Background()
	first, second := l.Decide(ctx, proxied("/slow")), l.Decide(ctx, proxied("/slow"))
	if first.Outcome != limiter.Allowed || second.Outcome != limiter.Allowed || first.Pending == nil || second.Pending == nil {
		t.Fatalf("two requests: %+v, %+v; want both admitted, each owing its end", first, second)
	}
	third := l.Decide(ctx, proxied("/slow"))
	if third.Outcome != limiter.Limited || third.RetryAfter != 0 || third.Never || third.Rule.Name != "in-flight" || third.Decision.Remaining != 0 || third.Pending != nil {
		t.Fatalf("the third: %+v, want refused by in-flight with no Retry-After and nothing owed", third)
	}
	first.Pending.End(http.StatusOK, nil)
	first.Pending.End(http.StatusOK, nil) // only the first End counts
	settle(t, l)
	if res := l.Decide(ctx, proxied("/slow")); res.Outcome != limiter.Allowed {
		t.Errorf("after one ended: %+v, want admitted", res)
	}
	if res := l.Decide(ctx, proxied("/slow")); res.Outcome != limiter.Limited {
		t.Errorf("a second after one ended: %+v, want refused: only one slot was freed", res)
	}
}

// A request longer than the lease timeout keeps its slot: its lease is renewed every third of
// the timeout while it lasts. One that stops being renewed (its enforcer died: here, no End and
// a lease whose renewals the test skips by moving the store's clock alone) frees it within the
// timeout.
func TestLimiterWhenARequestOutlastsItsLeaseThenItIsRenewedUntilItEnds(t *testing.T) {
	l, clk, reg := responseLimiter(t)
	ctx := context.Background()
	a, b := l.Decide(ctx, proxied("/slow")), l.Decide(ctx, proxied("/slow"))
	if a.Pending == nil || b.Pending == nil {
		t.Fatal("not admitted with a lease")
	}
	// Ten seconds in steps of a second: renewals every second keep both 3s leases alive.
	for i := range 10 {
		clk.Step(time.Second)
		// Each request's renewal runs in the background, as the timer fires: wait for both.
		poll.WaitFor(t, 10*time.Second, func() error {
			if n := counter(t, reg, "sluice_lease_renewals_total", "", "renewed"); n != float64(2*(i+1)) {
				return fmt.Errorf("%v renewals, want %d", n, 2*(i+1))
			}
			return nil
		})
		if res := l.Decide(ctx, proxied("/slow")); res.Outcome != limiter.Limited {
			t.Fatalf("at +%v: %+v, want refused: both leases renewed", clk.Since(time.Unix(1_700_000_000, 0)), res)
		}
	}
	a.Pending.End(http.StatusOK, nil)
	b.Pending.End(0, nil) // its client left
	settle(t, l)
	clk.Step(time.Second) // no renewal is left to fire
	for range 2 {
		if res := l.Decide(ctx, proxied("/slow")); res.Outcome != limiter.Allowed {
			t.Fatalf("after both ended: %+v", res)
		}
	}
	// These two are never ended, and the clock jumps past their lease timeout without a
	// renewal firing between (a dead enforcer renews nothing): their slots are free again.
	clk.SetTime(clk.Now().Add(3 * time.Second))
	if res := l.Decide(ctx, proxied("/slow")); res.Outcome != limiter.Allowed {
		t.Errorf("3s after the last renewal could have run: %+v, want the expired leases' slots free", res)
	}
}

// Five failed logins of a limit of 3... charged by the response: successes are never charged,
// each 401 or 5xx is, and once three are, the next attempt is refused before it is forwarded; a
// request whose client left before its response is charged as a failure. Each charge is counted.
func TestLimiterWhenResponsesAreChargedThenOnlyTheirStatusesCount(t *testing.T) {
	l, _, reg := responseLimiter(t)
	ctx := context.Background()
	attempt := func(status int) limiter.Result {
		t.Helper()
		res := l.Decide(ctx, proxied("/login"))
		if res.Outcome == limiter.Allowed {
			res.Pending.End(status, nil)
			settle(t, l)
		}
		return res
	}
	for i := range 20 {
		if res := attempt(http.StatusOK); res.Outcome != limiter.Allowed {
			t.Fatalf("success %d: %+v", i, res)
		}
	}
	for i, status := range []int{http.StatusUnauthorized, http.StatusForbidden, http.StatusBadGateway, 0} {
		if res := attempt(status); res.Outcome != limiter.Allowed {
			t.Fatalf("attempt %d (%d): %+v, want admitted: two failures so far at most", i, status, res)
		}
	}
	if res := attempt(http.StatusOK); res.Outcome != limiter.Limited || res.Rule.Name != "failures" || res.RetryAfter <= 0 {
		t.Errorf("after 401, 502 and a client that left: %+v, want refused by failures with a Retry-After", res)
	}
	if got := (counter(t, reg, "sluice_response_charges_total", "failures", "charged")); got != 3 {
		t.Errorf("charges counted %v, want 3 (401, 502, left); 403 and 200 are not charged", got)
	}
}

// A token budget of 1,000 with responses reporting 300 each: the fourth request is admitted
// with 100 left and charged to exhaustion, the fifth refused. Costs over costFrom.max are
// charged max; a response without a valid cost is charged the rule's cost; both are counted.
func TestLimiterWhenResponsesReportTheirCostThenTheBudgetFollowsThem(t *testing.T) {
	l, _, reg := responseLimiter(t)
	ctx := context.Background()
	reply := func(values ...string) func(string) []string {
		return func(name string) []string {
			if name != "X-Tokens-Used" {
				t.Errorf("read field %q, want the canonical X-Tokens-Used", name)
			}
			return values
		}
	}
	for i := range 4 {
		res := l.Decide(ctx, proxied("/chat"))
		if res.Outcome != limiter.Allowed || i > 0 && (res.Rule.Name != "tokens" || res.Decision.Remaining != int64(1000-300*i)) {
			t.Fatalf("request %d: %+v, want admitted, the tokens rule charged only by the responses before it", i+1, res)
		}
		res.Pending.End(http.StatusOK, reply("300"))
		settle(t, l)
	}
	if res := l.Decide(ctx, proxied("/chat")); res.Outcome != limiter.Limited || res.Rule.Name != "tokens" {
		t.Errorf("the fifth: %+v, want refused by tokens", res)
	}
	if got := (counter(t, reg, "sluice_response_charges_total", "tokens", "charged")); got != 4 {
		t.Errorf("%v charges counted, want 4", got)
	}
}

// What a response's cost field may hold, one past each edge: a whole number up to max is
// charged as it is; above max, however long, max; anything else (missing, repeated, empty,
// signed, negative, fractional, not a number) the rule's cost; and a response that never came,
// the rule's cost.
func TestResponseCostWhenTheFieldIsAnythingThenItIsChargedWithinTheRulesBounds(t *testing.T) {
	rule := &policy.Rule{Cost: 7, OnResponse: true, CostFrom: &policy.CostFrom{Header: "X-Tokens-Used", Max: 500}}
	cases := []struct {
		name   string
		values []string
		status int
		want   int64
		result string
	}{
		{"when it is a number within max then it is charged", []string{"300"}, 200, 300, "charged"},
		{"when it is 0 then nothing is charged", []string{"0"}, 200, 0, "charged"},
		{"when it is max then max is charged", []string{"500"}, 200, 500, "charged"},
		{"when it is one past max then max is charged", []string{"501"}, 200, 500, "clamped"},
		{"when it is beyond int64 then max is charged", []string{strings.Repeat("9", 4000)}, 200, 500, "clamped"},
		{"when it is 2^63 then max is charged", []string{strconv.FormatUint(math.MaxInt64+1, 10)}, 200, 500, "clamped"},
		{"when it has spaces around it then they are ignored", []string{" 42 "}, 200, 42, "charged"},
		{"when it has leading zeros then it is the number", []string{"0000000000000000000000042"}, 200, 42, "charged"},
		{"when it is missing then the rule's cost is charged", nil, 200, 7, "default_cost"},
		{"when it is repeated then the rule's cost is charged", []string{"1", "1"}, 200, 7, "default_cost"},
		{"when it is empty then the rule's cost is charged", []string{""}, 200, 7, "default_cost"},
		{"when it is negative then the rule's cost is charged", []string{"-300"}, 200, 7, "default_cost"},
		{"when it is signed then the rule's cost is charged", []string{"+300"}, 200, 7, "default_cost"},
		{"when it is not a number then the rule's cost is charged", []string{"lots"}, 200, 7, "default_cost"},
		{"when it is fractional then the rule's cost is charged", []string{"2.5"}, 200, 7, "default_cost"},
		{"when it is a list then the rule's cost is charged", []string{"1, 2"}, 200, 7, "default_cost"},
		{"when the response never came then the rule's cost is charged", []string{"300"}, 0, 7, "default_cost"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, result := limiter.ResponseCost(rule, c.status, func(string) []string { return c.values })
			if got != c.want || result != c.result {
				t.Errorf("cost %d (%s), want %d (%s)", got, result, c.want, c.result)
			}
		})
	}
	plain := &policy.Rule{Cost: 3, OnResponse: true}
	if got, result := limiter.ResponseCost(plain, 401, nil); got != 3 || result != "charged" {
		t.Errorf("without costFrom: %d (%s), want the rule's cost 3", got, result)
	}
}

// A front end that cannot see responses (the check API, RLS) skips concurrency rules and rules
// charged by the response, and counts each as skipped; it decides the rest as ever.
func TestLimiterWhenTheFrontEndCannotSeeResponsesThenSuchRulesAreSkippedAndCounted(t *testing.T) {
	l, _, reg := responseLimiter(t)
	ctx := context.Background()
	for _, path := range []string{"/slow", "/login", "/chat"} {
		for range 5 {
			res := l.Decide(ctx, request(path, "192.0.2.1"))
			if res.Outcome != limiter.Allowed || res.Pending != nil || res.Rule == nil || res.Rule.Name != "plain" {
				t.Fatalf("%s through a front end that cannot see responses: %+v, want decided by plain alone", path, res)
			}
		}
	}
	_, all := l.DecideAll(ctx, []limiter.Request{*request("/slow", "192.0.2.1"), *request("/login", "192.0.2.1"), *request("/chat", "192.0.2.1")})
	if all.Outcome != limiter.Allowed || all.Pending != nil {
		t.Errorf("an RLS call: %+v", all)
	}
	for _, rule := range []string{"in-flight", "failures", "tokens"} {
		if got := (counter(t, reg, "sluice_decisions_total", rule, "skipped")); got != 6 {
			t.Errorf("%s skipped %v times, want 6", rule, got)
		}
		if got := l.Counters()[limiter.RuleKey{Namespace: "test", Policy: "unit", Rule: rule}].Skipped; got != 6 {
			t.Errorf("%s's report counts %d skipped, want 6", rule, got)
		}
	}
}

// When the store cannot answer, a fail-open concurrency rule admits the request all the same,
// and its end still releases (the script may have run) and charges: both fail while the store
// does, and the charge is counted as failed.
func TestLimiterWhenTheStoreFailsThenAnAdmittedRequestStillEndsAndTheChargeIsCountedFailed(t *testing.T) {
	fs := &fakeStore{err: errors.New("connection refused")}
	reg := prometheus.NewRegistry()
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	l := limiter.New(limiter.Options{Store: fs, Metrics: limiter.NewMetrics(reg), Clock: clk})
	l.SetPolicies(policies(t, responseRules))
	for _, path := range []string{"/slow", "/login"} {
		res := l.Decide(context.Background(), proxied(path))
		if res.Outcome != limiter.Allowed || res.Pending == nil {
			t.Fatalf("%s: %+v, want admitted by the failure mode with its end owed", path, res)
		}
		res.Pending.End(http.StatusUnauthorized, nil)
	}
	settle(t, l)
	if got := (counter(t, reg, "sluice_response_charges_total", "failures", "failed")); got != 1 {
		t.Errorf("failed charges %v, want 1", got)
	}
}

// counter is the value of a per-rule metric's series of the policy test/unit ("" for a metric of
// no rule), as the registry has it now.
func counter(t *testing.T, reg *prometheus.Registry, name, rule, result string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			if (rule == "" || labels["rule"] == rule) && labels["result"] == result {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no series %s{rule=%q,result=%q}", name, rule, result)
	return 0
}

// panicStore's Finish and Renew panic: a bug of the store's.
type panicStore struct{ fakeStore }

func (*panicStore) Finish(context.Context, []store.Check, []algorithm.Decision) error {
	panic("finish")
}
func (*panicStore) Renew(context.Context, []store.Check, []algorithm.Decision) error { panic("renew") }

// A request's background work (its renewals, its end) runs beside the request paths, whose
// panics are contained: one there is contained too, and the process goes on.
func TestLimiterWhenARequestsBackgroundWorkPanicsThenTheProcessGoesOn(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	l := limiter.New(limiter.Options{Store: &panicStore{}, Clock: clk})
	l.SetPolicies(policies(t, responseRules))
	res := l.Decide(context.Background(), proxied("/slow"))
	if res.Pending == nil {
		t.Fatalf("%+v: want admitted with a lease", res)
	}
	clk.Step(time.Second) // a renewal, which panics
	res.Pending.End(http.StatusOK, nil)
	settle(t, l)
	if again := l.Decide(context.Background(), proxied("/slow")); again.Outcome != limiter.Allowed {
		t.Errorf("after the panics: %+v", again)
	}
}
