package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// A request's whole life on every store, on a fake clock: a concurrency limit of 2 with leases of
// 9s beside a fixed window charged by the response. Admissions take leases and check the window
// without charging it; Finish releases the lease and charges the response's cost, a cost over
// what is left exhausting the window; Renew keeps a lease past its first timeout; a lease nobody
// renews or releases (its enforcer died) frees its slot when it expires. Every store decides
// every step alike, field by field.
func TestStoresWhenRequestsHoldLeasesAndAreChargedByTheirResponsesThenEveryStoreAgrees(t *testing.T) {
	slots := algorithm.Limit{Kind: algorithm.Concurrency, Limit: 2, Period: 9 * time.Second}
	budget := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Hour}
	type step struct {
		advance time.Duration
		op      string // decide, finish, renew
		lease   string
		cost    int64 // the response's, for finish
		want    bool  // decide: charged
	}
	steps := []step{
		{0, "decide", "a", 0, true},
		{time.Second, "decide", "b", 0, true},
		{0, "decide", "c", 0, false}, // both slots are held
		{time.Second, "finish", "a", 4, true},
		{0, "decide", "c", 0, true},          // a's slot is free; 6 of the window left
		{time.Second, "renew", "b", 0, true}, // b runs to +12s
		{time.Second, "finish", "c", 99, true},
		{0, "decide", "d", 0, false}, // the window is exhausted: 0 left, the request costs 1
		{5 * time.Second, "decide", "e", 0, false},
		{6 * time.Second, "decide", "e", 0, false}, // b's lease expired at +12s, but the window is still spent
	}
	start := time.Unix(1_700_000_000, 0)
	var want [][]algorithm.Decision
	for _, tg := range targets() {
		t.Run(tg.name, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(start)
			s := tg.make(t, clock.Now)
			tag := uniqueTag(t, tg.name)
			var got [][]algorithm.Decision
			for i, st := range steps {
				clock.Step(st.advance)
				checks := []store.Check{
					{Limit: slots, Cost: 1, Enforce: true, Tag: tag, Rule: "slots", Lease: st.lease},
					{Limit: budget, Cost: 1, Enforce: true, Tag: tag, Rule: "budget", Lease: st.lease, Deferred: true},
				}
				out := make([]algorithm.Decision, len(checks))
				var err error
				switch st.op {
				case "decide":
					var charged bool
					charged, err = s.Decide(context.Background(), checks, out)
					if err == nil && charged != st.want {
						t.Fatalf("step %d: %s charged %v, want %v: %+v", i, st.lease, charged, st.want, out)
					}
				case "finish":
					checks[1].Cost = st.cost
					err = s.Finish(context.Background(), checks, out)
				case "renew":
					err = s.Renew(context.Background(), checks[:1], out)
				}
				if err != nil {
					t.Fatalf("step %d: %v", i, err)
				}
				got = append(got, out)
			}
			// The last decision: no slot is held (e was refused, b expired), the window spent.
			last := got[len(got)-1]
			if last[0].Remaining != 2 || last[1].Remaining != 0 || last[1].Allowed {
				t.Errorf("at the end: %+v, want both slots free and the window refusing", last)
			}
			if want == nil {
				want = got
				return
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("%s decides differently from memory (-memory +%s):\n%s", tg.name, tg.name, diff)
			}
		})
	}
}

// 200 requests against a concurrency limit of 10, from three stores sharing one Redis (three
// enforcers) or from one memory store: exactly 10 hold a slot at once while all hold on, never
// more than 10 hold one while they come and go, and once every request is finished every slot is
// free again.
func TestStoresWhenTwoHundredRequestsRaceForTenSlotsThenNeverMoreThanTenHoldOne(t *testing.T) {
	const limit, requests = 10, 200
	l := algorithm.Limit{Kind: algorithm.Concurrency, Limit: limit, Period: time.Hour}
	sets := map[string]func(t *testing.T) []store.Store{
		"memory": func(t *testing.T) []store.Store {
			t.Helper()
			return []store.Store{targetsAll()[0].make(t, nil)}
		},
	}
	if !tier.Fast() {
		sets["three-on-one-redis"] = func(t *testing.T) []store.Store {
			t.Helper()
			var ss []store.Store
			for range 3 {
				ss = append(ss, newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil))
			}
			return ss
		}
		sets["cluster"] = func(t *testing.T) []store.Store {
			t.Helper()
			return []store.Store{newRedis(t, store.RedisOptions{Mode: v1alpha1.RedisCluster, Addrs: cluster.Addrs()}, nil)}
		}
	}
	for name, newStores := range sets {
		t.Run(name, func(t *testing.T) {
			stores := newStores(t)
			tag := uniqueTag(t)
			check := func(i int) []store.Check {
				return []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: tag, Rule: "r", Lease: fmt.Sprintf("req-%d", i)}}
			}
			ctx := context.Background()
			// All hold on: exactly the limit is admitted.
			var admitted []int
			var mu sync.Mutex
			var wg sync.WaitGroup
			for i := range requests {
				wg.Go(func() {
					out := make([]algorithm.Decision, 1)
					ok, err := stores[i%len(stores)].Decide(ctx, check(i), out)
					if err != nil {
						t.Error(err)
					}
					if ok {
						mu.Lock()
						admitted = append(admitted, i)
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			if len(admitted) != limit {
				t.Fatalf("%d of %d admitted while all hold on, want exactly %d", len(admitted), requests, limit)
			}
			for _, i := range admitted {
				if err := stores[i%len(stores)].Finish(ctx, check(i), make1()); err != nil {
					t.Fatal(err)
				}
			}
			// They come and go: each admitted request counts itself in, then out before it
			// finishes; the count never passes the limit, and every request is served in time.
			var inFlight, most, served atomic.Int64
			for i := range requests {
				wg.Go(func() {
					s, c := stores[i%len(stores)], check(requests+i)
					for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
						ok, err := s.Decide(ctx, c, make1())
						if err != nil {
							t.Error(err)
							return
						}
						if !ok {
							continue
						}
						n := inFlight.Add(1)
						for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
						}
						inFlight.Add(-1)
						if err := s.Finish(ctx, c, make1()); err != nil {
							t.Error(err)
						}
						served.Add(1)
						return
					}
				})
			}
			wg.Wait()
			if most.Load() > limit || served.Load() != requests {
				t.Errorf("at most %d in flight (limit %d), %d of %d served", most.Load(), limit, served.Load(), requests)
			}
			out := make1()
			if _, err := stores[0].Decide(ctx, []store.Check{{Limit: l, Enforce: true, Tag: tag, Rule: "r"}}, out); err != nil || out[0].Remaining != limit {
				t.Errorf("after every request finished: %+v, %v; want all %d slots free", out[0], err, limit)
			}
		})
	}
}

func make1() []algorithm.Decision { return make([]algorithm.Decision, 1) }

// Finish charges every rule of a request in one call, each never refusing: a cost within what a
// rule has left as it is, a larger one to exhaustion; rules of two client keys (two scripts on a
// Cluster) alike. A rule charged by the response is never charged by Decide, even when the
// request is admitted.
func TestStoresWhenResponsesAreChargedThenOneFinishChargesEveryRuleAndNeverRefuses(t *testing.T) {
	for _, tg := range targets() {
		t.Run(tg.name, func(t *testing.T) {
			s := tg.make(t, nil)
			ctx := context.Background()
			user, tenant := uniqueTag(t, "user"), uniqueTag(t, "tenant")
			tokens := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 1000, Rate: 1000, Period: 24 * time.Hour}
			logins := algorithm.Limit{Kind: algorithm.SlidingLog, Limit: 5, Period: time.Hour}
			checks := []store.Check{
				{Limit: tokens, Cost: 1, Enforce: true, Tag: user, Rule: "tokens", Deferred: true},
				{Limit: logins, Cost: 1, Enforce: true, Tag: tenant, Rule: "logins", Deferred: true},
			}
			out := make([]algorithm.Decision, 2)
			for i, want := range []struct{ tokens, logins int64 }{{700, 4}, {400, 3}, {100, 2}, {0, 1}} {
				checks[0].Lease, checks[1].Lease = fmt.Sprintf("r%d", i), fmt.Sprintf("r%d", i)
				checks[0].Cost, checks[1].Cost = 1, 1
				if ok, err := s.Decide(ctx, checks, out); err != nil || !ok {
					t.Fatalf("request %d: %v %v %+v", i, ok, err, out)
				}
				if out[0].Remaining != 1000-300*int64(i) {
					t.Fatalf("request %d: the decision charged the tokens rule: %+v", i, out[0])
				}
				checks[0].Cost = 300
				if err := s.Finish(ctx, checks, out); err != nil {
					t.Fatal(err)
				}
				if !out[0].Allowed || !out[1].Allowed || out[0].Remaining != want.tokens || out[1].Remaining != want.logins {
					t.Fatalf("response %d: %+v, want %d tokens and %d logins left", i, out, want.tokens, want.logins)
				}
			}
			checks[0].Cost, checks[1].Cost = 1, 1
			if ok, err := s.Decide(ctx, checks, out); err != nil || ok || out[0].Allowed || !out[1].Allowed {
				t.Errorf("the fifth request: charged %v, %v, %+v; want refused by the exhausted tokens rule", ok, err, out)
			}
		})
	}
}

// On a Cluster, a concurrency rule's lease taken by the script of one client key is given back
// when the script of another refuses the request: the refund removes the lease.
func TestClusterWhenAnotherClientKeyRefusesThenTheLeaseIsGivenBack(t *testing.T) {
	tier.Needs(t, "redis-server")
	s := newRedis(t, store.RedisOptions{Mode: v1alpha1.RedisCluster, Addrs: cluster.Addrs()}, nil)
	ctx := context.Background()
	user, tenant := uniqueTag(t, "user"), uniqueTag(t, "tenant")
	slots := algorithm.Limit{Kind: algorithm.Concurrency, Limit: 1, Period: time.Hour}
	shut := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1, Period: time.Hour}
	out := make([]algorithm.Decision, 2)
	if _, err := s.Decide(ctx, []store.Check{{Limit: shut, Cost: 1, Enforce: true, Tag: tenant, Rule: "tenant"}}, out); err != nil {
		t.Fatal(err)
	}
	checks := []store.Check{
		{Limit: slots, Cost: 1, Enforce: true, Tag: user, Rule: "slots", Lease: "x"},
		{Limit: shut, Cost: 1, Enforce: true, Tag: tenant, Rule: "tenant", Lease: "x"},
	}
	if ok, err := s.Decide(ctx, checks, out); err != nil || ok {
		t.Fatalf("charged %v, %v: want refused by the tenant's window", ok, err)
	}
	key := checks[0].Key()
	if n, err := cluster.Client(t).ZCard(ctx, key).Result(); err != nil || n > 1 {
		t.Errorf("the slots key holds %d members (%v), want at most the total: the lease was not given back", n, err)
	}
	if _, err := s.Decide(ctx, []store.Check{{Limit: slots, Enforce: true, Tag: user, Rule: "slots"}}, out); err != nil || out[0].Remaining != 1 {
		t.Errorf("%+v, %v: want the one slot free", out[0], err)
	}
}
