package limiter_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// algorithms are the five algorithms at a limit of n units an hour, so that nothing refills
// during a test.
var algorithms = map[string]func(n int) string{
	"tokenBucket": func(n int) string {
		return fmt.Sprintf("tokenBucket: {capacity: %d, refill: {tokens: 1, period: 1h}}", n)
	},
	"leakyBucket": func(n int) string {
		return fmt.Sprintf("leakyBucket: {capacity: %d, drain: {requests: 1, period: 1h}}", n)
	},
	"fixedWindow":          func(n int) string { return fmt.Sprintf("fixedWindow: {limit: %d, window: 1h}", n) },
	"slidingLog":           func(n int) string { return fmt.Sprintf("slidingLog: {limit: %d, window: 1h}", n) },
	"slidingWindowCounter": func(n int) string { return fmt.Sprintf("slidingWindowCounter: {limit: %d, window: 1h}", n) },
}

func compiled(t *testing.T, name, algorithm string) *policy.Policy {
	t.Helper()
	return policies(t, fmt.Sprintf(`apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: %s, namespace: reload}
spec:
  targetRef: {name: api, port: 80}
  defaultFailureMode: Closed
  rules:
    - name: r
      %s
`, name, algorithm))[0]
}

// A rule hot-reloaded under the same name with another algorithm never reads the old
// algorithm's state as its own: on every store, under traffic, no decision fails (a fail-closed
// rule would answer Unavailable) and the new rule admits exactly its limit from its first
// decision.
func TestLimiterWhenARuleChangesAlgorithmUnderTrafficThenTheNewRuleIsExactFromItsFirstDecision(t *testing.T) {
	for storeName, newStore := range testStores() {
		t.Run(storeName, func(t *testing.T) {
			s := newStore(t)
			for from, fromRule := range algorithms {
				for to, toRule := range algorithms {
					if from == to {
						continue
					}
					t.Run("when "+from+" becomes "+to, func(t *testing.T) {
						name := strings.ToLower(from + "-" + to)
						old, next := compiled(t, name, fromRule(5)), compiled(t, name, toRule(4))
						reloadUnderTraffic(t, s, old, next)
					})
				}
			}
		})
	}
}

// testStores start each kind of store: memory, a Redis server, a 3-master Redis Cluster.
func testStores() map[string]func(t *testing.T) store.Store {
	return map[string]func(t *testing.T) store.Store{
		"memory": func(*testing.T) store.Store { return store.NewMemory(store.MemoryOptions{}) },
		"redis standalone": func(t *testing.T) store.Store {
			t.Helper()
			return redisStore(t, standaloneOptions(redistest.NewServer(t).Addr()))
		},
		"redis cluster": func(t *testing.T) store.Store {
			t.Helper()
			return redisStore(t, store.RedisOptions{Mode: v1alpha1.RedisCluster, Addrs: redistest.NewCluster(t, 3).Addrs(), Timeout: 2 * time.Second})
		},
	}
}

func redisStore(t *testing.T, opts store.RedisOptions) store.Store {
	t.Helper()
	s, err := store.NewRedis(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func reloadUnderTraffic(t *testing.T, s store.Store, old, next *policy.Policy) {
	t.Helper()
	l := limiter.New(limiter.Options{Store: s, BreakerFailures: 3, BreakerOpen: time.Second, RefusalCache: true})
	l.SetPolicies([]*policy.Policy{old})
	req := &limiter.Request{Method: "GET", Path: "/", Peer: netip.MustParseAddr("192.0.2.1")}
	ctx := context.Background()
	for i := range 8 { // the old rule's state: 5 admitted, then refusals
		if res := l.Decide(ctx, req); (res.Outcome == limiter.Allowed) != (i < 5) {
			t.Fatalf("old rule, request %d: outcome %v", i, res.Outcome)
		}
	}

	var (
		mu                     sync.Mutex
		underNext, allowedNext int
		unavailable            int
		wg                     sync.WaitGroup
		stop                   = make(chan struct{})
		reloaded               = make(chan struct{})
		decidedBeforeTheReload = make(chan struct{}, 4)
	)
	for range 4 {
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				res := l.Decide(ctx, req)
				mu.Lock()
				if res.Outcome == limiter.Unavailable {
					unavailable++
				}
				if res.Rule == &next.Rules[0] {
					underNext++
					if res.Outcome == limiter.Allowed {
						allowedNext++
					}
				}
				mu.Unlock()
				if n == 5 {
					decidedBeforeTheReload <- struct{}{}
					<-reloaded
				}
			}
		})
	}
	for range 4 {
		<-decidedBeforeTheReload
	}
	l.SetPolicies([]*policy.Policy{next})
	close(reloaded)
	_ = poll.Until(10*time.Second, poll.True("40 decisions under the new policies", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return underNext >= 40
	})) // on a timeout the counts below fail the test
	close(stop)
	wg.Wait()
	if unavailable > 0 {
		t.Errorf("%d decisions failed in the store (the fail-closed rule answered Unavailable)", unavailable)
	}
	if underNext < 40 {
		t.Fatalf("only %d decisions under the new rule", underNext)
	}
	if allowedNext != 4 {
		t.Errorf("the new rule admitted %d of %d, want exactly its limit 4", allowedNext, underNext)
	}
}
