package store_test

import (
	"context"
	"fmt"
	"math"
	"runtime"
	"strconv"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
)

// A cost above a rule's limit, however it came about (RLS hits_addend times the rule's cost,
// saturated at MaxInt64), is refused at once as one that can never pass, on every algorithm and
// store: no error (which would send the rule to its failure mode), no Retry-After, no charge.
func TestStoresWhenCostExceedsTheLimitThenRefusedAsNeverWithoutErrorOrCharge(t *testing.T) {
	start := time.Unix(1_700_000_000, 0)
	for _, tg := range targets() {
		for _, l := range allKinds(5, time.Minute) {
			for _, cost := range []int64{6, 1000, math.MaxInt64} {
				t.Run(tg.name+"/"+l.Kind.String(), func(t *testing.T) {
					clock := clocktesting.NewFakeClock(start)
					s := tg.make(t, clock.Now)
					tag := uniqueTag(t, cost)
					one := []store.Check{{Limit: l, Cost: 2, Enforce: true, Tag: tag, Rule: "r"}}
					out := make([]algorithm.Decision, 1)
					if _, err := s.Decide(context.Background(), one, out); err != nil || !out[0].Allowed {
						t.Fatalf("cost 2: %+v, %v", out[0], err)
					}
					// The oversized check next to a rule that would admit it: neither is charged.
					checks := []store.Check{
						{Limit: l, Cost: cost, Enforce: true, Tag: tag, Rule: "r"},
						{Limit: l, Cost: 1, Enforce: true, Tag: tag, Rule: "other"},
					}
					out = make([]algorithm.Decision, 2)
					charged, err := s.Decide(context.Background(), checks, out)
					if err != nil {
						t.Fatalf("cost %d: error %v, want a refusal", cost, err)
					}
					want := algorithm.Decision{Limit: 5, Remaining: 3, Never: true, Reset: out[0].Reset}
					if charged || out[0] != want || out[0].Reset <= 0 {
						t.Errorf("cost %d: charged %v, %+v, want %+v with a reset", cost, charged, out[0], want)
					}
					if !out[1].Allowed || out[1].Remaining != 5 {
						t.Errorf("the other rule: %+v, want allowed with 5 remaining, uncharged", out[1])
					}
					// A shadow rule of that cost refuses but never blocks the request.
					checks[0].Enforce = false
					if charged, err := s.Decide(context.Background(), checks, out); err != nil || !charged || !out[0].Never {
						t.Errorf("shadow: charged %v, %+v, %v", charged, out[0], err)
					}
				})
			}
		}
	}
}

// One call at a sliding log's limit adds one entry, not one per unit: per key and per call the
// state is bounded by the requests, not by their cost.
func TestStoresWhenASlidingLogIsChargedItsLimitAtOnceThenItsStateIsOneEntry(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.SlidingLog, Limit: 10_000, Period: time.Hour}
	for _, tg := range targets() {
		t.Run(tg.name, func(t *testing.T) {
			s := tg.make(t, nil)
			tag := uniqueTag(t)
			checks := []store.Check{{Limit: l, Cost: 10_000, Enforce: true, Tag: tag, Rule: "log"}}
			out := make([]algorithm.Decision, 1)
			if _, err := s.Decide(context.Background(), checks, out); err != nil || !out[0].Allowed || out[0].Remaining != 0 {
				t.Fatalf("%+v, %v", out[0], err)
			}
			checks[0].Cost = 1
			if _, err := s.Decide(context.Background(), checks, out); err != nil || out[0].Allowed || out[0].RetryAfter <= 59*time.Minute {
				t.Fatalf("over the limit: %+v, %v", out[0], err)
			}
			switch m := s.(type) {
			case *store.Memory:
				if b := m.Bytes(); b > 1024 {
					t.Errorf("the memory store holds %d bytes for one sliding log key", b)
				}
			case *store.Redis:
				members, err := m.Client().ZCard(context.Background(), checks[0].Key()).Result()
				if err != nil || members != 2 {
					t.Errorf("the key holds %d members (%v), want 2: the request and the total", members, err)
				}
			}
		})
	}
}

// Many fresh keys each charged a sliding log's limit: the memory store holds at most MaxBytes as
// it counts them, and what it counts covers the heap it really holds.
func TestMemoryWhenKeysAreHeldThenTheirCountedBytesCoverTheHeap(t *testing.T) {
	const maxBytes = 4 << 20
	s := store.NewMemory(store.MemoryOptions{MaxBytes: maxBytes, SweepInterval: -1})
	defer func() { _ = s.Close() }()
	kinds := allKinds(100, time.Hour)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	out := make([]algorithm.Decision, 1)
	const keys = 10_000
	for i := range keys {
		l := kinds[i%len(kinds)]
		c := []store.Check{{Limit: l, Cost: 1 + int64(i%3), Enforce: true, Tag: store.Tag("p", strconv.Itoa(i)), Rule: "ruleid01"}}
		for j := range 3 {
			// A lease's name as long as the limiter's, each its own string, as each request's is.
			c[0].Lease = fmt.Sprintf("%012x.%07d", i, j)
			if _, err := s.Decide(context.Background(), c, out); err != nil {
				t.Fatal(err)
			}
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	heap := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d keys: %d bytes of heap, %d counted", s.Len(), heap, s.Bytes())
	if counted := s.Bytes(); heap > counted*11/10 {
		t.Errorf("%d keys take %d bytes of heap, the store counts %d", s.Len(), heap, counted)
	}
	if s.Bytes() > maxBytes {
		t.Errorf("counted %d bytes, more than MaxBytes %d", s.Bytes(), maxBytes)
	}
	runtime.KeepAlive(s)
}

// One past the edge: a store full to MaxBytes that takes one more key evicts to stay within it.
func TestMemoryWhenMaxBytesIsReachedThenOneMoreKeyEvictsAndTheBoundHolds(t *testing.T) {
	const maxBytes = 64 * 1024 // 1 KiB per shard
	s := store.NewMemory(store.MemoryOptions{MaxBytes: maxBytes, SweepInterval: -1})
	defer func() { _ = s.Close() }()
	l := algorithm.Limit{Kind: algorithm.SlidingLog, Limit: 10_000, Period: time.Hour}
	out := make([]algorithm.Decision, 1)
	for i := range 100_000 {
		c := []store.Check{{Limit: l, Cost: 10_000, Enforce: true, Tag: store.Tag("p", strconv.Itoa(i)), Rule: "ruleid01"}}
		if _, err := s.Decide(context.Background(), c, out); err != nil || !out[0].Allowed {
			t.Fatalf("key %d: %+v, %v", i, out[0], err)
		}
		if b := s.Bytes(); b > maxBytes {
			t.Fatalf("after key %d the store counts %d bytes, more than %d", i, b, maxBytes)
		}
	}
	// A key whose log grows past its shard's share evicts the others, never itself.
	tag := store.Tag("p", "grows")
	c := []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: tag, Rule: "ruleid01"}}
	clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	s2 := store.NewMemory(store.MemoryOptions{MaxBytes: maxBytes, SweepInterval: -1, Now: clock.Now})
	defer func() { _ = s2.Close() }()
	for i := range 500 {
		clock.Step(time.Millisecond)
		if _, err := s2.Decide(context.Background(), c, out); err != nil || !out[0].Allowed || out[0].Remaining != int64(9_999-i) {
			t.Fatalf("request %d: %+v, %v", i, out[0], err)
		}
	}
}

// A hot sliding log whose entries keep leaving its window holds an array of the order of the
// entries in the window: what left is compacted away, and the bytes counted follow.
func TestMemoryWhenASlidingLogSlidesForLongThenItsArrayStaysTheSizeOfItsWindow(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	s := store.NewMemory(store.MemoryOptions{SweepInterval: -1, Now: clock.Now})
	defer func() { _ = s.Close() }()
	l := algorithm.Limit{Kind: algorithm.SlidingLog, Limit: 10_000, Period: time.Second}
	c := []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: store.Tag("p", "hot"), Rule: "ruleid01"}}
	out := make([]algorithm.Decision, 1)
	most := int64(0)
	for i := range 200_000 {
		clock.Step(time.Millisecond) // 1,000 entries in the window
		if _, err := s.Decide(context.Background(), c, out); err != nil || !out[0].Allowed {
			t.Fatalf("request %d: %+v, %v", i, out[0], err)
		}
		most = max(most, s.Bytes())
	}
	if limit := int64(4 * 1016 * algorithm.LogEntrySize); most > limit {
		t.Errorf("the key counted up to %d bytes for 1,000 entries in its window, want at most %d", most, limit)
	}
}

// A decision of several rules, or with an idempotency record, allocates nothing once the keys
// exist: its bookkeeping lives in a pooled decision, not on the heap per request.
func TestMemoryWhenSeveralRulesAreDecidedThenNothingIsAllocated(t *testing.T) {
	s := store.NewMemory(store.MemoryOptions{SweepInterval: -1})
	t.Cleanup(func() { _ = s.Close() })
	l := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1 << 40, Period: time.Hour}
	checks := []store.Check{
		{Limit: l, Cost: 1, Enforce: true, Tag: store.Tag("p", "a"), Rule: "ruleid01"},
		{Limit: l, Cost: 1, Enforce: true, Tag: store.Tag("p", "b"), Rule: "ruleid02"},
		{Limit: l, Cost: 1, Enforce: true, Tag: store.Tag("p", "a"), Rule: "ruleid03", Idempotency: &store.Idempotency{Key: "k", Window: time.Hour, MaxRepeats: 1 << 40}},
	}
	out := make([]algorithm.Decision, len(checks))
	ctx := context.Background()
	for _, n := range []int{2, 3} {
		if _, err := s.Decide(ctx, checks[:n], out); err != nil { // the keys and the record exist from here
			t.Fatal(err)
		}
		// The race detector drops a share of what the pool is given: a dropped decision is
		// allocated anew, one allocation in some runs, never one in every run.
		allocs := testing.AllocsPerRun(200, func() { _, _ = s.Decide(ctx, checks[:n], out) })
		if allocs != 0 && !(raceEnabled && allocs < 1) {
			t.Errorf("%d checks: %v allocations per decision, want 0", n, allocs)
		}
	}
}
