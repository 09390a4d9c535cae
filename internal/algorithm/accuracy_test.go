package algorithm

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// The accuracy benchmark feeds the same request streams to the sliding window counter (SWC), to
// the fixed window and to the exact limiter, the sliding log (admit while fewer than the limit
// were admitted in the last window), in simulated time with a fixed seed, and reports:
//   - the SWC's estimate error: its estimate before each request against the units it really
//     admitted in the window-long interval that ends there, as a share of the latter (mean, p99);
//   - the share of the SWC's decisions that the exact rule would have taken otherwise, given the
//     requests the SWC had admitted: wrongly allowed (the limit was already admitted in the last
//     window) and wrongly refused (it was not);
//   - the most any limiter admitted to one client in any window-long interval, as a multiple of
//     the limit.
//
// It prints its figures with go test ./internal/algorithm -run '^$' -bench Accuracy -v.
func BenchmarkSlidingWindowCounterAccuracy(b *testing.B) {
	shapes := trafficShapes(accLimit)
	// Smooth traffic at smaller limits, where a unit of estimate error is a larger share.
	for _, limit := range []int64{1, 2, 5, 10, 20, 50} {
		smooth := trafficShapes(limit)[0]
		smooth.name = fmt.Sprintf("smooth-limit-%d", limit)
		shapes = append(shapes, smooth)
	}
	for _, shape := range shapes {
		b.Run(shape.name, func(b *testing.B) {
			var a accuracy
			for range b.N {
				a = measureAccuracy(shape.arrivals(rand.New(rand.NewPCG(1, 2))), shape.limit)
			}
			b.ReportMetric(a.estErrMean, "est-err-mean-%")
			b.ReportMetric(a.estErrP99, "est-err-p99-%")
			b.ReportMetric(a.wronglyAllowed, "wrongly-allowed-%")
			b.ReportMetric(a.wronglyRefused, "wrongly-refused-%")
			b.ReportMetric(a.maxSWC, "max-swc-x")
			b.ReportMetric(a.maxFixed, "max-fixed-x")
			b.ReportMetric(a.maxExact, "max-exact-x")
			b.Logf("%s: %d requests; estimate error mean %.2f%%, p99 %.1f%%; decisions differing from the exact limiter %.3f%% "+
				"(wrongly allowed %.3f%%, wrongly refused %.3f%%); most admitted in any window / limit: SWC %.2f, fixed window %.2f, exact %.2f",
				shape.name, a.requests, a.estErrMean, a.estErrP99, a.wronglyAllowed+a.wronglyRefused, a.wronglyAllowed, a.wronglyRefused,
				a.maxSWC, a.maxFixed, a.maxExact)
		})
	}
}

// The benchmark's limit: 100 requests per 60 s, and smaller limits for smooth traffic.
const (
	accLimit  = 100
	accPeriod = 60 * time.Second
	accLength = 20 * time.Minute
)

type arrival struct {
	at     float64 // µs
	client int
}

type trafficShape struct {
	name     string
	limit    int64
	arrivals func(r *rand.Rand) []arrival
}

// trafficShapes are the streams: smooth Poisson clients from a tenth of the limit's rate to ten
// times it; clients that burst at three times the rate for 10 s and then go idle; and clients
// that time their bursts at a window's end: twice the limit in the last 10 ms of one window, and
// again half a second before the end of the next, whose weight of the previous window is then
// all but gone; then they rest a window.
func trafficShapes(limit int64) []trafficShape {
	rate := float64(limit) / accPeriod.Seconds() // requests per second at the limit
	start := 1_700_000_000.0                     // seconds: a window-aligned epoch, as Redis TIME gives
	start = math.Floor(start/accPeriod.Seconds()) * accPeriod.Seconds()
	end := start + accLength.Seconds()
	us := func(s float64) float64 { return math.Round(s * 1e6) }
	return []trafficShape{
		{"smooth", limit, func(r *rand.Rand) []arrival {
			var out []arrival
			for c := range 200 {
				lambda := rate * math.Pow(10, r.Float64()*2-1)
				for t := start + r.ExpFloat64()/lambda; t < end; t += r.ExpFloat64() / lambda {
					out = append(out, arrival{us(t), c})
				}
			}
			return sorted(out)
		}},
		{"bursty", limit, func(r *rand.Rand) []arrival {
			var out []arrival
			for c := range 200 {
				t := start + r.Float64()*100
				for t < end {
					burstEnd := t + 10
					for ; t < burstEnd && t < end; t += r.ExpFloat64() / (3 * rate) {
						out = append(out, arrival{us(t), c})
					}
					t = burstEnd + 10 + r.Float64()*100
				}
			}
			return sorted(out)
		}},
		{"boundary", limit, func(r *rand.Rand) []arrival {
			var out []arrival
			for c := range 50 {
				for w := start + accPeriod.Seconds(); w+accPeriod.Seconds() < end; w += 3 * accPeriod.Seconds() {
					for i := range 2 * limit {
						spread := 0.01 * float64(i) / float64(2*limit)
						out = append(out, arrival{us(w - 0.01 + spread + r.Float64()*1e-5), c},
							arrival{us(w + accPeriod.Seconds() - 0.5 + spread + r.Float64()*1e-5), c})
					}
				}
			}
			return sorted(out)
		}},
	}
}

func sorted(a []arrival) []arrival {
	slices.SortFunc(a, func(x, y arrival) int { return int(x.at - y.at) })
	return a
}

type accuracy struct {
	requests                       int
	estErrMean, estErrP99          float64
	wronglyAllowed, wronglyRefused float64
	maxSWC, maxFixed, maxExact     float64
}

// admitted keeps one client's admission times within the last window, and the most it held.
type admitted struct {
	times []float64
	most  int
}

func (a *admitted) add(t, window float64) {
	a.times = append(a.times, t)
	a.trim(t, window)
	a.most = max(a.most, len(a.times))
}

// count is how many admissions fall in (t-window, t].
func (a *admitted) count(t, window float64) int {
	a.trim(t, window)
	return len(a.times)
}

func (a *admitted) trim(t, window float64) {
	i := 0
	for i < len(a.times) && a.times[i] <= t-window {
		i++
	}
	a.times = a.times[i:]
}

func measureAccuracy(arrivals []arrival, limit int64) accuracy {
	swc := Limit{Kind: SlidingWindowCounter, Limit: limit, Period: accPeriod}
	fixed := Limit{Kind: FixedWindow, Limit: limit, Period: accPeriod}
	exact := Limit{Kind: SlidingLog, Limit: limit, Period: accPeriod}
	window := micros(accPeriod)
	type client struct {
		swc, fixed, exact       State
		bySWC, byFixed, byExact admitted
	}
	clients := map[int]*client{}
	var errs []float64
	var wrongAllow, wrongRefuse int
	for _, a := range arrivals {
		c := clients[a.client]
		if c == nil {
			c = &client{}
			clients[a.client] = c
		}
		truth := c.bySWC.count(a.at, window)
		if truth > 0 {
			_, _, _, _, _, est := swc.windowEstimate(&c.swc, a.at)
			errs = append(errs, math.Abs(est-float64(truth))/float64(truth)*100)
		}
		var dS, dF, dE Decision
		c.swc, dS = swc.Take(c.swc, time.UnixMicro(int64(a.at)), 1)
		c.fixed, dF = fixed.Take(c.fixed, time.UnixMicro(int64(a.at)), 1)
		c.exact, dE = exact.Take(c.exact, time.UnixMicro(int64(a.at)), 1)
		if dS.Allowed {
			c.bySWC.add(a.at, window)
		}
		if dF.Allowed {
			c.byFixed.add(a.at, window)
		}
		if dE.Allowed {
			c.byExact.add(a.at, window)
		}
		switch exactAllows := int64(truth) < limit; {
		case dS.Allowed && !exactAllows:
			wrongAllow++
		case !dS.Allowed && exactAllows:
			wrongRefuse++
		}
	}
	res := accuracy{requests: len(arrivals)}
	for _, c := range clients {
		res.maxSWC = max(res.maxSWC, float64(c.bySWC.most)/float64(limit))
		res.maxFixed = max(res.maxFixed, float64(c.byFixed.most)/float64(limit))
		res.maxExact = max(res.maxExact, float64(c.byExact.most)/float64(limit))
	}
	slices.Sort(errs)
	var sum float64
	for _, e := range errs {
		sum += e
	}
	if len(errs) > 0 {
		res.estErrMean = sum / float64(len(errs))
		res.estErrP99 = errs[len(errs)*99/100]
	}
	n := float64(len(arrivals))
	res.wronglyAllowed, res.wronglyRefused = float64(wrongAllow)/n*100, float64(wrongRefuse)/n*100
	return res
}
