package limiter_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// While Redis is down, an enforcer still decides from the units it leased, even with its breaker
// open; those decisions never reached Redis, so they neither keep the breaker closed nor close
// it: a rule without a lease fails fast (its failure mode, no wait for Redis's timeout) as
// without leases, and a leased client whose units ran out gets its rule's failure mode too.
func TestLimiterWhenRedisIsDownThenLeasedUnitsStillDecideAndTheBreakerOpensAsWithout(t *testing.T) {
	srv := redistest.NewServer(t)
	ps := policies(t, `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: leases, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  defaultFailureMode: Closed
  rules:
    - name: leased
      match: {path: {value: /leased}}
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 1000, window: 1h}
      lease: {max: 20, expiry: 1m}
    - name: plain
      match: {path: {value: /plain}}
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 1000, window: 1h}
`)
	opts := standaloneOptions(srv.Addr())
	opts.Timeout = 300 * time.Millisecond
	l := limiter.New(limiter.Options{Store: redisStore(t, opts), Metrics: limiter.NewMetrics(prometheus.NewRegistry()),
		BreakerFailures: 3, BreakerOpen: time.Hour})
	l.SetPolicies(ps)
	ctx := context.Background()
	req := func(path string) *limiter.Request {
		return &limiter.Request{Method: "GET", Path: path, Peer: netip.MustParseAddr("192.0.2.1")}
	}
	if res := l.Decide(ctx, req("/leased")); res.Outcome != limiter.Allowed {
		t.Fatalf("the first leased request: %v", res.Outcome)
	}
	srv.Kill()
	// 19 units held; interleaved with requests of the plain rule, which fail and open the breaker.
	for i := range 19 {
		if res := l.Decide(ctx, req("/leased")); res.Outcome != limiter.Allowed || res.Decision.Remaining != int64(998-i) {
			t.Fatalf("leased request %d with Redis down: %v, remaining %d; want allowed from the lease, %d left", i, res.Outcome, res.Decision.Remaining, 998-i)
		}
		if i < 3 {
			if res := l.Decide(ctx, req("/plain")); res.Outcome != limiter.Unavailable {
				t.Fatalf("plain request %d with Redis down: %v, want Unavailable", i, res.Outcome)
			}
		}
	}
	if !l.BreakerOpen() {
		t.Fatal("the breaker is closed after three failures among leased decisions; want it open")
	}
	if res := l.Decide(ctx, req("/leased")); res.Outcome != limiter.Unavailable {
		t.Fatalf("a leased request once its units ran out: %v, want Unavailable (fail closed)", res.Outcome)
	}
}
