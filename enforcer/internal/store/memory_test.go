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

func TestMemoryWhenStateIsBackToIdleThenSweepRemovesTheKey(t *testing.T) {
	clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	s := store.NewMemory(store.MemoryOptions{Now: clock.Now, SweepInterval: -1})
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
	clock := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	s := store.NewMemory(store.MemoryOptions{MaxKeys: 6400, Now: clock.Now, SweepInterval: -1})
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
