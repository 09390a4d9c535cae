package store_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

var hotLimit = algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 1 << 40, Rate: 1 << 40, Period: time.Second}

func BenchmarkMemoryHotKey(b *testing.B) {
	s := store.NewMemory(store.MemoryOptions{SweepInterval: -1})
	defer func() { _ = s.Close() }()
	checks := []store.Check{{Limit: hotLimit, Cost: 1, Enforce: true, Tag: "bench:hot", Rule: "r"}}
	out := make([]algorithm.Decision, 1)
	b.ReportAllocs()
	for b.Loop() {
		_, _ = s.Decide(context.Background(), checks, out)
	}
}

func BenchmarkXTimeRateHotKey(b *testing.B) {
	l := rate.NewLimiter(rate.Limit(1<<40), 1<<40)
	b.ReportAllocs()
	for b.Loop() {
		_ = l.Allow()
	}
}

const manyKeys = 1_000_000

func BenchmarkMemoryMillionKeys(b *testing.B) {
	// Bounds above what a million keys take: the benchmark measures lookups, not evictions.
	s := store.NewMemory(store.MemoryOptions{MaxKeys: 2 * manyKeys, MaxBytes: 1 << 30, SweepInterval: -1})
	defer func() { _ = s.Close() }()
	tags := make([]string, manyKeys)
	for i := range tags {
		tags[i] = store.Tag("bench/many", strconv.Itoa(i))
	}
	checks := []store.Check{{Limit: hotLimit, Cost: 1, Enforce: true, Rule: "r"}}
	out := make([]algorithm.Decision, 1)
	// Every key held before the clock starts: the loop measures decisions of known clients, as
	// BenchmarkXTimeRateMillionKeys measures its limiters, not a million first requests.
	for _, tag := range tags {
		checks[0].Tag = tag
		_, _ = s.Decide(context.Background(), checks, out)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		checks[0].Tag = tags[i%manyKeys]
		_, _ = s.Decide(context.Background(), checks, out)
		i++
	}
	b.ReportMetric(float64(s.Len()), "keys")
}

// x/time/rate has no keyed store; the usual pairing is a map of limiters under a mutex.
func BenchmarkXTimeRateMillionKeys(b *testing.B) {
	var mu sync.Mutex
	limiters := make(map[string]*rate.Limiter)
	keys := make([]string, manyKeys)
	for i := range keys {
		keys[i] = store.Tag("bench/many", strconv.Itoa(i))
		limiters[keys[i]] = rate.NewLimiter(rate.Limit(1<<40), 1<<40)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		k := keys[i%manyKeys]
		mu.Lock()
		l := limiters[k]
		if l == nil {
			l = rate.NewLimiter(rate.Limit(1<<40), 1<<40)
			limiters[k] = l
		}
		mu.Unlock()
		_ = l.Allow()
		i++
	}
}

// BenchmarkRedisDecide measures decisions per second at concurrency 64 on one standalone Redis,
// and the Redis commands each decision costs, for 1 and for 5 rules on one key.
func BenchmarkRedisDecide(b *testing.B) {
	for _, rules := range []int{1, 5} {
		b.Run(fmt.Sprintf("rules=%d", rules), func(b *testing.B) {
			s, err := store.NewRedis(store.RedisOptions{Addrs: []string{standalone.Addr()}, Timeout: time.Second, PoolSize: 64})
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = s.Close() }()
			kinds := allKinds(1<<30, time.Hour)
			admin := redis.NewClient(&redis.Options{Addr: standalone.Addr()})
			defer func() { _ = admin.Close() }()
			var seq, failed, roundTrips atomic.Int64
			s.Client().AddHook(countHook{&roundTrips})
			before := scriptCalls(b, admin)
			b.SetParallelism(64 / max(1, runtimeProcs()))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				checks := make([]store.Check, rules)
				out := make([]algorithm.Decision, rules)
				for pb.Next() {
					tag := store.Tag("bench/redis", strconv.FormatInt(seq.Add(1)%100_000, 10))
					for i := range checks {
						checks[i] = store.Check{Limit: kinds[i%len(kinds)], Cost: 1, Enforce: true, Tag: tag, Rule: "r" + strconv.Itoa(i)}
					}
					if _, err := s.Decide(context.Background(), checks, out); err != nil {
						failed.Add(1)
					}
				}
			})
			b.StopTimer()
			calls := scriptCalls(b, admin) - before
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
			b.ReportMetric(float64(calls)/float64(b.N), "script-calls/decision")
			b.ReportMetric(float64(roundTrips.Load())/float64(b.N), "round-trips/decision")
			if failed.Load() > 0 {
				b.Fatalf("%d decisions failed", failed.Load())
			}
		})
	}
}

func runtimeProcs() int {
	n, _ := strconv.Atoi(os.Getenv("GOMAXPROCS"))
	if n > 0 {
		return n
	}
	return 2
}

// tokenBucketArgs are decide.lua's arguments for one token bucket rule, as the store sends them:
// now (from TIME), request id, records, mode, enforcer, then the rule's kind (token bucket), limit,
// rate, period, max wait, cost, enforce, record, deferred, leases, take (-1: none), expiry, back,
// back_us, hold, spent.
var tokenBucketArgs = []string{"", "id", "", "d", "bench",
	"1", "1073741824", "1073741824", "3600000000", "0", "1", "1", "0", "0", "0", "-1", "0", "0", "0", "0", "0"}

// BenchmarkRedisPipelining compares how decisions reach Redis at concurrency 64 on one standalone
// Redis: the store as it ships (its batcher: each of Pipelines dispatchers writes every decision
// waiting, then reads their replies) with 4 pipelines (the default) and with 1, against go-redis's
// automatic pipelining (v9.22, experimental) in its blocking face, half-duplex (one batch in
// flight) and full-duplex (one connection written and read at once), calling the same function
// with the arguments of one token bucket rule. The store's variants do a whole decision's Go work
// (arguments, reply, results); the others only send the call and read its reply. Reported:
// decisions/s, the p99 of one decision's wait, and this process's CPU per decision (Redis runs in
// a process of its own).
func BenchmarkRedisPipelining(b *testing.B) {
	admin := redis.NewClient(&redis.Options{Addr: standalone.Addr()})
	defer func() { _ = admin.Close() }()
	if err := admin.FunctionLoad(context.Background(), store.DecideLibrary).Err(); err != nil && !strings.HasSuffix(err.Error(), "already exists") {
		b.Fatalf("load the library: %v", err)
	}
	kinds := allKinds(1<<30, time.Hour)
	viaStore := func(pipelines int) func(b *testing.B) func(n int64) error {
		return func(b *testing.B) func(n int64) error {
			b.Helper()
			s, err := store.NewRedis(store.RedisOptions{Addrs: []string{standalone.Addr()}, Timeout: time.Second, PoolSize: 64, Pipelines: pipelines})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = s.Close() })
			// The library loads in the background: the store decides by EVALSHA until it has,
			// and this benchmark measures FCALL.
			poll.WaitFor(b, 10*time.Second, poll.True("the library loaded", s.Functions))
			return func(n int64) error {
				checks := []store.Check{{Limit: kinds[0], Cost: 1, Enforce: true, Tag: store.Tag("bench/pipelining", strconv.FormatInt(n%100_000, 10)), Rule: "r"}}
				out := make([]algorithm.Decision, 1)
				_, err := s.Decide(context.Background(), checks, out)
				return err
			}
		}
	}
	viaAutoPipeline := func(fullDuplex bool) func(b *testing.B) func(n int64) error {
		return func(b *testing.B) func(n int64) error {
			b.Helper()
			c := redis.NewClient(&redis.Options{Addr: standalone.Addr(), MaxRetries: -1, PoolSize: 64})
			b.Cleanup(func() { _ = c.Close() })
			o := redis.DefaultBlockingAutoPipelineOptions()
			o.FullDuplex = fullDuplex
			ap, err := c.AutoPipelineWithOptions(o)
			if err != nil {
				b.Fatal(err)
			}
			args := make([]any, len(tokenBucketArgs))
			for i, a := range tokenBucketArgs {
				args[i] = a
			}
			return func(n int64) error {
				reply, err := ap.FCall(context.Background(), store.DecideFunction, []string{"sl{c" + strconv.FormatInt(n%100_000, 10) + "}AbCdEfGh"}, args...).Slice()
				if err == nil && len(reply) == 0 {
					err = fmt.Errorf("an empty reply")
				}
				return err
			}
		}
	}
	for _, v := range []struct {
		name  string
		start func(b *testing.B) func(n int64) error
	}{
		{"store/pipelines=4", viaStore(4)},
		{"store/pipelines=1", viaStore(1)},
		{"autopipeline/half-duplex", viaAutoPipeline(false)},
		{"autopipeline/full-duplex", viaAutoPipeline(true)},
	} {
		b.Run(v.name, func(b *testing.B) {
			decide := v.start(b)
			var seq, failed atomic.Int64
			var mu sync.Mutex
			var waits []time.Duration
			cpu := processCPU()
			b.SetParallelism(64 / max(1, runtimeProcs()))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				var own []time.Duration
				for pb.Next() {
					start := time.Now()
					if err := decide(seq.Add(1)); err != nil {
						failed.Add(1)
					}
					own = append(own, time.Since(start))
				}
				mu.Lock()
				waits = append(waits, own...)
				mu.Unlock()
			})
			b.StopTimer()
			cpu = processCPU() - cpu
			slices.Sort(waits)
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
			b.ReportMetric(float64(waits[len(waits)*99/100].Microseconds()), "p99-µs")
			b.ReportMetric(float64(cpu.Nanoseconds())/1e3/float64(b.N), "client-CPU-µs/decision")
			if failed.Load() > 0 {
				b.Fatalf("%d decisions failed", failed.Load())
			}
		})
	}
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkRedisBenchmarkCeiling runs redis-benchmark with 64 connections against the same
// Redis, calling the decide script's function (FCALL) with the arguments of one token-bucket
// rule as BenchmarkRedisDecide/rules=1 sends it, on 100,000 client keys: the ceiling a Go client
// can approach.
func BenchmarkRedisBenchmarkCeiling(b *testing.B) {
	admin := redis.NewClient(&redis.Options{Addr: standalone.Addr()})
	defer func() { _ = admin.Close() }()
	if err := admin.FunctionLoad(context.Background(), store.DecideLibrary).Err(); err != nil && !strings.HasSuffix(err.Error(), "already exists") {
		b.Fatalf("load the library: %v", err)
	}
	host, port, _ := strings.Cut(standalone.Addr(), ":")
	const n = 200_000
	b.ResetTimer()
	for b.Loop() {
		args := append([]string{"-h", host, "-p", port, "-c", "64", "-n", strconv.Itoa(n), "-r", "100000", "-q",
			"FCALL", store.DecideFunction, "1", "sl{c__rand_int__}AbCdEfGh"}, tokenBucketArgs...)
		out, err := exec.Command("redis-benchmark", args...).CombinedOutput()
		if err != nil {
			b.Fatalf("redis-benchmark: %v: %s", err, out)
		}
		m := regexp.MustCompile(`([0-9.]+) requests per second`).FindSubmatch(out)
		if m == nil {
			b.Fatalf("redis-benchmark printed no rate: %s", out)
		}
		rps, _ := strconv.ParseFloat(string(m[1]), 64)
		b.ReportMetric(rps, "decisions/s")
	}
}

// BenchmarkRedisMemoryPerKey writes 100,000 client keys per algorithm and reports the Redis
// memory each takes: MEMORY USAGE averaged over the keys, and the growth of used_memory per key
// (which includes the keyspace's own overhead). The sliding log holds 100 entries per key, one
// per admitted request whatever its cost, so each of its keys gets 100 requests of cost 1: 2,000
// keys, not to make the run a hundred times longer.
func BenchmarkRedisMemoryPerKey(b *testing.B) {
	for _, l := range allKinds(100, time.Hour) {
		b.Run(l.Kind.String(), func(b *testing.B) {
			keys, requests := int64(100_000), 1
			if l.Kind == algorithm.SlidingLog {
				keys, requests = 2_000, 100
			}
			for b.Loop() {
				srv := startFresh(b)
				s, err := store.NewRedis(store.RedisOptions{Addrs: []string{srv}, Timeout: time.Second, PoolSize: 64})
				if err != nil {
					b.Fatal(err)
				}
				c := redis.NewClient(&redis.Options{Addr: srv})
				before := usedMemory(b, c)
				var next atomic.Int64
				var wg sync.WaitGroup
				for range 64 {
					wg.Go(func() {
						out := make([]algorithm.Decision, 1)
						for i := next.Add(1); i <= keys; i = next.Add(1) {
							checks := []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: store.Tag("bench/mem", strconv.FormatInt(i, 10)), Rule: store.RuleID("bench/mem", "per-client", l.Layout())}}
							for range requests {
								if _, err := s.Decide(context.Background(), checks, out); err != nil {
									b.Error(err)
									return
								}
							}
						}
					})
				}
				wg.Wait()
				growth := float64(usedMemory(b, c)-before) / float64(keys)
				var usage int64
				const sample = 2000
				for i := range sample {
					k := store.Check{Tag: store.Tag("bench/mem", strconv.Itoa(i+1)), Rule: store.RuleID("bench/mem", "per-client", l.Layout())}
					usage += c.MemoryUsage(context.Background(), k.Key()).Val()
				}
				b.ReportMetric(float64(usage)/sample, "MEMORY-USAGE-B/key")
				b.ReportMetric(growth, "used_memory-B/key")
				_ = c.Close()
				_ = s.Close()
			}
		})
	}
}

func usedMemory(b *testing.B, c *redis.Client) int64 {
	b.Helper()
	info, err := c.Info(context.Background(), "memory").Result()
	if err != nil {
		b.Fatal(err)
	}
	m := regexp.MustCompile(`used_memory:(\d+)`).FindStringSubmatch(info)
	n, _ := strconv.ParseInt(m[1], 10, 64)
	return n
}

// startFresh starts an empty Redis for one measurement.
var startServer = redistest.StartServer

func startFresh(b *testing.B) string {
	b.Helper()
	srv, err := startServer()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(srv.Stop)
	return srv.Addr()
}
