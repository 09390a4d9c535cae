package store_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
)

// memories are the memory store, and one whose keys all share one hash: all but one key of a
// shard then live in its collided map.
var memories = map[string]func(store.MemoryOptions) *store.Memory{"memory": store.NewMemory, "memory-colliding": store.NewCollidingMemory}

func TestMemoryWhenStateIsBackToIdleThenSweepRemovesTheKey(t *testing.T) {
	for name, newMemory := range memories {
		t.Run(name, func(t *testing.T) { testSweep(t, newMemory) })
	}
}

func testSweep(t *testing.T, newMemory func(store.MemoryOptions) *store.Memory) {
	t.Helper()
	clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	s := newMemory(store.MemoryOptions{Now: clock.Now, SweepInterval: -1})
	defer func() { _ = s.Close() }()
	out := make([]algorithm.Decision, 1)
	for i, l := range allKinds(5, 10*time.Second) {
		// The whole limit at once: every state needs at least the full 10s to be idle again.
		c := []store.Check{{Limit: l, Cost: 5, Enforce: true, Tag: strconv.Itoa(i), Rule: "r"}}
		if ok, err := s.Decide(context.Background(), c, out); err != nil || !ok {
			t.Fatalf("%s: %v %v", l.Kind, ok, err)
		}
	}
	kinds := len(allKinds(5, 10*time.Second))
	if s.Len() != kinds {
		t.Fatalf("Len = %d, want %d", s.Len(), kinds)
	}
	clock.Step(5 * time.Second)
	s.Sweep()
	if s.Len() != kinds {
		t.Fatalf("after 5s Len = %d, want %d: no state is idle yet", s.Len(), kinds)
	}
	clock.Step(15 * time.Second) // the fixed window's state is idle after at most 2 windows
	s.Sweep()
	if s.Len() != 0 {
		t.Errorf("after every reset passed Len = %d, want 0", s.Len())
	}
}

func TestMemoryWhenFloodedWithRandomKeysThenKeyCountStaysBounded(t *testing.T) {
	for name, newMemory := range memories {
		t.Run(name, func(t *testing.T) { testFlood(t, newMemory) })
	}
}

func testFlood(t *testing.T, newMemory func(store.MemoryOptions) *store.Memory) {
	t.Helper()
	clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	s := newMemory(store.MemoryOptions{MaxKeys: 6400, Now: clock.Now, SweepInterval: -1})
	defer func() { _ = s.Close() }()
	out := make([]algorithm.Decision, 1)
	l := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 10, Rate: 1, Period: time.Hour}
	for i := range 100_000 {
		c := []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: strconv.Itoa(i), Rule: "r"}}
		if ok, err := s.Decide(context.Background(), c, out); err != nil || !ok {
			t.Fatalf("new key %d: %v %v", i, ok, err)
		}
	}
	if n := s.Len(); n > 6400 {
		t.Errorf("Len = %d after 100,000 distinct keys, want at most 6400", n)
	}
}

// Keys whose hashes collide keep states of their own: when the key that holds the hash's slot
// is swept, one that collided with it keeps its state, and a new key takes the slot; when one
// that collided is swept, the others keep theirs.
func TestMemoryWhenKeysCollideAndTheFirstIsSweptThenTheOthersKeepTheirStates(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	s := store.NewCollidingMemory(store.MemoryOptions{Now: clock.Now, SweepInterval: -1})
	defer func() { _ = s.Close() }()
	short := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1, Period: time.Second}
	long := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1, Period: time.Hour}
	decide := func(rule string, l algorithm.Limit) bool {
		t.Helper()
		// One client: its rules share a shard, and every key there has hash 0.
		ok, err := s.Decide(context.Background(), []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: "client", Rule: rule}}, make([]algorithm.Decision, 1))
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !decide("first", short) || !decide("second", long) || decide("first", short) || decide("second", long) {
		t.Fatal("each rule's first request admitted and its second refused: want each key its own state")
	}
	clock.Step(3 * time.Second)
	s.Sweep()
	if s.Len() != 1 {
		t.Fatalf("Len = %d after the short window ended, want 1", s.Len())
	}
	if decide("second", long) {
		t.Error("the colliding key's second request was admitted after the first key was swept: its state was lost")
	}
	if !decide("third", long) || decide("third", long) || decide("second", long) {
		t.Error("a new key after the sweep: want its first admitted, its second refused, the old key's state kept")
	}
	// Now a key that collided is swept while the slot's holder stays.
	if !decide("fourth", short) || s.Len() != 3 {
		t.Fatalf("a fourth key: want admitted and 3 keys held, have %d", s.Len())
	}
	clock.Step(3 * time.Second)
	s.Sweep()
	if s.Len() != 2 {
		t.Errorf("Len = %d after the fourth key's window ended, want 2", s.Len())
	}
	if decide("third", long) || decide("second", long) {
		t.Error("a key's second request was admitted after another, colliding key was swept: its state was lost")
	}
}

// Names are any bytes, none of them special: a record of an empty tag and an empty idempotency
// key is evicted like any other when its shard is full (it was skipped as "keep none", and the
// next record of its shard spun for ever under the shard's lock).
func TestMemoryWhenKeysAreEmptyStringsThenTheyAreEvictedLikeAnyOther(t *testing.T) {
	for name, newMemory := range memories {
		t.Run(name, func(t *testing.T) {
			s := newMemory(store.MemoryOptions{MaxKeys: 64, SweepInterval: -1}) // one key per shard
			defer func() { _ = s.Close() }()
			l := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Hour}
			done := make(chan struct{})
			go func() {
				defer close(done)
				for _, rule := range []string{"", "r"} {
					for _, key := range []string{"", "x"} {
						c := []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: "", Rule: rule, Idempotency: &store.Idempotency{Key: key, Window: time.Hour}}}
						if ok, err := s.Decide(context.Background(), c, make([]algorithm.Decision, 1)); !ok || err != nil {
							t.Errorf("rule %q, key %q: %v, %v; want admitted", rule, key, ok, err)
						}
					}
				}
			}()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("a decision of an empty tag did not return in 10s")
			}
			if n := s.Len(); n > 2 {
				t.Errorf("Len = %d with one key per shard, want at most 2 (an entry and a record)", n)
			}
		})
	}
}

func TestMemoryWhenRefusedThenNoRuleIsCharged(t *testing.T) {
	s := store.NewMemory(store.MemoryOptions{SweepInterval: -1})
	defer func() { _ = s.Close() }()
	checks := []store.Check{
		{Limit: algorithm.Limit{Kind: algorithm.SlidingLog, Limit: 100, Period: time.Hour}, Cost: 1, Enforce: true, Tag: "a", Rule: "wide"},
		{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1, Period: time.Hour}, Cost: 1, Enforce: true, Tag: "b", Rule: "narrow"},
	}
	out := make([]algorithm.Decision, 2)
	for range 10 {
		if _, err := s.Decide(context.Background(), checks, out); err != nil {
			t.Fatal(err)
		}
	}
	checks[0].Cost = 0
	if _, err := s.Decide(context.Background(), checks[:1], out); err != nil {
		t.Fatal(err)
	}
	if out[0].Remaining != 99 {
		t.Errorf("wide rule remaining %d after 1 pass and 9 refusals, want 99", out[0].Remaining)
	}
}
