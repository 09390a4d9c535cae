package algorithm_test

import (
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/algorithm"
)

// FuzzTakeWhenAnyLimitCostAndClockThenNeverPanicsNorAdmitsMoreThanTheLimit drives one algorithm
// with any parameters the fuzzer picks (limits and rates up to 2^62, periods of a microsecond to
// a century, costs of any int64, clocks that jump or stand still) and checks, beside that
// nothing panics:
//   - a cost above the limit or below zero is refused as never passing, and nothing else is;
//   - remaining is within [0, limit], and a refusal's retry-after and every reset are not
//     negative;
//   - no window ever admits more than the limit: a sliding log's window-long intervals, a fixed
//     window's or a sliding window counter's own window; and a bucket never more than its
//     capacity plus what it refilled since the first admission; a concurrency limit never holds
//     more slots than its limit in leases that have not expired, whatever is released;
//   - a post-response charge (Charge, a quarter of the steps of the rate algorithms but the
//     leaky bucket, which the schema keeps from it, for limits up to 2^40, as a charge may be
//     the whole limit) never refuses, counts in the limits above as an admission, and a cost of
//     at least what was left leaves nothing.
func FuzzTakeWhenAnyLimitCostAndClockThenNeverPanicsNorAdmitsMoreThanTheLimit(f *testing.F) {
	f.Add(uint8(4), int64(5), int64(1), int64(60_000_000), int64(0), []byte{1, 0, 5, 0, 6, 1, 200, 3})
	f.Add(uint8(1), int64(10), int64(3), int64(1_000_000), int64(0), []byte{0, 0, 10, 9, 255, 1, 2, 3, 4})
	f.Add(uint8(2), int64(4), int64(2), int64(500_000), int64(300_000), []byte{0, 0, 2, 2, 2, 2, 9, 9})
	f.Add(uint8(5), int64(100), int64(1), int64(3_600_000_000), int64(0), []byte{7, 7, 7, 7, 7, 7, 100, 100})
	f.Add(uint8(3), int64(math.MaxInt64/2), int64(1), int64(1), int64(0), []byte{255, 255, 255, 255})
	f.Add(uint8(5), int64(3), int64(1), int64(10_000_000), int64(0), []byte{0, 1, 0, 1, 0, 1, 0, 1, 2, 0, 0, 1, 200, 1, 0, 1})
	f.Add(uint8(2), int64(1000), int64(1), int64(3_600_000_000), int64(0), []byte{3, 150, 3, 150, 7, 190, 0, 1, 3, 199, 0, 1})
	f.Fuzz(func(t *testing.T, kind uint8, limit, rate, periodUs, maxWaitUs int64, steps []byte) {
		l := algorithm.Limit{Kind: algorithm.Kind(1 + kind%6), Limit: 1 + abs(limit)%(1<<62), Rate: 1 + abs(rate)%(1<<62)}
		l.Period = time.Duration(1+abs(periodUs)%(100*365*24*3600*1_000_000)) * time.Microsecond
		l.MaxWait = time.Duration(abs(maxWaitUs)%(100*365*24*3600*1_000_000)) * time.Microsecond
		window := float64(l.Period.Microseconds())

		var st algorithm.State
		now := float64(1_700_000_000_000_000)
		var admitted []algorithm.LogEntry // every admission, for the oracles
		first := 0.0
		for i := 0; i+1 < len(steps); i += 2 {
			now = math.Floor(now + float64(steps[i])*float64(steps[i])*window/1024) // often 0, up to 64 windows; whole µs
			var cost int64
			switch c := steps[i+1]; {
			case c < 200:
				cost = int64(c) % (min(l.Limit, 200) + 1)
			case c < 240:
				cost = l.Limit + int64(c-199)
				if cost < 0 {
					cost = math.MaxInt64
				}
			case c < 250:
				cost = math.MaxInt64
			default:
				cost = -int64(c)
			}
			at := time.UnixMicro(int64(now))
			if l.Kind == algorithm.Concurrency && steps[i]%4 == 2 && len(st.Leases) > 0 {
				// The oldest lease's request ends.
				st, _ = l.Release(st, at, st.Leases[0].ID, st.Leases[0].Units)
				continue
			}
			if l.Kind != algorithm.Concurrency && l.Kind != algorithm.LeakyBucket && l.Limit <= 1<<40 && steps[i]%4 == 3 {
				_, before := l.Take(st, at, 0)
				next, d := l.Charge(st, at, cost)
				if !d.Allowed || d.Never || d.Remaining < 0 || d.Remaining > l.Limit {
					t.Fatalf("step %d, %+v charged %d after the response: %+v", i/2, l, cost, d)
				}
				if cost >= before.Remaining && d.Remaining != 0 {
					t.Fatalf("step %d, %+v: a charge of %d over the %d left left %d", i/2, l, cost, before.Remaining, d.Remaining)
				}
				st = next
				if cost = min(max(cost, 0), before.Remaining); cost == 0 {
					continue
				}
			} else {
				next, d := l.TakeAs(st, at, cost, strconv.Itoa(i))
				never := cost < 0 || cost > l.Limit
				if d.Never != never || d.Never && (d.Allowed || d.RetryAfter != 0) {
					t.Fatalf("step %d, %+v cost %d: %+v", i/2, l, cost, d)
				}
				if d.Remaining < 0 || d.Remaining > l.Limit || d.RetryAfter < 0 || d.Reset < 0 || d.Wait < 0 {
					t.Fatalf("step %d, %+v cost %d: %+v out of range", i/2, l, cost, d)
				}
				if !d.Allowed || cost == 0 {
					continue
				}
				st = next
			}
			if len(admitted) == 0 {
				first = now
			}
			admitted = append(admitted, algorithm.LogEntry{At: now, Units: cost})
			if l.Limit > 1<<40 {
				continue // beyond exact float64 sums of units
			}
			var units float64
			switch l.Kind {
			case algorithm.SlidingLog:
				for _, e := range admitted {
					if e.At > now-window {
						units += float64(e.Units)
					}
				}
			case algorithm.FixedWindow, algorithm.SlidingWindowCounter:
				for _, e := range admitted {
					if math.Floor(e.At/window) == math.Floor(now/window) {
						units += float64(e.Units)
					}
				}
			case algorithm.Concurrency:
				for _, e := range st.Leases {
					if e.Expiry > now {
						units += float64(e.Units)
					}
				}
			case algorithm.TokenBucket, algorithm.LeakyBucket:
				for _, e := range admitted {
					units += float64(e.Units)
				}
				// What refilled since the first admission and the microsecond of slack a bucket
				// grants (see slackMicros), both at the rule's rate, and a millionth of a unit for
				// the float rounding of the oracle's own sums.
				units -= (now-first+1)*float64(l.Rate)/window + 1e-6
			}
			if units > float64(l.Limit) {
				t.Fatalf("step %d, %+v: %v units admitted where the limit allows %d", i/2, l, units, l.Limit)
			}
		}
	})
}

func abs(x int64) int64 {
	if x < 0 {
		if x == math.MinInt64 {
			return math.MaxInt64
		}
		return -x
	}
	return x
}
