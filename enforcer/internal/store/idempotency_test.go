package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// idemCheck is a fixed-window check of limit per hour for client, carrying the idempotency key
// key ("" for none).
func idemCheck(t *testing.T, target, client string, limit int64, key string, free int64) store.Check {
	t.Helper()
	c := store.Check{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: limit, Period: time.Hour},
		Cost: 1, Enforce: true, Rule: "r", Tag: uniqueTag(t, target, client)}
	if key != "" {
		c.Idempotency = &store.Idempotency{Key: store.IdempotencyKey(key, client), Window: 10 * time.Minute, MaxRepeats: free}
	}
	return c
}

func decideOnce(t *testing.T, s store.Store, c store.Check) algorithm.Decision {
	t.Helper()
	out := make([]algorithm.Decision, 1)
	if _, err := s.Decide(context.Background(), []store.Check{c}, out); err != nil {
		t.Fatal(err)
	}
	return out[0]
}

// A retried request with the same idempotency key is not charged twice; a repeat of a refused
// one stays refused until its Retry-After, even if the limits changed meanwhile; the repeats
// after the free ones are charged; and clients that send the same key keep apart, on every store.
func TestStoresWhenARequestIsRepeatedWithItsIdempotencyKeyThenItIsChargedOnce(t *testing.T) {
	for _, tg := range targets() {
		t.Run(tg.name, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
			s := tg.make(t, clock.Now)

			// The response of an admitted request is lost, and the client retries: the bucket is
			// empty after the first, and the repeat still passes.
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 1, "order-1", 3)); !d.Allowed || d.Remaining != 0 {
				t.Fatalf("first request: %+v", d)
			}
			clock.Step(time.Second)
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 1, "order-1", 3)); !d.Allowed || d.Remaining != 0 || d.Wait != 0 {
				t.Errorf("the repeat of an admitted request: %+v, want it to pass, uncharged", d)
			}
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 1, "", 3)); d.Allowed {
				t.Error("a request without the key passed: the repeat was charged nothing, so the limit still holds")
			}

			// A refused request's repeats stay refused until its Retry-After, even under a raised
			// limit; another key is decided afresh.
			first := decideOnce(t, s, idemCheck(t, tg.name, "alice", 1, "order-2", 3))
			if first.Allowed || first.RetryAfter <= 0 {
				t.Fatalf("a request over the limit: %+v", first)
			}
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 1, "order-2", 3)); d.Allowed || d.RetryAfter <= 0 || d.RetryAfter > first.RetryAfter {
				t.Errorf("the repeat of a refused request: %+v, want refused until the first's Retry-After %v", d, first.RetryAfter)
			}
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 5, "order-2", 3)); d.Allowed {
				t.Errorf("the repeat of a refused request under a raised limit: %+v, want refused the same way", d)
			}
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 5, "order-3", 3)); !d.Allowed {
				t.Errorf("a new request under the raised limit: %+v", d)
			}

			// Two free repeats, then each repeat is charged like a new request.
			for i, want := range []int64{4, 4, 4, 3, 2} { // remaining of a limit of 5
				if d := decideOnce(t, s, idemCheck(t, tg.name, "bob", 5, "upload", 2)); !d.Allowed || d.Remaining != want {
					t.Errorf("request %d with one key and 2 free repeats: %+v, want %d remaining", i, d, want)
				}
			}

			// Clients that send the same key do not share its record.
			if d := decideOnce(t, s, idemCheck(t, tg.name, "carol", 1, "order-1", 3)); !d.Allowed {
				t.Errorf("another client's first request with alice's key: %+v, want it decided as its own", d)
			}
			if d := decideOnce(t, s, idemCheck(t, tg.name, "carol", 1, "", 3)); d.Allowed {
				t.Error("carol's first request was not charged")
			}

			// Past the record's window, the key is new again. Redis expires the record by its own
			// clock, which the fake one does not move: its TTL is checked below.
			if tg.redis {
				return
			}
			clock.Step(2 * time.Hour)
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 1, "order-1", 3)); !d.Allowed || d.Remaining != 0 {
				t.Errorf("order-1 two hours later: %+v, want decided and charged as new", d)
			}
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 1, "", 3)); d.Allowed {
				t.Error("after the record's window, the key's request was not charged")
			}
		})
	}
}

// 1,000 requests from 50 goroutines, every one sent twice with its idempotency key, against a
// limit of 100: exactly 100 keys are admitted, every repeat of an admitted key passes too, and
// the limit is used up exactly, on every store.
func TestStoresWhenRepeatsRaceThenExactlyTheLimitIsCharged(t *testing.T) {
	for _, tg := range targets() {
		t.Run(tg.name, func(t *testing.T) {
			s := tg.make(t, nil)
			var admitted [500]atomic.Int32
			var wg sync.WaitGroup
			for g := range 50 {
				wg.Go(func() {
					for i := range 20 {
						k := (g*20 + i) / 2 // requests 2k and 2k+1 carry key k
						d := decideOnce(t, s, idemCheck(t, tg.name, "crowd", 100, fmt.Sprint("key-", k), 3))
						if d.Allowed {
							admitted[k].Add(1)
						}
					}
				})
			}
			wg.Wait()
			keys, passed := 0, 0
			for i := range admitted {
				if n := admitted[i].Load(); n > 0 {
					keys++
					passed += int(n)
				}
			}
			if keys != 100 || passed != 200 {
				t.Errorf("%d keys admitted, %d requests passed; want 100 keys, each with its repeat", keys, passed)
			}
			if d := decideOnce(t, s, idemCheck(t, tg.name, "crowd", 100, "", 3)); d.Allowed || d.Remaining != 0 {
				t.Errorf("after the race: %+v, want the limit used up exactly", d)
			}
		})
	}
}

// The record of a request takes one small key under the client's hash tag, with the window as
// its TTL.
func TestRedisWhenARequestNamesItsKeyThenItsRecordIsOneSmallKeyWithATTL(t *testing.T) {
	tier.Needs(t, "redis-server")
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil)
	c := idemCheck(t, "memory", "dave", 10, "payment-7", 3)
	decideOnce(t, s, c)
	rdb := redis.NewClient(&redis.Options{Addr: standalone.Addr()})
	defer func() { _ = rdb.Close() }()
	ctx := context.Background()
	key := "sl{" + c.Tag + "}i" + c.Idempotency.Key
	usage, err := rdb.MemoryUsage(ctx, key).Result()
	ttl, _ := rdb.PTTL(ctx, key).Result()
	t.Logf("idempotency record %q: MEMORY USAGE %d B, TTL %v", key, usage, ttl)
	if err != nil || usage > 72 || ttl <= 9*time.Minute || ttl > 10*time.Minute {
		t.Errorf("record %q: %d B (%v), TTL %v; want at most 72 B and the 10m window", key, usage, err, ttl)
	}
}

// On a Cluster, rules with different client keys are decided by one script per tag; when a later
// one refuses, the refund takes back what the earlier charged, its idempotency record included,
// so the request's repeat is not passed free by the first tag.
func TestClusterWhenAnotherTagRefusesThenTheRecordIsRefundedWithTheCharge(t *testing.T) {
	tier.Needs(t, "a Redis Cluster")
	s := newRedis(t, store.RedisOptions{Mode: v1alpha1.RedisCluster, Addrs: cluster.Addrs()}, nil)
	a := idemCheck(t, "cluster", "tenant", 5, "req-9", 3)
	b := idemCheck(t, "cluster", "user", 1, "req-9", 3)
	b.Idempotency = &store.Idempotency{Key: store.IdempotencyKey("req-9", "client"), Window: 10 * time.Minute, MaxRepeats: 3}
	decideOnce(t, s, idemCheck(t, "cluster", "user", 1, "", 3)) // the user's limit is used up
	out := make([]algorithm.Decision, 2)
	for attempt := range 3 {
		ok, err := s.Decide(context.Background(), []store.Check{a, b}, out)
		if err != nil || ok || out[1].Allowed {
			t.Fatalf("attempt %d: charged %v (%v), decisions %+v; want refused by the user's rule", attempt, ok, err, out)
		}
	}
	if d := decideOnce(t, s, idemCheck(t, "cluster", "tenant", 5, "", 3)); d.Remaining != 4 {
		t.Errorf("the tenant's rule after three refused attempts and one request: %d remaining, want 4: the refused ones were refunded", d.Remaining)
	}
	if d := decideOnce(t, s, a); !d.Allowed || d.Remaining != 3 {
		t.Errorf("the tenant's rule alone with the request's key: %+v, want charged as a first request (its record refunded)", d)
	}
}

// A client that sends a new idempotency key with every request cannot grow the memory store
// without bound: records are bounded per shard like counters.
func TestMemoryWhenEveryRequestBringsANewKeyThenRecordsStayBounded(t *testing.T) {
	s := store.NewMemory(store.MemoryOptions{MaxKeys: 640, SweepInterval: -1})
	t.Cleanup(func() { _ = s.Close() })
	for i := range 20_000 {
		c := idemCheck(t, "memory", fmt.Sprint("client-", i%50), 1_000_000, fmt.Sprint("key-", i), 3)
		decideOnce(t, s, c)
	}
	if n := s.Len(); n > 2*640 {
		t.Errorf("%d keys held after 20,000 requests with new keys, want at most 640 counters and 640 records", n)
	}
}

// A record belongs to one policy: a repeat passes free only the checks that name it, and every
// other check of the request (another policy's, which never enabled idempotency) is decided and
// charged as usual, on every store.
func TestStoresWhenARepeatMatchesRulesOfAnotherPolicyThenOnlyItsRecordsRulesPassFree(t *testing.T) {
	for _, tg := range targets() {
		t.Run(tg.name, func(t *testing.T) {
			s := tg.make(t, nil)
			fw := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 5, Period: time.Hour}
			checks := []store.Check{
				{Limit: fw, Cost: 1, Enforce: true, Rule: "a", Tag: uniqueTag(t, tg.name, "with"),
					Idempotency: &store.Idempotency{Key: store.IdempotencyKey("order-1", "alice"), Window: time.Minute, MaxRepeats: 3}},
				{Limit: fw, Cost: 1, Enforce: true, Rule: "b", Tag: uniqueTag(t, tg.name, "without")},
			}
			for i, want := range [][2]int64{{4, 4}, {4, 3}, {4, 2}} {
				out := make([]algorithm.Decision, 2)
				charged, err := s.Decide(context.Background(), checks, out)
				if err != nil || !charged || !out[0].Allowed || !out[1].Allowed {
					t.Fatalf("request %d: %v %+v %v", i, charged, out, err)
				}
				if got := [2]int64{out[0].Remaining, out[1].Remaining}; got != want {
					t.Errorf("request %d: remaining %v, want %v: the repeat passes the idempotent policy's rule free, and the other policy's is charged", i, got, want)
				}
			}
			// The other policy refuses: the repeat is refused, and its record keeps its count.
			checks[1].Cost = 3
			out := make([]algorithm.Decision, 2)
			if charged, err := s.Decide(context.Background(), checks, out); err != nil || charged || out[1].Allowed || !out[0].Allowed {
				t.Fatalf("over the other limit: %v %+v %v", charged, out, err)
			}
			checks[1].Cost = 1
			if charged, err := s.Decide(context.Background(), checks, out); err != nil || !charged || out[0].Remaining != 4 || out[1].Remaining != 1 {
				t.Errorf("the third repeat: %v %+v %v, want free on a and charged on b", charged, out, err)
			}
		})
	}
}

// A request that can never pass (its cost above the limit) leaves no refused record: its repeat
// is refused as it was, as never passing, and carries no Retry-After that the record's time
// would promise, on every store; a passing request with the same key is then decided afresh.
func TestStoresWhenARequestThatCanNeverPassIsRepeatedThenTheRepeatCanNeverPassEither(t *testing.T) {
	for _, tg := range targets() {
		t.Run(tg.name, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
			s := tg.make(t, clock.Now)
			huge := idemCheck(t, tg.name, "alice", 5, "order-1", 3)
			huge.Cost = 6
			for attempt := range 2 {
				if d := decideOnce(t, s, huge); d.Allowed || !d.Never || d.RetryAfter != 0 {
					t.Fatalf("attempt %d: %+v, want never passing without a Retry-After", attempt, d)
				}
			}
			if d := decideOnce(t, s, idemCheck(t, tg.name, "alice", 5, "order-1", 3)); !d.Allowed || d.Remaining != 4 {
				t.Errorf("the same key at a cost that fits: %+v, want it decided and charged", d)
			}
		})
	}
}
