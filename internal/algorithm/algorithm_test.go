package algorithm_test

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/algorithm"
)

var t0 = time.Unix(1_700_000_000, 0)

type step struct {
	at        time.Duration
	cost      int64
	allowed   bool
	remaining int64
}

func run(t *testing.T, l algorithm.Limit, steps []step) []algorithm.Decision {
	t.Helper()
	var st algorithm.State
	var ds []algorithm.Decision
	for i, s := range steps {
		next, d := l.Take(st, t0.Add(s.at), s.cost)
		if d.Allowed {
			st = next
		}
		if d.Allowed != s.allowed || d.Remaining != s.remaining {
			t.Errorf("step %d at +%v cost %d: allowed %v remaining %d, want %v %d (%+v)",
				i, s.at, s.cost, d.Allowed, d.Remaining, s.allowed, s.remaining, d)
		}
		ds = append(ds, d)
	}
	return ds
}

func TestTokenBucketWhenDrainedThenRefillsLazilyAndNeverAboveCapacity(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 2, Rate: 1, Period: time.Second}
	ds := run(t, l, []step{
		{0, 1, true, 1}, {0, 1, true, 0},
		{0, 1, false, 0},                      // empty
		{500 * time.Millisecond, 1, false, 0}, // half a token
		{time.Second, 1, true, 0},             // refilled lazily
		{time.Hour, 1, true, 1},               // an idle bucket holds capacity, not more
		{time.Hour, 1, true, 0},
		{time.Hour, 1, false, 0},
	})
	if got := ds[2].RetryAfter; got != time.Second {
		t.Errorf("retry-after when empty = %v, want 1s", got)
	}
	if got := ds[3].RetryAfter; got != 500*time.Millisecond {
		t.Errorf("retry-after at half a token = %v, want 500ms", got)
	}
	if got := ds[1].Reset; got != 2*time.Second {
		t.Errorf("reset when empty = %v, want 2s until full", got)
	}
}

func TestTokenBucketWhenCostIsThreeThenCapacityTenAdmitsThree(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 10, Rate: 1, Period: time.Hour}
	run(t, l, []step{{0, 3, true, 7}, {0, 3, true, 4}, {0, 3, true, 1}, {0, 3, false, 1}, {0, 1, true, 0}})
}

func TestEveryAlgorithmWhenCostIsZeroThenNothingIsCharged(t *testing.T) {
	for _, l := range withConcurrency(allKinds(5, time.Minute)) {
		t.Run(l.Kind.String(), func(t *testing.T) {
			var st algorithm.State
			now := t0
			for range 20 {
				var d algorithm.Decision
				st, d = l.Take(st, now, 0)
				if !d.Allowed || d.Remaining != 5 {
					t.Fatalf("cost 0: %+v, want allowed with all 5 remaining", d)
				}
			}
			if _, d := l.Take(st, now, 5); !d.Allowed {
				t.Errorf("after cost-0 checks the full limit is refused: %+v", d)
			}
		})
	}
}

func TestLeakyBucketWhenBurstArrivesThenDeparturesAreSpacedAndQueueBounded(t *testing.T) {
	// 10 per second: one departure every 100ms, at most 3 units in the queue.
	l := algorithm.Limit{Kind: algorithm.LeakyBucket, Limit: 3, Rate: 10, Period: time.Second, MaxWait: time.Second}
	ds := run(t, l, []step{
		{0, 1, true, 2}, {0, 1, true, 1}, {0, 1, true, 0},
		{0, 1, false, 0}, // the queue is full
		{100 * time.Millisecond, 1, true, 0},
	})
	for i, want := range []time.Duration{0, 100 * time.Millisecond, 200 * time.Millisecond} {
		if ds[i].Wait != want {
			t.Errorf("request %d waits %v, want %v", i, ds[i].Wait, want)
		}
	}
	if ds[3].RetryAfter != 100*time.Millisecond {
		t.Errorf("retry-after when full = %v, want 100ms", ds[3].RetryAfter)
	}
	if ds[4].Wait != 200*time.Millisecond {
		t.Errorf("request after one departure waits %v, want 200ms", ds[4].Wait)
	}
}

func TestLeakyBucketWhenWaitWouldExceedMaxWaitThenRefused(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.LeakyBucket, Limit: 10, Rate: 10, Period: time.Second, MaxWait: 150 * time.Millisecond}
	// Waits 0 and 100ms fit; the third would wait 200ms, so it is refused until the queue ahead
	// of it is down to 150ms, 50ms later.
	ds := run(t, l, []step{{0, 1, true, 9}, {0, 1, true, 8}, {0, 1, false, 8}, {50 * time.Millisecond, 1, true, 7}})
	if ds[2].RetryAfter != 50*time.Millisecond {
		t.Errorf("retry-after = %v, want 50ms", ds[2].RetryAfter)
	}
	if ds[3].Wait != 150*time.Millisecond {
		t.Errorf("wait at retry-after = %v, want maxWait 150ms", ds[3].Wait)
	}
}

// The fixed window's documented weakness: limit units at the end of one window and limit more at
// the start of the next pass within a millisecond.
func TestFixedWindowWhenBurstStraddlesBoundaryThenTwiceTheLimitPasses(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Second}
	var st algorithm.State
	passed := 0
	for _, at := range []time.Duration{999 * time.Millisecond, time.Second} {
		for range 15 {
			var d algorithm.Decision
			next, d := l.Take(st, t0.Add(at), 1)
			if d.Allowed {
				st = next
				passed++
			}
		}
	}
	if passed != 20 {
		t.Errorf("passed %d within 1ms around the boundary, want 20 (2 x limit)", passed)
	}
}

func TestSlidingWindowCounterWhenHalfwayThenPreviousWindowWeighsHalf(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.SlidingWindowCounter, Limit: 100, Period: time.Minute}
	// 80 in the previous window, 40 in the current one, seen at half of the current window:
	// 80 x 0.5 + 40 = 80, so exactly 20 more pass.
	window := time.Minute.Microseconds()
	idx := t0.UnixMicro() / window
	st := algorithm.State{W: float64(idx), N: 40, P: 80}
	start := time.UnixMicro(idx * window)
	now := start.Add(30 * time.Second)
	_, d := l.Take(st, now, 0)
	if d.Remaining != 20 {
		t.Fatalf("remaining at half the window = %d, want 20 (100 - 80)", d.Remaining)
	}
	passed := 0
	for range 30 {
		next, d := l.Take(st, now, 1)
		if d.Allowed {
			st = next
			passed++
		}
	}
	if passed != 20 {
		t.Errorf("passed %d, want 20", passed)
	}
}

func TestSlidingLogWhenWindowSlidesThenOldestEntriesFreeCapacityExactly(t *testing.T) {
	l := algorithm.Limit{Kind: algorithm.SlidingLog, Limit: 3, Period: 10 * time.Second}
	ds := run(t, l, []step{
		{0, 1, true, 2}, {2 * time.Second, 1, true, 1}, {4 * time.Second, 1, true, 0},
		{9 * time.Second, 1, false, 0},
		{10 * time.Second, 1, true, 0}, // the entry at 0 left the window
		{11 * time.Second, 1, false, 0},
	})
	if ds[3].RetryAfter != time.Second {
		t.Errorf("retry-after = %v, want 1s (the entry at 0 leaves at 10s)", ds[3].RetryAfter)
	}
}

func allKinds(limit int64, period time.Duration) []algorithm.Limit {
	return []algorithm.Limit{
		{Kind: algorithm.TokenBucket, Limit: limit, Rate: limit, Period: period},
		{Kind: algorithm.LeakyBucket, Limit: limit, Rate: limit, Period: period, MaxWait: period},
		{Kind: algorithm.FixedWindow, Limit: limit, Period: period},
		{Kind: algorithm.SlidingLog, Limit: limit, Period: period},
		{Kind: algorithm.SlidingWindowCounter, Limit: limit, Period: period},
	}
}

// withConcurrency adds a concurrency limit of the same limit, whose leases last the period, to
// the rate algorithms: the tests that hold for every algorithm but Retry-After's, which a
// concurrency limit does not promise.
func withConcurrency(kinds []algorithm.Limit) []algorithm.Limit {
	return append(kinds, algorithm.Limit{Kind: algorithm.Concurrency, Limit: kinds[0].Limit, Period: kinds[0].Period})
}

// Retry-after honesty: a refused request, repeated retry-after later with nothing else arriving,
// passes. Random traffic, every algorithm.
func TestEveryAlgorithmWhenRefusedThenSameRequestPassesAtRetryAfter(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, l := range allKinds(7, 3*time.Second) {
		t.Run(l.Kind.String(), func(t *testing.T) {
			var st algorithm.State
			now := t0
			refusals := 0
			for i := range 5000 {
				now = now.Add(time.Duration(rng.IntN(400_000)) * time.Microsecond)
				cost := int64(1 + rng.IntN(3))
				next, d := l.Take(st, now, cost)
				if d.Allowed {
					st = next
					continue
				}
				refusals++
				if d.RetryAfter <= 0 {
					t.Fatalf("step %d: refused with retry-after %v", i, d.RetryAfter)
				}
				if _, again := l.Take(st, now.Add(d.RetryAfter), cost); !again.Allowed {
					t.Fatalf("step %d: refused at %v with retry-after %v, still refused then: %+v", i, now, d.RetryAfter, again)
				}
			}
			if refusals < 100 {
				t.Fatalf("only %d refusals: the traffic does not exercise the limit", refusals)
			}
		})
	}
}

// Reset honesty: at now + reset the state is idle, so the full limit passes at once.
func TestEveryAlgorithmWhenResetPassesThenTheFullLimitIsAvailable(t *testing.T) {
	for _, l := range withConcurrency(allKinds(4, time.Second)) {
		t.Run(l.Kind.String(), func(t *testing.T) {
			var st algorithm.State
			now := t0.Add(123 * time.Millisecond)
			var d algorithm.Decision
			for range 3 {
				st, d = l.Take(st, now, 1)
			}
			_, after := l.Take(st, now.Add(d.Reset), 0)
			if after.Remaining != 4 {
				t.Errorf("at reset (%v) remaining = %d, want 4", d.Reset, after.Remaining)
			}
		})
	}
}

func TestLayoutWhenTheStateWouldReadDifferentlyThenTheLayoutDiffers(t *testing.T) {
	tb := algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 10, Rate: 1, Period: time.Second}
	fw := algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Hour}
	cases := []struct {
		name string
		a, b algorithm.Limit
		same bool
	}{
		{"when a bucket's capacity and rate change then its state still reads the same", tb,
			algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 99, Rate: 7, Period: time.Minute}, true},
		{"when a window's limit changes then its state still reads the same", fw,
			algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 99, Period: time.Hour}, true},
		{"when a window's length changes then its stored index means another window", fw,
			algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Minute}, false},
		{"when a counter's window length changes then its stored index means another window",
			algorithm.Limit{Kind: algorithm.SlidingWindowCounter, Limit: 10, Period: time.Hour},
			algorithm.Limit{Kind: algorithm.SlidingWindowCounter, Limit: 10, Period: time.Minute}, false},
	}
	for _, c := range cases {
		if got := c.a.Layout() == c.b.Layout(); got != c.same {
			t.Errorf("%s: layouts %q and %q, same = %v", c.name, c.a.Layout(), c.b.Layout(), got)
		}
	}
	seen := map[string]algorithm.Kind{}
	for k := algorithm.TokenBucket; k <= algorithm.Concurrency; k++ {
		l := algorithm.Limit{Kind: k, Limit: 10, Rate: 1, Period: time.Hour}.Layout()
		if other, ok := seen[l]; ok {
			t.Errorf("%v and %v share the layout %q", k, other, l)
		}
		seen[l] = k
	}
}

// A cost above the limit can never pass: refused at once, with no Retry-After that would promise
// otherwise, on every algorithm, whatever the state; the state is left as a cost-0 check leaves it.
func TestEveryAlgorithmWhenCostExceedsTheLimitThenRefusedAsNever(t *testing.T) {
	for _, l := range withConcurrency(allKinds(5, time.Minute)) {
		for _, cost := range []int64{6, 1000, math.MaxInt64, -1, math.MinInt64} {
			var st algorithm.State
			now := t0
			st, _ = l.Take(st, now, 2)
			next, d := l.Take(st, now, cost)
			want := algorithm.Decision{Limit: 5, Remaining: 3, Reset: d.Reset, Never: true}
			if d != want || d.Reset <= 0 {
				t.Errorf("%v cost %d: %+v, want %+v", l.Kind, cost, d, want)
			}
			if _, again := l.Take(next, now, 3); !again.Allowed {
				t.Errorf("%v cost %d charged something: a cost of 3 is then refused", l.Kind, cost)
			}
		}
	}
}
