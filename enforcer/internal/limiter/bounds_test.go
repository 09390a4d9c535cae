package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

const slidingLogOfFive = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: hits, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: log
      key: [{type: RemoteAddress}]
      cost: 2
      slidingLog: {limit: 5, window: 1h}
`

// Hits multiply a rule's cost at run time, past any bound the schema holds the cost to: a product
// over the limit, up to one that would overflow int64, is refused as one that can never pass, by
// the store and without a Retry-After, and it never reaches the failure mode.
func TestLimiterWhenHitsTimesCostExceedTheLimitThenRefusedAsNever(t *testing.T) {
	stores := map[string]store.Store{"memory": store.NewMemory(store.MemoryOptions{SweepInterval: -1})}
	if !tier.Fast() {
		stores["redis"] = redisStore(t, standaloneOptions(redistest.NewServer(t).Addr()))
	}
	for name, s := range stores {
		t.Run(name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			l := limiter.New(limiter.Options{Store: s, Metrics: limiter.NewMetrics(reg), BreakerFailures: 3, BreakerOpen: time.Hour})
			l.SetPolicies(policies(t, slidingLogOfFive))
			for _, hits := range []int64{3, 1000, math.MaxInt64 / 2, math.MaxInt64} {
				req := request("/", "192.0.2.1")
				req.Hits = hits
				res := l.Decide(context.Background(), req)
				if res.Outcome != limiter.Limited || !res.Never || res.RetryAfter != 0 || res.Rule == nil || res.Decision.Remaining != 5 {
					t.Errorf("hits %d: %+v, want Limited, never, no Retry-After, nothing charged", hits, res)
				}
				_, all := l.DecideAll(context.Background(), []limiter.Request{*request("/", "192.0.2.1"), *req})
				if all.Outcome != limiter.Limited || !all.Never {
					t.Errorf("hits %d among descriptors: %+v, want the never refusal to be the overall one", hits, all)
				}
			}
			if n := metric(t, reg, "sluice_store_errors_total", "cause", "fault"); n != 0 {
				t.Errorf("faults: %v, want 0", n)
			}
			if res := l.Decide(context.Background(), request("/", "192.0.2.1")); res.Outcome != limiter.Allowed || res.Decision.Remaining != 3 {
				t.Errorf("a request of cost 2 afterwards: %+v, want allowed with 3 remaining", res)
			}
		})
	}
}

const neverPolicies = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: hits, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: open
      match: {path: {value: /open}}
      key: [{type: RemoteAddress}]
      failureMode: Open
      cost: 2
      slidingLog: {limit: 5, window: 1h}
    - name: closed
      match: {path: {value: /closed}}
      key: [{type: RemoteAddress}]
      failureMode: Closed
      fixedWindow: {limit: 5, window: 1h}
`

// A cost that can never pass is refused as such when the store cannot answer too, before the
// breaker opens and after: the store would refuse it whatever its state, so a fail-open rule
// must not admit it, nor a fail-closed one turn it into a 503 that promises a retry. Costs the
// rule can hold still follow the failure modes, and descriptors repeated in one call are held
// to their sum.
func TestLimiterWhenTheStoreCannotAnswerThenACostNoLimitHoldsIsStillRefusedAsNever(t *testing.T) {
	reg := prometheus.NewRegistry()
	fs := &fakeStore{err: errors.New("dial tcp: connection refused")}
	l := limiter.New(limiter.Options{Store: fs, Metrics: limiter.NewMetrics(reg), BreakerFailures: 3, BreakerOpen: time.Hour})
	l.SetPolicies(policies(t, neverPolicies))
	ctx := context.Background()
	with := func(path string, hits int64) *limiter.Request {
		r := request(path, "192.0.2.1")
		r.Hits = hits
		return r
	}
	for i := range 5 { // three failures open the breaker: the rest never reach the store
		if res := l.Decide(ctx, with("/open", 3)); res.Outcome != limiter.Limited || !res.Never || res.RetryAfter != 0 || res.Rule == nil || res.Rule.Name != "open" {
			t.Errorf("decision %d, cost 6 on a fail-open sliding log of 5: %+v, want Limited, never, no Retry-After", i, res)
		}
		if res := l.Decide(ctx, with("/closed", 6)); res.Outcome != limiter.Limited || !res.Never || res.RetryAfter != 0 {
			t.Errorf("decision %d, cost 6 on a fail-closed window of 5: %+v, want Limited, never, not Unavailable", i, res)
		}
	}
	if !l.BreakerOpen() {
		t.Fatal("the breaker is closed after the store failed")
	}
	if res := l.Decide(ctx, with("/open", 2)); res.Outcome != limiter.Allowed {
		t.Errorf("cost 4 on the fail-open rule: %+v, want its failure mode, Allowed", res)
	}
	if res := l.Decide(ctx, with("/closed", 5)); res.Outcome != limiter.Unavailable {
		t.Errorf("cost 5 on the fail-closed rule: %+v, want its failure mode, Unavailable", res)
	}
	per, all := l.DecideAll(ctx, []limiter.Request{*with("/closed", 1), *with("/open", 3)})
	if all.Outcome != limiter.Limited || !all.Never || per[0].Outcome != limiter.Unavailable {
		t.Errorf("a fail-closed request beside a never-passing one: %+v overall (%+v first), want the never refusal overall", all, per[0])
	}
	if _, all := l.DecideAll(ctx, []limiter.Request{*with("/open", 2), *with("/open", 1)}); all.Outcome != limiter.Limited || !all.Never {
		t.Errorf("one client's requests of cost 4 and 2 together on a limit of 5: %+v, want never", all)
	}
	for rule, want := range map[string]float64{"open": 8, "closed": 5} {
		if n := ruleMetric(t, reg, rule, "limited"); n != want {
			t.Errorf("rule %s: %v limited decisions, want %v: one per never-passing check", rule, n, want)
		}
	}
}

// A client that leaves is neither a success nor a failure: its cancelled decisions are counted on
// their own and never open the breaker, so the store keeps deciding everyone else. A deadline
// that passes is still a failure.
func TestLimiterWhenClientsCancelThenTheBreakerStaysClosedAndCancellationsAreCounted(t *testing.T) {
	srv := redistest.NewServer(t)
	s := redisStore(t, standaloneOptions(srv.Addr()))
	reg := prometheus.NewRegistry()
	l := limiter.New(limiter.Options{Store: s, Metrics: limiter.NewMetrics(reg), BreakerFailures: 3, BreakerOpen: time.Hour})
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 100)))
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for range 10 {
		l.Decide(cancelled, request("/open", "192.0.2.1"))
		l.DecideAll(cancelled, []limiter.Request{*request("/closed", "192.0.2.1")})
	}
	if l.BreakerOpen() {
		t.Fatal("20 cancelled decisions opened the breaker")
	}
	if res := l.Decide(context.Background(), request("/closed", "192.0.2.2")); res.Outcome != limiter.Allowed {
		t.Errorf("another client after the cancellations: %v, want Allowed by the store", res.Outcome)
	}
	for _, c := range []struct {
		name, label, value string
		want               float64
	}{
		{"sluice_decisions_cancelled_total", "", "", 20},
		{"sluice_store_errors_total", "cause", "unavailable", 0},
		{"sluice_store_errors_total", "cause", "fault", 0},
		{"sluice_decisions_total", "result", "failed_open", 0},
		{"sluice_decisions_total", "result", "failed_closed", 0},
	} {
		if n := metric(t, reg, c.name, c.label, c.value); n != c.want {
			t.Errorf("%s{%s=%q} = %v, want %v", c.name, c.label, c.value, n, c.want)
		}
	}

	fs := &fakeStore{err: fmt.Errorf("run the decide script: %w", context.DeadlineExceeded)}
	l = limiter.New(limiter.Options{Store: fs, BreakerFailures: 3, BreakerOpen: time.Hour})
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 100)))
	for range 3 {
		l.Decide(context.Background(), request("/open", "192.0.2.1"))
	}
	if !l.BreakerOpen() {
		t.Error("three store deadlines passed and the breaker is closed")
	}
}

const idempotentAndNot = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: orders, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  retries:
    idempotencyKey: {maxRepeats: 3}
  rules:
    - name: everyone
      fixedWindow: {limit: 10, window: 1h}
---
apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: plain, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: per-client
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 10, window: 1h}
`

// An idempotency record belongs to one policy and one client: another client that sends the same
// key under a rule with no client key is charged as new, and a repeat passes free only the rules
// of the policy that enabled idempotency; another policy's rules are charged.
func TestLimiterWhenARepeatComesFromAnotherClientOrPolicyThenItIsCharged(t *testing.T) {
	stores := map[string]store.Store{"memory": store.NewMemory(store.MemoryOptions{SweepInterval: -1})}
	if !tier.Fast() {
		stores["redis"] = redisStore(t, standaloneOptions(redistest.NewServer(t).Addr()))
	}
	for name, s := range stores {
		t.Run(name, func(t *testing.T) {
			l := limiter.New(limiter.Options{Store: s})
			l.SetPolicies(policies(t, idempotentAndNot))
			remaining := func(peer string) (everyone, perClient int64) {
				t.Helper()
				per, _ := l.DecideAll(context.Background(), []limiter.Request{*request("/", peer, "Idempotency-Key", "order-1")})
				if per[0].Outcome != limiter.Allowed {
					t.Fatalf("%s: %+v", peer, per[0])
				}
				// The result describes the rule closest to its limit; ask each policy alone.
				one := request("/", peer)
				one.Policy = "test/orders"
				e := l.Decide(context.Background(), one).Decision.Remaining
				one.Policy = "test/plain"
				return e, l.Decide(context.Background(), one).Decision.Remaining
			}
			// Each probe above charges one more unit to each rule; subtract them.
			e1, p1 := remaining("192.0.2.1") // first: charged on both, then the probes
			e2, p2 := remaining("192.0.2.1") // repeat: free on orders, charged on plain
			if e1-e2 != 1 || p1-p2 != 2 {
				t.Errorf("the repeat charged %d on the idempotent policy (want 0) and %d on the other (want 1)", e1-e2-1, p1-p2-1)
			}
			e3, _ := remaining("192.0.2.9") // another client, the same key
			if e2-e3 != 2 {
				t.Errorf("another client's request with the same key charged %d on the key-less rule, want 1: the clients shared a record", e2-e3-1)
			}
		})
	}
}

// ruleMetric is a rule's sluice_decisions_total of one result.
func ruleMetric(t *testing.T, reg *prometheus.Registry, rule, result string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			if f.GetName() == "sluice_decisions_total" && hasLabel(m.GetLabel(), "rule", rule) && hasLabel(m.GetLabel(), "result", result) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}
