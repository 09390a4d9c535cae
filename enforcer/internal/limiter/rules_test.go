package limiter_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/policy"
)

// Two policies of 20 rules each in one file: every request matches 40 rules. They are decided
// together on every store, charged all or none, and the limit holds.
func TestLimiterWhenARequestMatchesMoreRulesThanOnePolicyHoldsThenAllAreDecidedTogether(t *testing.T) {
	doc := func(name string, first int, skip int) string {
		var rules strings.Builder
		for i := first; i < first+20; i++ {
			if i == skip {
				continue
			}
			fmt.Fprintf(&rules, "    - name: r%d\n      fixedWindow: {limit: %d, window: 1h}\n", i, 3+i)
		}
		return fmt.Sprintf("apiVersion: ratelimit.sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: %s, namespace: many}\nspec:\n  targetRef: {name: api, port: 80}\n  defaultFailureMode: Closed\n  rules:\n%s---\n", name, rules.String())
	}
	for storeName, newStore := range testStores() {
		t.Run(storeName, func(t *testing.T) {
			l := limiter.New(limiter.Options{Store: newStore(t), BreakerFailures: 3, BreakerOpen: time.Second, RefusalCache: true, Log: logr.Discard()})
			load := func(skip int) []*policy.Policy {
				return policies(t, doc("a", 0, skip)+doc("b", 20, skip))
			}
			req := &limiter.Request{Method: "GET", Path: "/", Peer: netip.MustParseAddr("192.0.2.9")}
			count := func(n int) (allowed int) {
				for range n {
					switch l.Decide(context.Background(), req).Outcome {
					case limiter.Allowed:
						allowed++
					case limiter.Unavailable:
						t.Fatal("a decision of 40 rules failed")
					}
				}
				return allowed
			}
			l.SetPolicies(load(-1))
			if n := count(6); n != 3 {
				t.Fatalf("admitted %d of 6, want 3: r0's limit", n)
			}
			// Without r0, r1 (limit 4) binds. It was charged 3 times, never by a refused
			// request, so it admits exactly one more.
			l.SetPolicies(load(0))
			if n := count(4); n != 1 {
				t.Errorf("without r0: admitted %d of 4, want 1", n)
			}
		})
	}
}
