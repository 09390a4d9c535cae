package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// FuzzLeasesWhenDrivenByAnyRequestsThenNoMoreThanTheLimitPasses is the differential of leased
// decisions: one to three enforcers (Redis stores on one Redis, standalone or Cluster) lease a
// token bucket or a fixed window of any limit, period, lease size and expiry, beside an unleased
// rule of the same or another client or none, and decide requests of any cost, from any of them,
// on one clock that jumps by up to a lease's expiry or two periods (after the refills in flight). Every request they admit is
// then fed, at its time, to the Go algorithms (the memory store), which must admit it too: the
// enforcers together never pass more than the limit. With one enforcer on a fixed window,
// leasing loses nothing: the Go algorithms fed every request decide each exactly as the lease
// did, field by field.
func FuzzLeasesWhenDrivenByAnyRequestsThenNoMoreThanTheLimitPasses(f *testing.F) {
	for _, seed := range [][]byte{
		{0, 0, 0, 0, 0, 0, 0, 5},
		fuzzSeed(n(0), b(0), b(1), n(10), n(3_600_000), n(5), n(4), n(10_000), b(0),
			b(0), n(0), n(0), n(1), b(0), n(0), n(0), n(1), b(200), n(2_000_000), n(0), n(1)),
		fuzzSeed(n(0), b(1), b(3), n(100), n(60_000), n(30), n(20), n(0), b(1), n(2), n(99), n(3_600_000), b(1),
			b(0), n(0), n(1), n(1), n(1), b(0), n(0), n(2), n(1), n(1), b(250), n(70_000_000), n(1), n(3), n(1)),
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		tier.Needs(t, "redis-server")
		in := &fuzzInput{b: data}
		clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0).Add(time.Duration(in.intn(1<<31)) * time.Microsecond))
		opts := store.RedisOptions{Addrs: []string{standalone.Addr()}, Timeout: 10 * time.Second}
		if fuzzCluster || len(data)%4 == 1 {
			opts = store.RedisOptions{Mode: v1alpha1.RedisCluster, Addrs: cluster.Addrs(), Timeout: 10 * time.Second}
		}
		enforcers := make([]*store.Redis, 1+in.byte()%3)
		var client redis.UniversalClient
		for i := range enforcers {
			rs, err := store.NewRedis(opts)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = rs.Close() }()
			rs.SetClock(clock.Now)
			enforcers[i], client = rs, rs.Client()
		}
		oracle := store.NewMemory(store.MemoryOptions{Now: clock.Now, SweepInterval: -1})
		defer func() { _ = oracle.Close() }()
		single := store.NewMemory(store.MemoryOptions{Now: clock.Now, SweepInterval: -1})
		defer func() { _ = single.Close() }()

		run := fmt.Sprintf("fuzz-lease/%d/%d", runID, fuzzRun.Add(1))
		tags := []string{store.Tag(run, "a"), store.Tag(run, "b")}
		kind := algorithm.TokenBucket
		if in.byte()%2 == 1 {
			kind = algorithm.FixedWindow
		}
		l := algorithm.Limit{Kind: kind, Limit: 2 + in.intn(199)}
		l.Period = time.Second + time.Duration(in.intn(86_400_000))*time.Millisecond
		l.Rate = 1 + in.intn(l.Limit)
		lease := &store.UnitLease{Max: 2 + in.intn(l.Limit-1), Expiry: 10*time.Second + time.Duration(in.intn(50_000))*time.Millisecond}
		checks := []store.Check{{Limit: l, Enforce: true, Tag: tags[0], Rule: "leased", UnitLease: lease}}
		if in.byte()%2 == 1 {
			other := fuzzLimit(in)
			for other.Kind == algorithm.Concurrency || other.Kind == algorithm.LeakyBucket {
				other = fuzzLimit(in)
			}
			checks = append(checks, store.Check{Limit: other, Enforce: true, Tag: tags[in.intn(2)], Rule: "other"})
		}
		exact := len(enforcers) == 1 && kind == algorithm.FixedWindow
		ctx := context.Background()
		ends := map[string]time.Time{}
		for step := 0; step < 64 && !in.done(); step++ {
			if in.byte() < 128 {
				clock.Step(time.Duration(in.intn(int64(lease.Expiry/time.Microsecond)+1)) * time.Microsecond)
			} else {
				clock.Step(time.Duration(in.intn(int64(2*l.Period/time.Microsecond)+1)) * time.Microsecond)
			}
			expire(t, client, ends, clock.Now())
			e := enforcers[in.intn(int64(len(enforcers)))]
			for i := range checks {
				checks[i].Cost = in.intn(checks[i].Limit.Limit + 1)
			}
			got := make([]algorithm.Decision, len(checks))
			charged, err := e.Decide(ctx, checks, got)
			if err != nil {
				t.Fatalf("step %d: %v (checks %+v)", step, err, checks)
			}
			e.WaitRefills() // before the clock moves: a refill is decided at its own time
			if charged {
				ok, err := oracle.Decide(ctx, checks, make([]algorithm.Decision, len(checks)))
				if err != nil {
					t.Fatal(err)
				}
				if !ok {
					t.Fatalf("step %d at %v: the enforcers admitted a request the Go algorithms refuse, given only the admitted ones: over the limit (checks %+v, decisions %+v)",
						step, clock.Now().UnixMicro(), checks, got)
				}
			}
			if exact {
				want := make([]algorithm.Decision, len(checks))
				wantCharged, err := single.Decide(ctx, checks, want)
				if err != nil {
					t.Fatal(err)
				}
				if wantCharged != charged || !cmp.Equal(want, got) {
					t.Fatalf("step %d at %v, checks %+v: charged %v (Go) and %v (leased); decisions (-Go +leased):\n%s",
						step, clock.Now().UnixMicro(), checks, wantCharged, charged, cmp.Diff(want, got))
				}
			}
			// A state written with a TTL of a millisecond or so may end by Redis's clock before
			// the test extends it: compared up to here.
			var keys []string
			var short []bool
			for i := range checks {
				keys, short = append(keys, checks[i].Key()), append(short, charged && got[i].Reset < 2*time.Millisecond)
				if checks[i].UnitLease != nil && checks[i].Limit.Kind == algorithm.TokenBucket {
					keys, short = append(keys, checks[i].LeaseKey()), append(short, false)
				}
			}
			if !keepKeyTTLs(t, client, keys, func(i int) bool { return short[i] }, ends, clock.Now()) {
				return
			}
		}
	})
}
