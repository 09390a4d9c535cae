package algorithm_test

import (
	"math"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/algorithm"
)

// A concurrency limit of 2 with leases of 10s: two requests hold both slots, a third is refused
// with no Retry-After (no clock frees a slot), a release frees one at once, a renewal keeps a
// lease past its first timeout, and a lease nobody renews frees its slot when it expires.
func TestConcurrencyWhenLeasesAreTakenReleasedRenewedAndLeftThenSlotsFollowThem(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.Concurrency, Limit: 2, Period: 10 * time.Second}
	var st algorithm.State
	take := func(at time.Duration, id string, want bool, remaining int64) algorithm.Decision {
		t.Helper()
		next, d := l.TakeAs(st, t0.Add(at), 1, id)
		if d.Allowed != want || d.Remaining != remaining || d.Never || d.RetryAfter != 0 {
			t.Fatalf("%s at +%v: %+v, want allowed %v with %d remaining and no Retry-After", id, at, d, want, remaining)
		}
		if d.Allowed {
			st = next
		}
		return d
	}
	if d := take(0, "a", true, 1); d.Reset != 10*time.Second {
		t.Errorf("reset %v, want the lease's 10s", d.Reset)
	}
	take(time.Second, "b", true, 0)
	take(2*time.Second, "c", false, 0)

	st, d := l.Release(st, t0.Add(3*time.Second), "a", 1)
	if d.Remaining != 1 || len(st.Leases) != 1 || st.Leases[0].ID != "b" {
		t.Fatalf("after releasing a: %+v, leases %+v; want b alone", d, st.Leases)
	}
	take(3*time.Second, "c", true, 0)

	// b renewed at +9s lives to +19s; c, never renewed, expires at +13s.
	st, d = l.Renew(st, t0.Add(9*time.Second), "b", 1)
	if d.Remaining != 0 || d.Reset != 10*time.Second {
		t.Fatalf("after renewing b: %+v, want both slots held until +19s", d)
	}
	take(12*time.Second, "d", false, 0)
	take(13*time.Second, "d", true, 0) // c expired: its slot is free
	take(18*time.Second, "e", false, 0)
	take(19*time.Second, "e", true, 0) // b expired too

	// A lease that expired is not brought back by a late renewal, nor released twice.
	before := len(st.Leases)
	st, _ = l.Renew(st, t0.Add(40*time.Second), "d", 1)
	if len(st.Leases) != 0 {
		t.Errorf("a renewal after every lease expired left %d of %d leases: %+v", len(st.Leases), before, st.Leases)
	}
	st, d = l.Release(st, t0.Add(40*time.Second), "nobody", 1)
	if d.Remaining != 2 || len(st.Leases) != 0 {
		t.Errorf("releasing an unknown lease: %+v, %+v", d, st.Leases)
	}
}

// Release and Renew find a lease by its request and its slots: the one held, never another's;
// neither changes the state the caller passed.
func TestConcurrencyWhenReleasedOrRenewedThenTheCallersStateIsUntouched(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.Concurrency, Limit: 5, Period: time.Minute}
	var st algorithm.State
	st, _ = l.TakeAs(st, t0, 2, "a")
	st, _ = l.TakeAs(st, t0, 1, "b")
	kept := append([]algorithm.Lease(nil), st.Leases...)
	if _, d := l.Release(st, t0, "a", 1); d.Remaining != 2 {
		t.Errorf("releasing a with the wrong slots freed something: %+v", d)
	}
	if _, d := l.Release(st, t0, "a", 2); d.Remaining != 4 {
		t.Errorf("releasing a: %+v, want 4 remaining", d)
	}
	if _, d := l.Renew(st, t0.Add(30*time.Second), "b", 1); d.Reset != time.Minute {
		t.Errorf("renewing b: reset %v, want a minute", d.Reset)
	}
	for i := range kept {
		if st.Leases[i] != kept[i] {
			t.Fatalf("the caller's leases changed: %+v, were %+v", st.Leases, kept)
		}
	}
}

// A post-response charge never refuses: a cost within what the rule has left is charged as it
// is, and a larger one takes the rule to exhaustion (nothing left) and no further, so the rule
// recovers as from a full charge; a negative cost charges nothing.
func TestChargeWhenTheCostExceedsWhatIsLeftThenTheRuleIsExhaustedAndNoFurther(t *testing.T) {
	for _, l := range []algorithm.Limit{
		{Kind: algorithm.TokenBucket, Limit: 1000, Rate: 1000, Period: time.Hour},
		{Kind: algorithm.FixedWindow, Limit: 1000, Period: time.Hour},
		{Kind: algorithm.SlidingLog, Limit: 1000, Period: time.Hour},
		{Kind: algorithm.SlidingWindowCounter, Limit: 1000, Period: time.Hour},
	} {
		t.Run(l.Kind.String(), func(t *testing.T) {
			var st algorithm.State
			now := t0.Add(17 * time.Minute)
			var d algorithm.Decision
			for i, want := range []int64{700, 400, 100, 0, 0} {
				st, d = l.Charge(st, now, 300)
				if !d.Allowed || d.Remaining != want {
					t.Fatalf("charge %d of 300: %+v, want %d remaining", i+1, d, want)
				}
			}
			if _, d := l.Take(st, now, 1); d.Allowed {
				t.Errorf("an exhausted rule admitted a request: %+v", d)
			}
			if st, d = l.Charge(st, now, -5); d.Remaining != 0 || !d.Allowed {
				t.Errorf("a negative charge: %+v", d)
			}
			// Exhausted, not in debt: once the whole horizon has passed, the full limit is back.
			if _, d := l.Take(st, now.Add(2*time.Hour), 1000); !d.Allowed {
				t.Errorf("two hours later the full limit is refused: %+v", d)
			}
		})
	}
}

// The concurrency limit's cost bounds are those of every algorithm: a cost over the limit can
// never pass, and is refused as such with the state as a cost-0 check sees it.
func TestConcurrencyWhenTheCostExceedsTheLimitThenRefusedAsNever(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.Concurrency, Limit: 5, Period: time.Minute}
	for _, cost := range []int64{6, math.MaxInt64, -1} {
		var st algorithm.State
		st, _ = l.TakeAs(st, t0, 2, "a")
		next, d := l.TakeAs(st, t0, cost, "b")
		if want := (algorithm.Decision{Limit: 5, Remaining: 3, Reset: time.Minute, Never: true}); d != want {
			t.Errorf("cost %d: %+v, want %+v", cost, d, want)
		}
		if len(next.Leases) != 1 {
			t.Errorf("cost %d added a lease: %+v", cost, next.Leases)
		}
	}
}
