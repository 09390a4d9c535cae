package store_test

import (
	"context"
	"fmt"
	"math"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// fuzzInput reads a fuzzer's bytes as small numbers; past their end every read is 0.
type fuzzInput struct{ b []byte }

func (in *fuzzInput) byte() byte {
	if len(in.b) == 0 {
		return 0
	}
	c := in.b[0]
	in.b = in.b[1:]
	return c
}

// intn returns a number in [0, n) from up to four bytes.
func (in *fuzzInput) intn(n int64) int64 {
	v := int64(0)
	for range 4 {
		v = v<<8 | int64(in.byte())
	}
	return v % n
}

func (in *fuzzInput) done() bool { return len(in.b) == 0 }

// n and b are a seed's numbers as fuzzInput reads them: n one that intn reads whole (below its
// bound), b one byte.
type (
	n uint32
	b byte
)

// fuzzSeed writes the numbers and bytes of an input.
func fuzzSeed(parts ...any) []byte {
	var out []byte
	for _, p := range parts {
		switch v := p.(type) {
		case n:
			out = append(out, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
		case b:
			out = append(out, byte(v))
		}
	}
	return out
}

// fuzzCost is mostly a cost within the limit, sometimes one past it, and sometimes one that
// only a multiplication by hits_addend makes: up to 2^63-1.
func fuzzCost(in *fuzzInput, limit int64) int64 {
	switch c := in.byte(); {
	case c < 200:
		return in.intn(limit + 1)
	case c < 240:
		return limit + 1 + in.intn(3)
	case c < 250:
		return math.MaxInt64
	default:
		return in.intn(math.MaxInt64)
	}
}

// fuzzLimit is one rule: any algorithm, a limit up to 200, a rate up to the limit, a period of
// one second to a day and a second (a concurrency limit's lease timeout), and a leaky bucket's
// longest wait up to the time its queue takes to drain.
func fuzzLimit(in *fuzzInput) algorithm.Limit {
	l := algorithm.Limit{Kind: algorithm.Kind(1 + in.intn(6)), Limit: 1 + in.intn(200)}
	l.Period = time.Second + time.Duration(in.intn(86_400_000))*time.Millisecond
	l.Rate = 1 + in.intn(l.Limit)
	if l.Kind == algorithm.LeakyBucket {
		drain := time.Duration(float64(l.Period) * float64(l.Limit) / float64(l.Rate))
		l.MaxWait = time.Duration(in.intn(int64(drain/time.Millisecond)+1)) * time.Millisecond
	}
	return l
}

var fuzzRun atomic.Int64

// fuzzCluster, set by FUZZ_CLUSTER=1, runs every input of the differential on the 3-master
// Cluster, where rules of two clients are decided by two scripts and a refusal refunds the other;
// without it, a quarter of the inputs (by their length) are.
var fuzzCluster = os.Getenv("FUZZ_CLUSTER") == "1"

// FuzzStoresWhenDrivenByTheSameRequestsThenGoAndLuaDecideIdentically is the differential: the
// memory store (the Go algorithms) and the Lua script on a real Redis, fed the same rules (one to
// four, of any algorithm, concurrency included, enforced or shadow, charged by the request or by
// the response, of one or two clients, a rule named twice, and idempotency records of two
// policies), the same request sequences with costs up to 2^63-1, each request named (its lease),
// and among the decisions the ends of admitted requests (Finish: leases released, responses
// charged at any cost) and renewals of their leases (Renew), and the same clock (the test passes
// the time to both, so the comparison is exact), reach the same decisions field by field, on a
// standalone Redis (by FCALL of the script's library, and by EVALSHA on a Redis without
// functions) and on a Cluster; after every call, every key and record the call names exists with
// a TTL or not at all.
//
// Redis expires keys by its own clock while the test's clock jumps by hours, so after checking
// each key's TTL the test extends it far and ends it itself once the test's clock passes the
// TTL, as Redis does by the clock its TIME reads in production. (A key kept past its TTL is
// not always idle: a sliding window counter's packed value holds its window index modulo 4.)
func FuzzStoresWhenDrivenByTheSameRequestsThenGoAndLuaDecideIdentically(f *testing.F) {
	for _, seed := range [][]byte{
		{0, 0, 0, 0, 0, 0, 0, 5},
		[]byte("\x03\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x01\x00\x01\x01\x00\x00\x00\x03\x00\x00\x00\x10\xff\x00\x00\x00\x02"),
		[]byte("\x02\x01\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x10\x00\x00\x00\x00\x02\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x01\x00\xc8\x00\xf0\x00\xfa\xff\xfb\x01\x02\x03\x04\x05\x06\x07\x08"),
		// A concurrency limit of 2 (leases of 11s) beside a fixed window of 10 charged by the
		// response: three requests, the end of the first (its response charged 5), a renewal of
		// the second, a fourth request, the end of the second.
		fuzzSeed(n(0), n(1), n(5), n(1), n(10_000), n(0), b(1), n(0), n(2), n(9), n(0), n(0), b(1), n(0), b(1), b(1), b(0),
			n(0), b(0), b(0), n(1), b(0), n(1),
			n(0), b(0), b(0), n(1), b(0), n(1),
			n(0), b(0), b(0), n(1), b(0), n(1),
			n(1_000_000), b(250), b(0), n(5),
			n(2_000_000), b(200),
			n(0), b(0), b(0), n(1), b(0), n(1),
			n(3_000_000), b(250), b(0), n(20)),
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		tier.Needs(t, "redis-server")
		in := &fuzzInput{b: data}
		clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0).Add(time.Duration(in.intn(1<<31)) * time.Microsecond))
		// A third of the inputs run on a memory store whose keys all share one hash.
		newMemory := store.NewMemory
		if len(data)%3 == 2 {
			newMemory = store.NewCollidingMemory
		}
		mem := newMemory(store.MemoryOptions{Now: clock.Now, SweepInterval: -1})
		defer func() { _ = mem.Close() }()
		// The script runs by FCALL of its library, but on a fifth of the standalone inputs, which
		// run on a Redis without functions, by EVALSHA.
		opts := store.RedisOptions{Addrs: []string{standalone.Addr()}, Timeout: 10 * time.Second}
		onCluster := fuzzCluster || len(data)%4 == 1
		byEval := !onCluster && len(data)%5 == 3
		switch {
		case onCluster:
			opts = store.RedisOptions{Mode: v1alpha1.RedisCluster, Addrs: cluster.Addrs(), Timeout: 10 * time.Second}
		case byEval:
			opts.Addrs = []string{noFunctions.Addr()}
		}
		rs, err := store.NewRedis(opts)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = rs.Close() }()
		if !byEval {
			poll.WaitFor(t, 10*time.Second, poll.True("the library loaded", rs.Functions))
		}
		rs.SetClock(clock.Now)

		run := fmt.Sprintf("fuzz/%d/%d", runID, fuzzRun.Add(1))
		tags := []string{store.Tag(run, "a"), store.Tag(run, "b")}
		checks := make([]store.Check, 1+in.intn(4))
		for i := range checks {
			checks[i] = store.Check{Limit: fuzzLimit(in), Enforce: in.byte()%4 != 0, Tag: tags[in.intn(2)], Rule: fmt.Sprintf("r%d", i)}
			// A quarter of the rate rules are charged by the response.
			checks[i].Deferred = checks[i].Limit.Kind != algorithm.Concurrency && in.byte()%4 == 1
			if i > 0 && in.byte()%16 == 0 {
				checks[i].Rule, checks[i].Tag, checks[i].Limit, checks[i].Deferred = checks[0].Rule, checks[0].Tag, checks[0].Limit, checks[0].Deferred // named twice
			}
		}
		// A quarter of the inputs name idempotency records: two keys of two policies' settings,
		// each check with one of them or none. Redis keeps a record by its own clock, so these
		// sequences are decided at one instant, and a refused repeat's Retry-After (the record's
		// PTTL on Redis) may differ by the millisecond that Redis's clock moved.
		idem := in.byte()%4 == 3
		if idem {
			records := []*store.Idempotency{
				{Key: store.IdempotencyKey("k1", "x"), Window: time.Duration(1+in.intn(3600)) * time.Second, MaxRepeats: in.intn(4)},
				{Key: store.IdempotencyKey("k2", "x"), Window: time.Duration(1+in.intn(3600)) * time.Second, MaxRepeats: in.intn(4)},
			}
			for i := range checks {
				if r := in.byte() % 3; r < 2 {
					checks[i].Idempotency = records[r]
				}
			}
		}
		// A refused repeat's Retry-After on Redis is its record's PTTL, which Redis's clock has
		// moved since the record was written: at most the wall time since this input began.
		began := time.Now()
		equal := cmp.Comparer(func(a, b algorithm.Decision) bool {
			if idem && a.RetryAfter != b.RetryAfter && (a.RetryAfter-b.RetryAfter).Abs() <= time.Since(began)+time.Millisecond {
				b.RetryAfter = a.RetryAfter
			}
			return a == b
		})
		ctx := context.Background()
		ends := map[string]time.Time{}       // each key's TTL by the test's clock
		recordEnds := map[string]time.Time{} // each record's TTL by the wall clock, Redis's
		var admitted [][]store.Check         // the requests charged and not yet finished
		for step := 0; step < 64 && !in.done(); step++ {
			if k := ending(recordEnds); k != "" {
				t.Logf("record %s ends by Redis's clock, which the test does not drive: compared up to here", k)
				return
			}
			maxPeriod := time.Duration(0)
			for i := range checks {
				maxPeriod = max(maxPeriod, checks[i].Limit.Period)
			}
			if !idem {
				clock.Step(time.Duration(in.intn(int64(2*maxPeriod/time.Microsecond)+1)) * time.Microsecond)
			}
			expire(t, rs.Client(), ends, clock.Now())
			if op := in.byte(); op >= 192 && len(admitted) > 0 {
				// The end of an admitted request, or a renewal of its leases: its own checks, and
				// any cost for the responses' charges.
				req := admitted[0]
				if op >= 240 {
					admitted = admitted[1:]
					for i := range req {
						if req[i].Limit.Kind != algorithm.Concurrency {
							req[i].Cost = fuzzCost(in, req[i].Limit.Limit)
						}
					}
				}
				want, got := make([]algorithm.Decision, len(req)), make([]algorithm.Decision, len(req))
				call := store.Store.Renew
				if op >= 240 {
					call = store.Store.Finish
				}
				if err := call(mem, ctx, req, want); err != nil {
					t.Fatalf("step %d: memory: %v", step, err)
				}
				if err := call(rs, ctx, req, got); err != nil {
					t.Fatalf("step %d: redis: %v (checks %+v)", step, err, req)
				}
				if !cmp.Equal(want, got, equal) {
					t.Fatalf("step %d at %v, %s of %+v: (-memory +redis):\n%s", step, clock.Now().UnixMicro(),
						map[bool]string{true: "finish", false: "renewal"}[op >= 240], req, cmp.Diff(want, got))
				}
				// A post-response charge writes its key; a release or a renewal changes one that exists.
				wrote := func(i int) bool {
					return op >= 240 && req[i].Limit.Kind != algorithm.Concurrency && want[i].Allowed && want[i].Reset < 2*time.Millisecond
				}
				if !keepKeys(t, rs.Client(), req, wrote, ends, clock.Now()) {
					return
				}
				continue
			}
			for i := range checks {
				checks[i].Cost = fuzzCost(in, checks[i].Limit.Limit)
				checks[i].Lease = fmt.Sprintf("%s/%d", run, step)
			}
			want, got := make([]algorithm.Decision, len(checks)), make([]algorithm.Decision, len(checks))
			wantCharged, err := mem.Decide(ctx, checks, want)
			if err != nil {
				t.Fatalf("step %d: memory: %v", step, err)
			}
			decided := time.Now()
			gotCharged, err := rs.Decide(ctx, checks, got)
			if err != nil {
				t.Fatalf("step %d: redis: %v (checks %+v)", step, err, checks)
			}
			if onCluster && !gotCharged {
				// On a Cluster, the scripts of other tags may have charged before the refusal and
				// been refunded after it: their rules report the charged state (docs/guarantees.md).
				// The state itself must be back, which the next steps compare.
				for i := range got {
					if got[i].Allowed && want[i].Allowed {
						got[i].Remaining, got[i].Reset, got[i].Wait = want[i].Remaining, want[i].Reset, want[i].Wait
					}
				}
			}
			if wantCharged != gotCharged || !cmp.Equal(want, got, equal) {
				t.Fatalf("step %d at %v, checks %+v: charged %v (memory) and %v (redis); decisions (-memory +redis):\n%s",
					step, clock.Now().UnixMicro(), checks, wantCharged, gotCharged, cmp.Diff(want, got))
			}
			if wantCharged {
				admitted = append(admitted, append([]store.Check(nil), checks...))
			}
			for i := range checks {
				if d := want[i]; d.Allowed && d.Never || d.Never != (checks[i].Cost > checks[i].Limit.Limit) || d.Remaining < 0 || d.Remaining > d.Limit {
					t.Fatalf("step %d rule %d cost %d: %+v", step, i, checks[i].Cost, d)
				}
			}
			// Both checks run for every key; an input whose states Redis's own clock has moved
			// apart ends here, compared up to this step.
			wrote := func(i int) bool {
				return wantCharged && want[i].Allowed && checks[i].Cost > 0 && !checks[i].Deferred && want[i].Reset < 2*time.Millisecond
			}
			keys, records := keepKeys(t, rs.Client(), checks, wrote, ends, clock.Now()), keepRecords(t, rs.Client(), checks, want, decided, recordEnds)
			if !keys || !records {
				return
			}
		}
	})
}

// keepKeys fails unless every key of the checks has a TTL or does not exist, then notes in ends
// when the TTL ends by the test's clock, now, and extends it by keyExtension (see the fuzz
// target). It reports false when a key that the call wrote with a TTL of a millisecond or so
// (wrote) ended by Redis's clock before it could be extended: the two stores no longer hold the
// same states.
func keepKeys(t *testing.T, c redis.UniversalClient, checks []store.Check, wrote func(i int) bool, ends map[string]time.Time, now time.Time) (same bool) {
	t.Helper()
	keys := make([]string, len(checks))
	for i := range checks {
		keys[i] = checks[i].Key()
	}
	return keepKeyTTLs(t, c, keys, wrote, ends, now)
}

// keepKeyTTLs is keepKeys for keys by name: wrote(i) is whether the call wrote keys[i].
func keepKeyTTLs(t *testing.T, c redis.UniversalClient, keys []string, wrote func(i int) bool, ends map[string]time.Time, now time.Time) (same bool) {
	t.Helper()
	ctx := context.Background()
	same = true
	for i, k := range keys {
		ttl, err := c.PTTL(ctx, k).Result()
		switch {
		case err != nil:
			t.Fatal(err)
		case ttl == -2*time.Nanosecond && wrote(i):
			// Written with a TTL of a millisecond of Redis's clock, which ended before the test
			// could extend it: the stores now hold different states, through no fault of either.
			t.Logf("key %s expired by Redis's clock before the test extended it: compared up to here", k)
			same = false
			continue
		case ttl == -2*time.Nanosecond:
			continue // no such key
		case ttl < 0: // -1: no TTL; 0 is one that ends within the millisecond
			t.Fatalf("key %s has no TTL: PTTL %v", k, ttl)
		case ttl > keyExtension/2:
			// Not written since the test extended it: the end noted then stands. (Read as a new
			// TTL, it would keep a key for ever, and a sliding window counter's packed window
			// index, modulo 4, misread once four windows had passed.)
			continue
		}
		// A second late, so that Redis's clock, which moved while the test read the TTL, cannot
		// make it end before the state is idle; it ends within a sliding window counter's four
		// windows all the same (windows are a second or longer here).
		ends[k] = now.Add(ttl + time.Second)
		if err := c.PExpire(ctx, k, ttl+keyExtension).Err(); err != nil {
			t.Fatal(err)
		}
	}
	return same
}

// keyExtension is what keepKeys adds to a key's TTL: far beyond any TTL a call writes (two days
// at most here), so that a TTL above half of it is one the test set.
const keyExtension = 1000 * 24 * time.Hour

// expire deletes the keys whose TTL, by the test's clock, ended at or before now.
func expire(t *testing.T, c redis.UniversalClient, ends map[string]time.Time, now time.Time) {
	t.Helper()
	for k, end := range ends {
		if !end.After(now) {
			if err := c.Del(context.Background(), k).Err(); err != nil {
				t.Fatal(err)
			}
			delete(ends, k)
		}
	}
}

// keepRecords fails unless every idempotency record of the checks has a TTL or does not exist,
// and notes in ends when each ends by the wall clock, which is Redis's (the memory store's clock
// stands still in these sequences; see ending). It reports false for an input whose record may
// have ended already: a refusal's record lives for its Retry-After, which may be a millisecond,
// less than the time since the decision, decided.
func keepRecords(t *testing.T, c redis.UniversalClient, checks []store.Check, out []algorithm.Decision, decided time.Time, ends map[string]time.Time) (same bool) {
	t.Helper()
	same = true
	shortRefusal := false
	for i := range out {
		shortRefusal = shortRefusal || !out[i].Allowed && !out[i].Never && out[i].RetryAfter <= time.Since(decided)+10*time.Millisecond
	}
	for i := range checks {
		if checks[i].Idempotency == nil {
			continue
		}
		k := store.KeyPrefix + "{" + checks[i].Tag + "}i" + checks[i].Idempotency.Key
		read := time.Now()
		ttl, err := c.PTTL(context.Background(), k).Result()
		switch {
		case err != nil:
			t.Fatal(err)
		case ttl == -2*time.Nanosecond && shortRefusal:
			t.Logf("record %s may have ended by Redis's clock already: compared up to here", k)
			same = false
		case ttl == -2*time.Nanosecond:
		case ttl < 0:
			t.Fatalf("record %s of rule %d has no TTL: PTTL %v", k, i, ttl)
		default:
			ends[k] = read.Add(ttl)
		}
	}
	return same
}

// ending names a record that ends by the wall clock within the next 100ms, or none: the memory
// store would still hold it when Redis no longer does.
func ending(ends map[string]time.Time) string {
	for k, end := range ends {
		if time.Until(end) < 100*time.Millisecond {
			return k
		}
	}
	return ""
}
