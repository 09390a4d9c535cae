package store_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

var (
	standalone *redistest.Server
	// noFunctions answers FCALL and FUNCTION as a Redis 6 does: unknown commands.
	noFunctions *redistest.Server
	cluster     *redistest.Cluster
)

func TestMain(m *testing.M) {
	flag.Parse()
	tier.RunFast(m)
	var err error
	if standalone, err = redistest.StartServer(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if noFunctions, err = redistest.StartServer("--rename-command", "FCALL", "", "--rename-command", "FUNCTION", ""); err != nil {
		standalone.Stop()
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if cluster, err = redistest.StartCluster(3); err != nil {
		standalone.Stop()
		noFunctions.Stop()
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	// Every key the suites wrote must carry a TTL.
	if err := keysWithoutTTL(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	standalone.Stop()
	noFunctions.Stop()
	cluster.Stop()
	os.Exit(code)
}

func keysWithoutTTL() error {
	ctx := context.Background()
	servers := append([]*redistest.Server{standalone, noFunctions}, cluster.Nodes...)
	scanned := 0
	for _, s := range servers {
		c := redis.NewClient(&redis.Options{Addr: s.Addr()})
		iter := c.Scan(ctx, 0, "*", 1000).Iterator()
		for iter.Next(ctx) {
			scanned++
			if ttl := c.PTTL(ctx, iter.Val()).Val(); ttl < 0 && ttl != -2*time.Nanosecond {
				_ = c.Close()
				return fmt.Errorf("key %q on %s has no TTL (PTTL %v)", iter.Val(), s.Addr(), ttl)
			}
		}
		_ = c.Close()
	}
	fmt.Printf("TTL check: %d keys scanned, all with a TTL\n", scanned)
	return nil
}

// target makes a store of one kind. A nil clock means production time: the memory store reads
// the system clock and the Redis store reads Redis TIME.
type target struct {
	name  string
	redis bool
	make  func(t *testing.T, clock func() time.Time) store.Store
}

func newRedis(t *testing.T, opts store.RedisOptions, clock func() time.Time) store.Store {
	t.Helper()
	if opts.Timeout == 0 {
		opts.Timeout = 5 * time.Second // generous: the race detector slows everything down
	}
	s, err := store.NewRedis(opts)
	if err != nil {
		t.Fatal(err)
	}
	if clock != nil {
		s.SetClock(clock)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// targets are the stores every algorithm runs on: memory, memory whose keys all share one hash,
// and, but in the fast tier, standalone Redis (by FCALL, and by EVALSHA on a Redis without
// functions) and Cluster Redis.
func targets() []target {
	if tier.Fast() {
		return targetsAll()[:2]
	}
	return targetsAll()
}

func targetsAll() []target {
	return []target{
		{name: "memory", make: func(t *testing.T, clock func() time.Time) store.Store {
			t.Helper()
			s := store.NewMemory(store.MemoryOptions{Now: clock, SweepInterval: -1})
			t.Cleanup(func() { _ = s.Close() })
			return s
		}},
		{name: "memory-colliding", make: func(t *testing.T, clock func() time.Time) store.Store {
			t.Helper()
			s := store.NewCollidingMemory(store.MemoryOptions{Now: clock, SweepInterval: -1})
			t.Cleanup(func() { _ = s.Close() })
			return s
		}},
		{name: "standalone", redis: true, make: func(t *testing.T, clock func() time.Time) store.Store {
			t.Helper()
			return byFunction(t, newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, clock))
		}},
		{name: "standalone-eval", redis: true, make: func(t *testing.T, clock func() time.Time) store.Store {
			t.Helper()
			return newRedis(t, store.RedisOptions{Addrs: []string{noFunctions.Addr()}}, clock)
		}},
		{name: "cluster", redis: true, make: func(t *testing.T, clock func() time.Time) store.Store {
			t.Helper()
			return byFunction(t, newRedis(t, store.RedisOptions{Mode: v1alpha1.RedisCluster, Addrs: cluster.Addrs()}, clock))
		}},
	}
}

// byFunction waits until s calls the decide script's library by FCALL.
func byFunction(t *testing.T, s store.Store) store.Store {
	t.Helper()
	poll.WaitFor(t, 10*time.Second, poll.True("the library loaded", s.(*store.Redis).Functions))
	return s
}

func allKinds(limit int64, period time.Duration) []algorithm.Limit {
	return []algorithm.Limit{
		{Kind: algorithm.TokenBucket, Limit: limit, Rate: limit, Period: period},
		{Kind: algorithm.LeakyBucket, Limit: limit, Rate: limit, Period: period, MaxWait: period},
		{Kind: algorithm.FixedWindow, Limit: limit, Period: period},
		{Kind: algorithm.SlidingLog, Limit: limit, Period: period},
		{Kind: algorithm.SlidingWindowCounter, Limit: limit, Period: period},
		{Kind: algorithm.Concurrency, Limit: limit, Period: period},
	}
}

var runID = time.Now().UnixNano()

// uniqueTag keeps the keys of every test and run apart.
func uniqueTag(t *testing.T, parts ...any) string {
	t.Helper()
	return store.Tag(fmt.Sprintf("test/%s/%d", t.Name(), runID), fmt.Sprint(parts...))
}

type outcome struct {
	Charged   bool
	Decisions []algorithm.Decision
}

// play drives a store through a script of requests on a fake clock and records every outcome.
func play(t *testing.T, s store.Store, clock *clocktesting.FakeClock, checks []store.Check, steps []playStep) []outcome {
	t.Helper()
	var outs []outcome
	for i, st := range steps {
		clock.Step(st.advance)
		cs := append([]store.Check(nil), checks...)
		for j := range cs {
			cs[j].Cost = st.costs[j]
		}
		out := make([]algorithm.Decision, len(cs))
		ok, err := s.Decide(context.Background(), cs, out)
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		outs = append(outs, outcome{ok, out})
	}
	return outs
}

type playStep struct {
	advance time.Duration
	costs   []int64
}

func randomSteps(rng *rand.Rand, n, rules int) []playStep {
	steps := make([]playStep, n)
	for i := range steps {
		steps[i].advance = time.Duration(rng.IntN(300_000)) * time.Microsecond
		for range rules {
			steps[i].costs = append(steps[i].costs, int64(rng.IntN(4)))
		}
	}
	return steps
}

// The Lua script and the Go algorithms are one algorithm: driven by the same requests at the same
// times, every store reaches the same decisions, field by field.
func TestStoresWhenDrivenByTheSameScriptThenDecideIdentically(t *testing.T) {
	start := time.Unix(1_700_000_000, 123_456_000)
	rulesets := map[string][]store.Check{}
	for _, l := range allKinds(7, 2*time.Second) {
		rulesets[l.Kind.String()] = []store.Check{{Limit: l, Enforce: true, Rule: "r"}}
	}
	// Every algorithm on one key at once, one of them in shadow mode.
	var mixed []store.Check
	for i, l := range allKinds(9, 3*time.Second) {
		mixed = append(mixed, store.Check{Limit: l, Enforce: i != 2, Rule: fmt.Sprintf("r%d", i)})
	}
	rulesets["all-five-one-shadow"] = mixed

	for name, checks := range rulesets {
		t.Run(name, func(t *testing.T) {
			steps := randomSteps(rand.New(rand.NewPCG(7, uint64(len(name)))), 400, len(checks))
			var want []outcome
			for _, tg := range targets() {
				clock := clocktesting.NewFakeClock(start)
				cs := append([]store.Check(nil), checks...)
				for i := range cs {
					cs[i].Tag = uniqueTag(t, tg.name)
				}
				got := play(t, tg.make(t, clock.Now), clock, cs, steps)
				if want == nil {
					want = got
					refused := 0
					for _, o := range got {
						if !o.Charged {
							refused++
						}
					}
					if refused < 40 {
						t.Fatalf("only %d of %d requests refused: the script does not exercise the limits", refused, len(got))
					}
					continue
				}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("%s decides differently from memory (-memory +%s):\n%s", tg.name, tg.name, diff)
				}
			}
		})
	}
}

// Counts above what the compact state encodings hold (a sliding window counter packs counts below
// 2^25 into one integer, and falls back to text above) decide as the Go algorithms do, across
// the switch between the two, on every store.
func TestStoresWhenCountsAreLargeThenTheWideEncodingsDecideIdentically(t *testing.T) {
	start := time.Unix(1_700_000_000, 123_456_000)
	steps := randomSteps(rand.New(rand.NewPCG(11, 3)), 300, 1)
	for i := range steps {
		steps[i].costs[0] *= 12_000_000 // up to 36,000,000 a request, against 2^25 = 33,554,432
	}
	for _, l := range allKinds(100_000_000, 2*time.Second) {
		if l.Kind == algorithm.SlidingLog {
			continue // a member per unit: counts this large are not its use
		}
		t.Run(l.Kind.String(), func(t *testing.T) {
			var want []outcome
			for _, tg := range targets() {
				clock := clocktesting.NewFakeClock(start)
				cs := []store.Check{{Limit: l, Enforce: true, Rule: "r", Tag: uniqueTag(t, tg.name)}}
				got := play(t, tg.make(t, clock.Now), clock, cs, steps)
				if want == nil {
					want = got
					continue
				}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("%s decides differently from memory (-memory +%s):\n%s", tg.name, tg.name, diff)
				}
			}
		})
	}
}

// 1,000 requests from 50 goroutines against a limit of 100 with negligible refill admit exactly
// 100, on every store, for every algorithm, 20 times over.
func TestStoresWhenFiftyGoroutinesRaceThenExactlyTheLimitPasses(t *testing.T) {
	tier.Needs(t, "redis-server")
	const (
		limit      = 100
		requests   = 1000
		goroutines = 50
		repeats    = 20
	)
	kinds := allKinds(limit, 720*time.Hour)
	for _, tg := range targets() {
		for _, l := range kinds {
			t.Run(tg.name+"/"+l.Kind.String(), func(t *testing.T) {
				s := tg.make(t, nil)
				for rep := range repeats {
					if got := race(t, []store.Store{s}, l, uniqueTag(t, rep), requests, goroutines); got != limit {
						t.Fatalf("run %d: %d of %d passed, want exactly %d", rep, got, requests, limit)
					}
				}
			})
		}
	}
	// Three enforcers, each with its own store and connections, sharing one Redis.
	for _, l := range kinds {
		t.Run("three-enforcers/"+l.Kind.String(), func(t *testing.T) {
			var stores []store.Store
			for range 3 {
				stores = append(stores, newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil))
			}
			for rep := range repeats {
				if got := race(t, stores, l, uniqueTag(t, rep), requests, goroutines); got != limit {
					t.Fatalf("run %d: %d of %d passed, want exactly %d", rep, got, requests, limit)
				}
			}
		})
	}
}

func race(t *testing.T, stores []store.Store, l algorithm.Limit, tag string, requests, goroutines int) int {
	t.Helper()
	return flood(t, stores, []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: tag, Rule: "r"}}, requests, goroutines)
}

// A burst rule and a sustained rule on one key: a request the burst rule refuses does not consume
// the sustained allowance, and over a minute exactly the sustained limit passes.
func TestStoresWhenBurstRefusesThenSustainedIsNotChargedAndAMinuteAdmitsExactly15(t *testing.T) {
	for _, tg := range targets() {
		t.Run(tg.name, func(t *testing.T) {
			clock := clocktesting.NewFakeClock(time.Unix(1_700_000_040, 0)) // a minute boundary
			s := tg.make(t, clock.Now)
			tag := uniqueTag(t)
			checks := []store.Check{
				{Limit: algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 10, Rate: 10, Period: time.Second}, Cost: 1, Enforce: true, Tag: tag, Rule: "burst"},
				{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 15, Period: time.Minute}, Cost: 1, Enforce: true, Tag: tag, Rule: "sustained"},
			}
			out := make([]algorithm.Decision, 2)
			passed := 0
			for i := range 20 {
				ok, err := s.Decide(context.Background(), checks, out)
				if err != nil {
					t.Fatal(err)
				}
				if ok {
					passed++
				}
				if i == 19 && (out[0].Allowed || out[1].Remaining != 5) {
					t.Errorf("after 20 at once: burst allowed %v, sustained remaining %d; want refused and 5 (10 charged, not 20)", out[0].Allowed, out[1].Remaining)
				}
			}
			// 20 requests a second for the rest of the minute.
			for range 59 * 20 {
				clock.Step(50 * time.Millisecond)
				ok, err := s.Decide(context.Background(), checks, out)
				if err != nil {
					t.Fatal(err)
				}
				if ok {
					passed++
				}
			}
			if passed != 15 {
				t.Errorf("%d passed in a minute, want exactly 15", passed)
			}
		})
	}
}

// On a Cluster, rules with different client keys live in different slots and are decided by
// separate scripts; when one refuses, what the others charged is given back.
func TestClusterWhenRulesOfDifferentClientKeysAndOneRefusesThenOthersAreRefunded(t *testing.T) {
	tier.Needs(t, "redis-server")
	s := newRedis(t, store.RedisOptions{Mode: v1alpha1.RedisCluster, Addrs: cluster.Addrs()}, nil)
	ctx := context.Background()
	for _, l := range allKinds(100, time.Hour) {
		t.Run(l.Kind.String(), func(t *testing.T) {
			perUser, perTenant := uniqueTag(t, "user"), uniqueTag(t, "tenant")
			if cluster.Client(t).ClusterKeySlot(ctx, "{"+perUser+"}").Val() == cluster.Client(t).ClusterKeySlot(ctx, "{"+perTenant+"}").Val() {
				t.Fatal("the two tags share a slot; pick others")
			}
			checks := []store.Check{
				{Limit: l, Cost: 1, Enforce: true, Tag: perUser, Rule: "user"},
				{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1, Period: time.Hour}, Cost: 1, Enforce: true, Tag: perTenant, Rule: "tenant"},
			}
			out := make([]algorithm.Decision, 2)
			for i := range 5 {
				ok, err := s.Decide(ctx, checks, out)
				if err != nil {
					t.Fatal(err)
				}
				if ok != (i == 0) {
					t.Fatalf("request %d: charged %v", i, ok)
				}
			}
			check := []store.Check{checks[0]}
			check[0].Cost = 0
			if _, err := s.Decide(ctx, check, out); err != nil {
				t.Fatal(err)
			}
			if out[0].Remaining != 99 {
				t.Errorf("user rule remaining %d after 1 pass and 4 refusals, want 99: refusals were not refunded", out[0].Remaining)
			}
		})
	}
}

// A decision that times out is not retried: the script may still run, and a replay would charge
// twice. Redis is frozen with SIGSTOP so the script runs only after the client gave up.
func TestRedisWhenDecisionTimesOutThenItIsNotReplayed(t *testing.T) {
	tier.Needs(t, "redis-server")
	srv := redistest.NewServer(t)
	s := newRedis(t, store.RedisOptions{Addrs: []string{srv.Addr()}, Timeout: 100 * time.Millisecond}, nil)
	ctx := context.Background()
	checks := []store.Check{{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1000, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}}
	out := make([]algorithm.Decision, 1)
	if _, err := s.Decide(ctx, checks, out); err != nil { // loads the script
		t.Fatal(err)
	}
	admin := srv.Client(t)
	ran := redistest.ScriptCalls(t, admin)
	srv.Pause()
	_, err := s.Decide(ctx, checks, out)
	srv.Resume()
	if err == nil {
		t.Fatal("decision against a frozen Redis succeeded")
	}
	// The frozen script runs now: wait until Redis counts it.
	poll.WaitFor(t, 10*time.Second, func() error {
		if n := redistest.ScriptCalls(t, admin); n <= ran {
			return fmt.Errorf("%d scripts run since the pause", n-ran)
		}
		return nil
	})
	checks[0].Cost = 0
	if _, err := s.Decide(ctx, checks, out); err != nil {
		t.Fatal(err)
	}
	if out[0].Remaining != 998 {
		t.Errorf("remaining = %d after one decision and one timed-out decision, want 998: charged twice, no replay", out[0].Remaining)
	}
}

// Where nothing listens, a decision fails with the refused connection, which names the cause
// (in the breaker's log line and the Degraded condition), within the store's timeout. go-redis
// dials five times, 100 ms apart, by default: a timeout under half a second ran out first, and
// every decision failed with the deadline instead, as a Redis that answers too slowly does.
func TestRedisWhenNothingListensThenADecisionFailsWithTheRefusedConnection(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	s := newRedis(t, store.RedisOptions{Addrs: []string{addr}, Timeout: 200 * time.Millisecond}, nil)
	checks := []store.Check{{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}}
	for i := range 3 {
		if _, err := s.Decide(context.Background(), checks, make([]algorithm.Decision, 1)); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("decision %d against %s, where nothing listens: %v; want the refused connection", i, addr, err)
		}
	}
}

// EVALSHA falls back to EVAL when Redis has forgotten the script.
func TestRedisWhenScriptCacheIsFlushedThenDecisionsStillWork(t *testing.T) {
	tier.Needs(t, "redis-server")
	for _, tg := range targets() {
		if !tg.redis {
			continue
		}
		t.Run(tg.name, func(t *testing.T) {
			s := tg.make(t, nil)
			checks := []store.Check{{Limit: algorithm.Limit{Kind: algorithm.SlidingLog, Limit: 5, Period: time.Minute}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}}
			out := make([]algorithm.Decision, 1)
			for i := range 3 {
				for _, n := range append([]*redistest.Server{standalone, noFunctions}, cluster.Nodes...) {
					if err := n.Client(t).ScriptFlush(context.Background()).Err(); err != nil {
						t.Fatal(err)
					}
				}
				if ok, err := s.Decide(context.Background(), checks, out); err != nil || !ok || out[0].Remaining != int64(4-i) {
					t.Fatalf("decision %d after SCRIPT FLUSH: %v %v %+v", i, ok, err, out[0])
				}
			}
		})
	}
}

// Scripts read Redis TIME in production: the store's clock does not matter.
func TestRedisWhenNoClockIsSetThenDecisionsUseRedisTime(t *testing.T) {
	tier.Needs(t, "redis-server")
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil)
	checks := []store.Check{{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 5, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}}
	out := make([]algorithm.Decision, 1)
	if _, err := s.Decide(context.Background(), checks, out); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	end := now.Truncate(time.Hour).Add(time.Hour)
	if d := out[0].Reset - end.Sub(now); d < -time.Second || d > time.Second {
		t.Errorf("reset %v, want about %v (the end of the current hour by Redis TIME)", out[0].Reset, end.Sub(now))
	}
}

// countHook counts the commands and pipelines a client sends: its round trips.
type countHook struct{ n *atomic.Int64 }

func (h countHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { h.n.Add(1); return next(ctx, cmd) }
}
func (h countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { h.n.Add(1); return next(ctx, cmds) }
}

var scriptCalls = redistest.ScriptCalls

// One decision is one round trip and one script, whatever the number of rules (once the
// library is loaded: before, by EVALSHA, too).
func TestRedisWhenManyRulesMatchThenOneRoundTripAndOneScript(t *testing.T) {
	tier.Needs(t, "redis-server")
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil).(*store.Redis)
	admin := standalone.Client(t)
	var trips atomic.Int64
	s.Client().AddHook(countHook{&trips})
	for _, rules := range []int{1, 5, 32} {
		var checks []store.Check
		for i := range rules {
			checks = append(checks, store.Check{Limit: allKinds(10, time.Minute)[i%5], Cost: 1, Enforce: true, Tag: uniqueTag(t, rules), Rule: "r" + strconv.Itoa(i)})
		}
		out := make([]algorithm.Decision, rules)
		if _, err := s.Decide(context.Background(), checks, out); err != nil { // loads the library
			t.Fatal(err)
		}
		poll.WaitFor(t, 10*time.Second, poll.True("the library loaded", s.Functions))
		trips.Store(0)
		before := scriptCalls(t, admin)
		for range 10 {
			if _, err := s.Decide(context.Background(), checks, out); err != nil {
				t.Fatal(err)
			}
		}
		if got, scripts := trips.Load(), scriptCalls(t, admin)-before; got != 10 || scripts != 10 {
			t.Errorf("%d rules: %d round trips and %d scripts for 10 decisions, want 10 and 10", rules, got, scripts)
		}
	}
}

// Concurrent decisions share pipelines: fewer round trips than decisions, and still exactly one
// script each, never a duplicate, with the limit exact.
func TestRedisWhenDecisionsAreConcurrentThenTheySharePipelinesAndEachRunsOneScript(t *testing.T) {
	tier.Needs(t, "redis-server")
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil).(*store.Redis)
	admin := standalone.Client(t)
	checks := []store.Check{{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1000, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}}
	if _, err := s.Decide(context.Background(), checks, make([]algorithm.Decision, 1)); err != nil { // loads the script
		t.Fatal(err)
	}
	var trips, allowed atomic.Int64
	s.Client().AddHook(countHook{&trips})
	before := scriptCalls(t, admin)
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			out := make([]algorithm.Decision, 1)
			for range 25 {
				ok, err := s.Decide(context.Background(), checks, out)
				if err != nil {
					t.Error(err)
					return
				}
				if ok && out[0].Allowed {
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if scripts := scriptCalls(t, admin) - before; scripts != 1600 {
		t.Errorf("%d scripts for 1,600 decisions, want exactly one each", scripts)
	}
	if allowed.Load() != 999 {
		t.Errorf("%d allowed, want 999: the limit of 1,000 less the first decision", allowed.Load())
	}
	if trips.Load() >= 1600 {
		t.Errorf("%d round trips for 1,600 concurrent decisions, want them to share pipelines", trips.Load())
	}
	t.Logf("%d round trips for 1,600 decisions", trips.Load())
}

func TestDecodeWhenReplyIsUnexpectedThenErrorNotPanic(t *testing.T) {
	checks := []store.Check{{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 5}}}
	out := make([]algorithm.Decision, 1)
	for _, reply := range []any{nil, "OK", int64(1), []any{int64(1)}, []any{int64(1), int64(2), "x", int64(0), int64(0), int64(0), int64(0)}, []any{nil, nil, nil, nil, nil, nil, nil}} {
		if _, _, err := store.DecodeDecisions(reply, checks, []int{0}, out, nil); !errors.Is(err, store.ErrUnexpectedReply) {
			t.Errorf("reply %#v: err = %v, want ErrUnexpectedReply", reply, err)
		}
	}
}

func TestTagWhenClientKeyHasAnyBytesThenLayoutHoldsAndRawKeyIsAbsent(t *testing.T) {
	for _, key := range []string{"sk_live_SECRET", "}{:\x00\n", "", strings.Repeat("x", 10_000)} {
		tag := store.Tag("ns/policy", key)
		c := store.Check{Tag: tag, Rule: "AbCdEf_-"}
		k := c.Key()
		if len(tag) != 16 || k != "sl{"+tag+"}AbCdEf_-" || strings.ContainsAny(tag, "{}") {
			t.Errorf("client key %q breaks the layout: %q", key, k)
		}
		if key != "" && strings.Contains(k, key) {
			t.Errorf("raw client key %q appears in %q", key, k)
		}
	}
	if a, again := store.Tag("p", "a"), store.Tag("p", "a"); a == store.Tag("p", "b") || a != again || a == store.Tag("q", "a") {
		t.Error("tags do not tell client keys and policies apart deterministically")
	}
	// The policy and the client key are hashed apart: no pair imitates another.
	if store.Tag("ns/a", "b") == store.Tag("ns/ab", "") {
		t.Error("policy ns/a with client b shares a tag with policy ns/ab and no client")
	}
}
