package store_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// The Redis topologies leases run on: standalone and Cluster.
func leaseTopologies() map[string]store.RedisOptions {
	return map[string]store.RedisOptions{
		"standalone": {Addrs: []string{standalone.Addr()}},
		"cluster":    {Mode: v1alpha1.RedisCluster, Addrs: cluster.Addrs()},
	}
}

// enforcers are n Redis stores, each with its own connections and leases, sharing one Redis, on
// clock (nil: Redis TIME).
func enforcers(t *testing.T, n int, opts store.RedisOptions, clock func() time.Time) []store.Store {
	t.Helper()
	var ss []store.Store
	for range n {
		ss = append(ss, newRedis(t, opts, clock))
	}
	return ss
}

var leasedLimits = []algorithm.Limit{
	{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: 720 * time.Hour},
	{Kind: algorithm.FixedWindow, Limit: 100, Period: 720 * time.Hour},
}

func leased(l algorithm.Limit, tag, rule string, cost, most int64, expiry time.Duration) store.Check {
	return store.Check{Limit: l, Cost: cost, Enforce: true, Tag: tag, Rule: rule, UnitLease: &store.UnitLease{Max: most, Expiry: expiry}}
}

// flood sends requests decisions of checks, from goroutines spread over the stores, and
// returns how many were admitted.
func flood(t *testing.T, stores []store.Store, checks []store.Check, requests, goroutines int) int {
	t.Helper()
	var passed, errs, next atomic.Int64
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			s := stores[g%len(stores)]
			out := make([]algorithm.Decision, len(checks))
			for next.Add(1) <= int64(requests) {
				ok, err := s.Decide(context.Background(), checks, out)
				if err != nil {
					errs.Add(1)
					continue
				}
				if ok {
					passed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	for _, s := range stores {
		if r, ok := s.(*store.Redis); ok {
			r.WaitRefills()
		}
	}
	if errs.Load() > 0 {
		t.Fatalf("%d decisions failed", errs.Load())
	}
	return int(passed.Load())
}

// 1,000 concurrent requests against a limit of 100, through three enforcers that lease up to 10
// units at a time: exactly 100 pass, on a token bucket and a fixed window, on a standalone Redis
// and a Cluster, run after run. Without the leases' charge when taken, or with two trips of one
// enforcer for one key at once, more would pass.
func TestLeasesWhenAThousandRaceThroughThreeEnforcersThenExactlyTheLimitPasses(t *testing.T) {
	tier.Needs(t, "redis-server")
	for topo, opts := range leaseTopologies() {
		for _, l := range leasedLimits {
			t.Run(topo+"/"+l.Kind.String(), func(t *testing.T) {
				stores := enforcers(t, 3, opts, nil)
				for rep := range 10 {
					checks := []store.Check{leased(l, uniqueTag(t, rep), "r", 1, 10, time.Minute)}
					if got := flood(t, stores, checks, 1000, 48); got != 100 {
						t.Fatalf("run %d: %d of 1000 passed, want exactly 100", rep, got)
					}
				}
			})
		}
	}
}

// A token bucket of 100 that refills 100 a minute, leased 10 at a time by three enforcers and
// flooded every second of a minute (a fake clock that all of them and Redis share): exactly the
// capacity plus a minute's refill passes, 200, and never more than the refill in a second after
// the first.
func TestLeasesWhenATokenBucketRefillsOverAMinuteThenExactlyCapacityAndRefillPass(t *testing.T) {
	tier.Needs(t, "redis-server")
	for topo, opts := range leaseTopologies() {
		t.Run(topo, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
			stores := enforcers(t, 3, opts, clock.Now)
			l := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Minute}
			checks := []store.Check{leased(l, uniqueTag(t), "r", 1, 10, time.Minute)}
			total := 0
			for sec := range 61 {
				if sec > 0 {
					clock.Step(time.Second)
				}
				got := flood(t, stores, checks, 150, 6)
				if sec > 0 && got > 2 {
					t.Fatalf("second %d: %d passed, want at most 2 (100 a minute)", sec, got)
				}
				total += got
			}
			if total != 200 {
				t.Fatalf("%d passed over a minute, want exactly 200 (capacity 100 + 100 refilled)", total)
			}
		})
	}
}

// An enforcer that leased units and died (it never comes back for them): while its lease lasts,
// the bucket holds at most its capacity less the units out, so the others together never pass
// more than one bucket; once the lease expires, the bucket refills to its whole capacity.
func TestLeasesWhenAnEnforcerDiesHoldingUnitsThenTheBucketIsWholeAgainAfterTheLeaseExpires(t *testing.T) {
	tier.Needs(t, "redis-server")
	for topo, opts := range leaseTopologies() {
		t.Run(topo, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
			stores := enforcers(t, 2, opts, clock.Now)
			dead, alive := stores[0], stores[1:]
			l := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Minute}
			checks := []store.Check{leased(l, uniqueTag(t), "r", 1, 50, 10*time.Second)}
			out := make([]algorithm.Decision, 1)
			if ok, err := dead.Decide(context.Background(), checks, out); err != nil || !ok {
				t.Fatalf("the first request: %v, %v", ok, err)
			}
			// It took 50: 1 for its request, 49 it holds. 9s later the bucket would have refilled
			// to 65 of its own, but 49 are out: at most 51.
			clock.Step(9 * time.Second)
			if got := flood(t, alive, checks, 200, 4); got != 51 {
				t.Fatalf("while the lease lasts: %d passed, want 51 (100 less the 49 leased out)", got)
			}
			// The lease expired at 10s; from there the bucket refills 100 a minute to 100.
			clock.Step(61 * time.Second)
			if got := flood(t, alive, checks, 300, 4); got != 100 {
				t.Fatalf("after the lease expired and a minute passed: %d passed, want the whole capacity, 100", got)
			}
		})
	}
}

// A fixed window's units die with their window: an enforcer that leased and died is forgotten
// when the window ends.
func TestLeasesWhenAnEnforcerDiesHoldingAWindowsUnitsThenTheNextWindowIsWhole(t *testing.T) {
	tier.Needs(t, "redis-server")
	clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
	stores := enforcers(t, 2, store.RedisOptions{Addrs: []string{standalone.Addr()}}, clock.Now)
	l := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 100, Period: time.Minute}
	checks := []store.Check{leased(l, uniqueTag(t), "r", 1, 50, time.Hour)}
	out := make([]algorithm.Decision, 1)
	if ok, err := stores[0].Decide(context.Background(), checks, out); err != nil || !ok {
		t.Fatalf("the first request: %v, %v", ok, err)
	}
	if got := flood(t, stores[1:], checks, 200, 4); got != 50 {
		t.Fatalf("in the window of the lease: %d passed, want 50", got)
	}
	clock.Step(time.Minute)
	if got := flood(t, stores[1:], checks, 200, 4); got != 100 {
		t.Fatalf("in the next window: %d passed, want 100", got)
	}
	// The dead enforcer's lease ended with its window, though its expiry is an hour away.
	if ok, err := stores[0].Decide(context.Background(), checks, out); err != nil || ok {
		t.Fatalf("the lease's enforcer, in the next window: %v, %v; want refused: its units were the last window's", ok, err)
	}
}

// A request that matches a leased rule and an unleased one is charged on both or neither: the
// unleased limit of 5 refuses after 5, and the leased rule loses nothing to the refused requests,
// whether they were decided from the lease or in Redis: across two enforcers exactly its 100
// pass in the end.
func TestLeasesWhenALeasedAndAnUnleasedRuleMatchAndOneRefusesThenNeitherIsCharged(t *testing.T) {
	tier.Needs(t, "redis-server")
	for topo, opts := range leaseTopologies() {
		t.Run(topo, func(t *testing.T) {
			stores := enforcers(t, 2, opts, nil)
			tag := uniqueTag(t)
			budget := leased(algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 100, Period: time.Hour}, tag, "budget", 1, 10, time.Minute)
			small := store.Check{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 5, Period: time.Hour}, Cost: 1, Enforce: true, Tag: tag, Rule: "small"}
			if got := flood(t, stores[:1], []store.Check{budget, small}, 50, 1); got != 5 {
				t.Fatalf("both rules: %d passed, want 5", got)
			}
			if got := flood(t, stores, []store.Check{budget}, 300, 4); got != 95 {
				t.Fatalf("the leased rule alone: %d passed, want the 95 left", got)
			}
		})
	}
	// On a Cluster with the two rules under two client keys (two scripts): the same.
	t.Run("cluster/two-tags", func(t *testing.T) {
		stores := enforcers(t, 2, leaseTopologies()["cluster"], nil)
		budget := leased(algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 100, Period: time.Hour}, uniqueTag(t, "a"), "budget", 1, 10, time.Minute)
		small := store.Check{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 5, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t, "b"), Rule: "small"}
		if got := flood(t, stores[:1], []store.Check{budget, small}, 50, 1); got != 5 {
			t.Fatalf("both rules: %d passed, want 5", got)
		}
		if got := flood(t, stores, []store.Check{budget}, 300, 4); got != 95 {
			t.Fatalf("the leased rule alone: %d passed, want the 95 left", got)
		}
	})
}

// One enforcer's headers from a lease are what one store without a lease says, request after
// request: the remaining units count what Redis granted less what was used, never more.
func TestLeasesWhenOneEnforcerDecidesFromALeaseThenItsDecisionsAreTheMemoryStores(t *testing.T) {
	tier.Needs(t, "redis-server")
	for _, l := range []algorithm.Limit{
		{Kind: algorithm.TokenBucket, Limit: 30, Rate: 30, Period: time.Hour},
		{Kind: algorithm.FixedWindow, Limit: 30, Period: time.Hour},
	} {
		t.Run(l.Kind.String(), func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
			mem := store.NewMemory(store.MemoryOptions{Now: clock.Now, SweepInterval: -1})
			t.Cleanup(func() { _ = mem.Close() })
			rs := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, clock.Now)
			checks := []store.Check{leased(l, uniqueTag(t), "r", 2, 7, time.Minute)}
			for i := range 20 {
				want, got := make([]algorithm.Decision, 1), make([]algorithm.Decision, 1)
				wok, err := mem.Decide(context.Background(), checks, want)
				if err != nil {
					t.Fatal(err)
				}
				gok, err := rs.Decide(context.Background(), checks, got)
				if err != nil {
					t.Fatal(err)
				}
				if gok != wok || got[0].Allowed != want[0].Allowed || got[0].Remaining != want[0].Remaining {
					t.Fatalf("request %d: leased %v %+v, memory %v %+v", i, gok, got[0], wok, want[0])
				}
			}
		})
	}
}

// A hot key through one enforcer leasing 100 at a time, refilled ahead when a quarter is left:
// at most one script per 50 decisions.
func TestLeasesWhenOneKeyIsHotThenAScriptDecidesAHundredRequests(t *testing.T) {
	tier.Needs(t, "redis-server")
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil)
	admin := standalone.Client(t)
	l := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1_000_000, Period: time.Hour}
	checks := []store.Check{leased(l, uniqueTag(t), "r", 1, 100, time.Minute)}
	before := scriptCalls(t, admin)
	if got := flood(t, []store.Store{s}, checks, 10_000, 8); got != 10_000 {
		t.Fatalf("%d of 10000 passed", got)
	}
	if scripts := scriptCalls(t, admin) - before; scripts > 200 {
		t.Fatalf("%d scripts for 10,000 decisions, want at most 200 (leases of 75 to 100)", scripts)
	}
}

// Units used at the last moment of their lease count as used then: a bucket whose lease
// held 49 stays at most 51 of its own until the lease expires, so right after it, with the 49
// spent just before, the others and the lease's own enforcer (which refilled its lease as it
// ran low) pass 51 together, not the 66 a bucket that forgot the bound would have refilled to:
// 100 in a fifth of a second, one bucket.
func TestLeasesWhenUnitsAreSpentJustBeforeTheLeaseExpiresThenOneBucketIsAllThatPasses(t *testing.T) {
	tier.Needs(t, "redis-server")
	for topo, opts := range leaseTopologies() {
		t.Run(topo, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
			stores := enforcers(t, 2, opts, clock.Now)
			l := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Minute}
			checks := []store.Check{leased(l, uniqueTag(t), "r", 1, 50, 10*time.Second)}
			if got := flood(t, stores[:1], checks, 1, 1); got != 1 {
				t.Fatalf("the first request: %d passed", got)
			}
			clock.Step(9900 * time.Millisecond)
			if got := flood(t, stores[:1], checks, 49, 1); got != 49 {
				t.Fatalf("the lease's 49, just before it expires: %d passed", got)
			}
			clock.Step(200 * time.Millisecond)
			others := flood(t, stores[1:], checks, 200, 4)
			if got := others + flood(t, stores[:1], checks, 200, 4); got != 51 {
				t.Fatalf("right after the lease expired: %d passed (%d through the others), want 51: with the 49 just spent, one bucket", got, others)
			}
		})
	}
}

// A fixed window's units an enforcer leased and never used go back to Redis with its next trip
// for the rule once the lease expires: the window still admits its whole limit. (A token
// bucket's refill instead: TestLeasesWhenATripMayOutlastTheUnitsHeldThenTheyAreNotSpent.)
func TestLeasesWhenALeaseExpiresUnusedThenAWindowsUnitsGoBackWithTheNextTrip(t *testing.T) {
	tier.Needs(t, "redis-server")
	for topo, opts := range leaseTopologies() {
		t.Run(topo, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0).Truncate(time.Hour))
			stores := enforcers(t, 2, opts, clock.Now)
			l := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Hour}
			checks := []store.Check{leased(l, uniqueTag(t), "r", 1, 5, time.Second)}
			total := flood(t, stores[:1], checks, 1, 1) // takes 5, holds 4
			clock.Step(2 * time.Second)                 // they expire unused
			total += flood(t, stores[:1], checks, 1, 1) // gives them back, takes 5 again
			total += flood(t, stores[1:], checks, 20, 2)
			total += flood(t, stores[:1], checks, 20, 1)
			if total != 10 {
				t.Fatalf("%d passed in all, want the whole limit, 10", total)
			}
		})
	}
}

// An enforcer's own lease, spent, never lowers what it may take next: a bucket drained through one
// enforcer and refilled for 59 s of a minute gives it 98 again, not the 51 that the 49 it was
// last leased (still recorded, unexpired) would leave to the others.
func TestLeasesWhenAnEnforcerSpentItsLeaseThenItsOwnRecordDoesNotHoldItBack(t *testing.T) {
	tier.Needs(t, "redis-server")
	for topo, opts := range leaseTopologies() {
		t.Run(topo, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
			stores := enforcers(t, 1, opts, clock.Now)
			l := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Minute}
			checks := []store.Check{leased(l, uniqueTag(t), "r", 1, 50, time.Minute)}
			if got := flood(t, stores, checks, 200, 4); got != 100 {
				t.Fatalf("a full bucket: %d passed, want 100", got)
			}
			clock.Step(59 * time.Second)
			if got := flood(t, stores, checks, 200, 4); got != 98 {
				t.Fatalf("59 s later: %d passed, want the 98 refilled", got)
			}
		})
	}
}
