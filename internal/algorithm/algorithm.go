// Package algorithm holds the six limit algorithms as pure functions of
// (state, now, limit, cost) -> (state, Decision): five rates and a concurrency limit. Time is an
// argument, never read here.
//
// The API takes a time.Time. Inside, and in State, times are microseconds since the Unix epoch
// held in float64, the number type of Redis Lua: the Redis store runs the same arithmetic,
// operation for operation, in scripts/decide.lua, so that both stores reach identical
// decisions. Microsecond timestamps stay below 2^53, where float64 integers are exact.
package algorithm

import (
	"math"
	"strconv"
	"time"
)

// Kind names an algorithm.
type Kind uint8

// The algorithms. The numbers are part of the Lua script's calling convention.
const (
	TokenBucket Kind = iota + 1
	LeakyBucket
	FixedWindow
	SlidingLog
	SlidingWindowCounter
	// Concurrency counts requests in flight rather than requests over time: each admitted
	// request holds a lease on Limit slots' worth of its cost until it is released, or until
	// its lease, renewed while the request lasts, expires Period after its last renewal.
	Concurrency
)

var kindNames = [...]string{"", "token_bucket", "leaky_bucket", "fixed_window", "sliding_log", "sliding_window_counter", "concurrency"}

// String is the snake_case name used in metric labels and Lua.
func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "unknown"
}

// Limit is one rule's algorithm and parameters.
type Limit struct {
	Kind Kind
	// Limit is the bucket capacity (token and leaky bucket), the units per window, or the slots
	// of a concurrency limit.
	Limit int64
	// Rate is the tokens (token bucket) or requests (leaky bucket) added or drained per Period.
	Rate int64
	// Period is the refill or drain period, the window length, or a concurrency limit's lease
	// timeout.
	Period time.Duration
	// MaxWait is the longest a leaky-bucket request may be held.
	MaxWait time.Duration
}

// State is one key's state. Which fields mean what depends on the Kind:
//   - token bucket: T is the theoretical arrival time (the moment the bucket is full again);
//   - leaky bucket: T is the next free departure time;
//   - fixed window: W is the window index, N the units counted in it;
//   - sliding window counter: W is the window index, N the current and P the previous count;
//   - sliding log: Log holds the admitted requests, oldest first: when each was admitted and
//     how many units it took. One entry per request, never one per unit, so a key holds at
//     most Limit entries and a request of any cost adds one.
//   - concurrency: Leases holds the requests in flight, in the order they were admitted.
//
// The zero State is an idle key.
type State struct {
	T, W, N, P float64
	Log        []LogEntry
	Leases     []Lease
}

// Lease is one request in flight under a concurrency limit: the ID of its request, when the
// lease expires unless renewed, in microseconds, and the slots it holds (its cost).
type Lease struct {
	ID     string
	Expiry float64
	Units  int64
}

// LeaseSize is the bytes one Lease takes, its ID's bytes included for IDs of up to 24 bytes (the
// limiter's are), for stores that bound their memory.
const LeaseSize = 56

// LogEntry is one admitted request of a sliding log: its admission time, in microseconds, and
// its units.
type LogEntry struct {
	At    float64
	Units int64
}

// LogEntrySize is the bytes one LogEntry takes, for stores that bound their memory.
const LogEntrySize = 16

// Decision is the outcome of one rule for one request.
type Decision struct {
	// Allowed is whether the rule admits the request.
	Allowed bool
	// Limit is the rule's capacity or limit.
	Limit int64
	// Remaining is how many units the rule would still admit now, after this request.
	Remaining int64
	// Reset is how long until the rule's state is back to idle (a full bucket, an empty window;
	// for a concurrency limit, the last lease's expiry, were no lease renewed or released).
	Reset time.Duration
	// RetryAfter is, for a refusal, how long until the same request would pass if nothing else
	// arrives. It is 0 for a concurrency limit: a slot frees when a request in flight ends,
	// which no clock says.
	RetryAfter time.Duration
	// Wait is, for an admitted leaky-bucket request, how long to hold it before forwarding.
	Wait time.Duration
	// Never is, for a refusal, that the same request can never pass: its cost exceeds the
	// rule's capacity or limit (or is negative). RetryAfter is then 0: no wait would help, and
	// nothing may promise otherwise. Remaining and Reset are what a cost-0 check sees.
	Never bool
}

// Layout names how a key's stored state is to be read: the algorithm and, for the window
// algorithms, the window length that their stored window index counts in. Stores put it in
// every key, so a rule whose algorithm or window changes under the same name starts from fresh
// state instead of misreading the old one (a sorted set read as a bucket is an error in Redis, a
// window index of another length a wrong count). Parameters that do not change how the state
// reads, such as a capacity or a refill rate, are left out: raising a limit keeps the counters.
func (l Limit) Layout() string {
	switch l.Kind {
	case FixedWindow, SlidingWindowCounter:
		return l.Kind.letter() + strconv.FormatInt(l.Period.Milliseconds(), 36)
	case SlidingLog:
		// "2": one entry per request with its units (the first layout kept one per unit).
		return l.Kind.letter() + "2"
	}
	return l.Kind.letter()
}

// letter is the kind's one-letter tag in Layout.
func (k Kind) letter() string { return string("?tlfscn"[min(int(k), 6)]) }

// Horizon is how long the rule remembers, the time its quota refers to: the window, the time an
// empty bucket takes to fill (a full queue to drain), or a concurrency limit's lease timeout.
func (l Limit) Horizon() time.Duration {
	switch l.Kind {
	case TokenBucket, LeakyBucket:
		return time.Duration(float64(l.Period) * float64(l.Limit) / float64(l.Rate))
	}
	return l.Period
}

// Micros converts a time to microseconds since the epoch, the unit of State and of the Lua
// script's arguments.
func Micros(t time.Time) float64 { return float64(t.UnixMicro()) }

// Take decides a request of cost units at now. It returns the new state, which the caller
// stores only if the request is charged. Cost 0 checks without charging: the returned state
// equals st. Now counts in whole microseconds, as Redis TIME does.
//
// A cost above the rule's limit, or below zero, is refused at once with Never set: whatever
// multiplied it (RLS hits_addend times the rule's cost), no state could ever admit it. Every
// other cost is at most the limit, so the arithmetic below stays within it.
func (l Limit) Take(st State, now time.Time, cost int64) (State, Decision) {
	return l.TakeAs(st, now, cost, "")
}

// TakeAs is Take for the request named lease: under a concurrency limit, the lease it is admitted
// with carries that ID, by which Release and Renew find it. Other limits ignore it.
func (l Limit) TakeAs(st State, now time.Time, cost int64, lease string) (State, Decision) {
	var d Decision
	l.TakeIn(&st, now, cost, lease, &d)
	return st, d
}

// TakeIn is TakeAs in place, for a hot path that copies nothing: st becomes the state after the
// request, which the caller stores only if the request is charged, and d its decision. A caller
// that keeps a copy of st from before may: a sliding log or a concurrency limit only appends to
// st's slices, which never changes the elements the copy sees.
func (l *Limit) TakeIn(st *State, now time.Time, cost int64, lease string, d *Decision) {
	us := Micros(now)
	if cost < 0 || cost > l.Limit {
		l.step(st, us, 0, "", d)
		d.Allowed, d.Never, d.RetryAfter, d.Wait = false, true, 0, 0
		return
	}
	l.step(st, us, cost, lease, d)
}

// Charge charges a request's cost once its response is known (a rule charged by the response):
// it never refuses, and takes at most what the rule has left now, so a cost larger than that
// takes the rule to exhaustion (Remaining 0) and no further. A negative cost charges nothing.
// The decision is that of the units charged; Allowed is false only where the rule refuses even
// what it has left, which a leaky bucket's maxWait may (the schema keeps leaky buckets from
// being charged by the response). Charging nothing always passes: a token bucket that an
// admission at its bound filled a float step past it (later rounds against the client) refuses
// even a cost of 0, by that step, and there is nothing to refuse.
func (l Limit) Charge(st State, now time.Time, cost int64) (State, Decision) {
	us := Micros(now)
	_, left := l.take(st, us, 0)
	units := min(max(cost, 0), left.Remaining)
	next, d := l.take(st, us, units)
	if units == 0 {
		d.Allowed, d.RetryAfter = true, 0
	}
	return next, d
}

// Release ends the lease of the request named lease that holds units slots of a concurrency
// limit, and drops the leases that expired. It returns the state and what a cost-0 check sees.
// A lease that expired already, or was never admitted, releases nothing.
func (l Limit) Release(st State, now time.Time, lease string, units int64) (State, Decision) {
	us := Micros(now)
	st = l.dropExpired(st, us)
	for i, e := range st.Leases {
		if e.ID == lease && e.Units == units {
			st.Leases = append(append(make([]Lease, 0, len(st.Leases)-1), st.Leases[:i]...), st.Leases[i+1:]...)
			break
		}
	}
	return l.take(st, us, 0)
}

// Renew extends the lease of the request named lease that holds units slots of a concurrency
// limit to Period from now, if it has not expired, and drops the leases that expired. A lease
// that expired is not brought back: its slot may be another request's by now.
func (l Limit) Renew(st State, now time.Time, lease string, units int64) (State, Decision) {
	us := Micros(now)
	st = l.dropExpired(st, us)
	for i, e := range st.Leases {
		if e.ID == lease && e.Units == units {
			st.Leases = append([]Lease(nil), st.Leases...)
			st.Leases[i].Expiry = us + micros(l.Period)
			break
		}
	}
	return l.take(st, us, 0)
}

// dropExpired returns st without the leases that expired at or before now, in a new slice when
// any did: the caller's state is never changed.
func (l Limit) dropExpired(st State, now float64) State {
	for i, e := range st.Leases {
		if e.Expiry > now {
			continue
		}
		live := append(make([]Lease, 0, len(st.Leases)-1), st.Leases[:i]...)
		for _, e := range st.Leases[i+1:] {
			if e.Expiry > now {
				live = append(live, e)
			}
		}
		st.Leases = live
		return st
	}
	return st
}

// take is step by value, for the callers that take no lease.
func (l Limit) take(st State, now float64, cost int64) (State, Decision) {
	var d Decision
	l.step(&st, now, cost, "", &d)
	return st, d
}

// step is take in place: st becomes the next state, d the decision. The algorithms work on
// pointers so that a decision copies no state or decision on its way (the memory store's hot
// path spent a third of its time copying them between the layers).
func (l *Limit) step(st *State, now float64, cost int64, lease string, d *Decision) {
	switch l.Kind {
	case TokenBucket:
		l.tokenBucket(st, now, cost, d)
	case LeakyBucket:
		l.leakyBucket(st, now, cost, d)
	case FixedWindow:
		l.fixedWindow(st, now, cost, d)
	case SlidingLog:
		l.slidingLog(st, now, cost, d)
	case SlidingWindowCounter:
		l.slidingWindowCounter(st, now, cost, d)
	case Concurrency:
		l.concurrency(st, now, cost, lease, d)
	default:
		*d = Decision{}
	}
}

// windowEstimate reads a sliding window counter's state at now: the window length, the current
// window's index and start, its count, the previous window's count, and the estimate of the units
// in the window-long interval that ends at now: the current count, plus the previous window's
// count weighted by the share of it still inside that interval.
//
// Once that weighted part is worth half a unit or less, it counts as none. Without this, a
// client that keeps sending is admitted one below its limit in every window, and a limit of 1
// admits once every other window: the weight reaches zero only at the boundary itself, so the
// last unit of a window never fits. Half a unit lets it in for a client that sends at twice the
// limit's rate or faster, and grows no worst case of the accuracy benchmark; a larger share
// would let a burst timed just before the boundary through earlier (docs/benchmarks.md).
func (l *Limit) windowEstimate(st *State, now float64) (window, idx, start, cur, prev, est float64) {
	window = micros(l.Period)
	idx = math.Floor(now / window)
	start = idx * window
	switch st.W {
	case idx:
		cur, prev = st.N, st.P
	case idx - 1:
		prev = st.N
	}
	weighted := float64(prev * (window - (now - start)) / window)
	if weighted <= lastShare+slackUnits {
		weighted = 0
	}
	return window, idx, start, cur, prev, weighted + cur
}

// lastShare is the weighted part of the previous window below which it counts as none.
const lastShare = 0.5

// slack absorbs float rounding in comparisons, so that a request repeated exactly at its
// retry-after passes: a bucket admits a request that fits to within a microsecond (timestamps
// near 2^51µs resolve only to 0.25µs), a window counter one that fits to within a billionth of a
// unit. The Lua script uses the same values.
const (
	slackMicros = 1.0
	slackUnits  = 1e-9
)

// later is t + d for a bucket's time t and a span d >= 0, rounded up rather than to the nearest
// float. Near today's epoch a microsecond timestamp resolves only to 0.25µs, and a sum rounded
// down gives the client that part of an interval for free: at a fixed rate the rounding falls
// the same way every time, so a client that keeps its bucket empty gains a unit every few
// thousand requests (1000/3 µs per unit loses 0.083µs each). Rounded up, the error is at most
// one float step per admission, and against the client.
func later(t, d float64) float64 {
	s := t + d
	if s-t < d { // s-t is exact: s is within a factor 2 of t for any d below t
		s = math.Nextafter(s, math.Inf(1))
	}
	return s
}

func micros(d time.Duration) float64 { return float64(d.Microseconds()) }

// fmax and fmin compare as Lua's math.max and math.min do, which the Redis script uses; unlike
// math.Max they need no NaN or signed-zero handling (no state or time is NaN), and they inline.
func fmax(a, b float64) float64 {
	if a > b {
		return a
	}
	return b
}

func fmin(a, b float64) float64 {
	if a < b {
		return a
	}
	return b
}

// remaining is the whole units of a float count of them, within [0, limit]: float64 rounds a
// limit beyond 2^53 (the schema allows 10^9; the fuzz target goes to 2^62), and a count may
// round past it.
func remaining(limit int64, units float64) int64 {
	if r := fmax(0, math.Floor(units)); r < float64(limit) {
		return int64(r)
	}
	return limit
}

// dur turns a non-negative span of microseconds into a duration, rounded up so that a client
// that waits it is never early.
func dur(us float64) time.Duration {
	if us <= 0 {
		return 0
	}
	return time.Duration(math.Ceil(us)) * time.Microsecond
}

// tokenBucket is GCRA: a bucket of Limit tokens refilled at Rate per Period is the same as a
// theoretical arrival time T that each token pushes forward by one interval, and that may run at
// most Limit intervals ahead of now. Refill is lazy: nothing happens between requests.
func (l *Limit) tokenBucket(st *State, now float64, cost int64, d *Decision) {
	interval := micros(l.Period) / float64(l.Rate)
	span := float64(l.Limit) * interval
	base := fmax(st.T, now)
	need := base - now + float64(float64(cost)*interval)
	*d = Decision{Limit: l.Limit, Allowed: need <= span+slackMicros}
	if d.Allowed {
		if cost > 0 {
			st.T = later(base, float64(float64(cost)*interval))
		}
	} else {
		d.RetryAfter = dur(need - span)
	}
	ahead := fmax(st.T, now) - now
	d.Remaining = remaining(l.Limit, (span-ahead)/interval)
	d.Reset = dur(ahead)
}

// leakyBucket is a queue drained at Rate per Period, by virtual scheduling: T is the next free
// departure time, and a request departs at max(T, now), taking cost drain intervals. The queue is
// full when the wait plus the request would exceed Limit intervals.
func (l *Limit) leakyBucket(st *State, now float64, cost int64, d *Decision) {
	interval := micros(l.Period) / float64(l.Rate)
	span := float64(l.Limit) * interval
	maxWait := micros(l.MaxWait)
	start := fmax(st.T, now)
	wait := start - now
	own := float64(float64(cost) * interval)
	*d = Decision{Limit: l.Limit, Allowed: wait+own <= span+slackMicros && wait <= maxWait+slackMicros}
	if d.Allowed {
		d.Wait = dur(wait)
		if cost > 0 {
			st.T = later(start, own)
		}
	} else {
		// The same request passes once the queue ahead of it is short enough for both bounds.
		d.RetryAfter = dur(start - fmin(span-own, maxWait) - now)
	}
	ahead := fmax(st.T, now) - now
	d.Remaining = remaining(l.Limit, (span-ahead)/interval)
	d.Reset = dur(ahead)
}

// fixedWindow counts units in clock-aligned windows. Up to twice the limit can pass around a
// boundary: Limit at the end of one window and Limit at the start of the next.
func (l *Limit) fixedWindow(st *State, now float64, cost int64, d *Decision) {
	window := micros(l.Period)
	idx := math.Floor(now / window)
	n := 0.0
	if st.W == idx {
		n = st.N
	}
	end := (idx+1)*window - now
	*d = Decision{Limit: l.Limit, Allowed: n+float64(cost) <= float64(l.Limit)}
	if d.Allowed {
		if cost > 0 {
			n += float64(cost)
			st.W, st.N = idx, n
		}
	} else {
		d.RetryAfter = dur(end)
	}
	d.Remaining = remaining(l.Limit, float64(l.Limit)-n) // n may round past a limit beyond 2^53
	if n > 0 {
		d.Reset = dur(end)
	}
}

// slidingLog remembers every admitted request for one window and admits a request when the units
// of the last window plus its cost fit the limit. Exact, at the price of one entry per request.
func (l *Limit) slidingLog(st *State, now float64, cost int64, d *Decision) {
	window := micros(l.Period)
	drop := 0
	n := int64(0)
	for drop < len(st.Log) && st.Log[drop].At <= now-window {
		drop++
	}
	log := st.Log[drop:]
	for _, e := range log {
		n += e.Units
	}
	// n <= Limit and 0 <= cost <= Limit (Take): the subtraction cannot overflow.
	*d = Decision{Limit: l.Limit, Allowed: cost <= l.Limit-n}
	if d.Allowed {
		if cost > 0 {
			// Appending never changes the elements the caller's slice can see, so st stays
			// valid for a caller that does not store the result.
			log = append(log, LogEntry{At: now, Units: cost})
			n += cost
		}
	} else {
		// The oldest entries holding n+cost-limit units must leave the window first.
		need, i := n+cost-l.Limit, 0
		for need -= log[0].Units; need > 0; need -= log[i].Units {
			i++
		}
		d.RetryAfter = dur(log[i].At + window - now)
	}
	if d.Allowed && cost > 0 || drop > 0 {
		st.Log = log
	}
	d.Remaining = l.Limit - n
	if len(log) > 0 {
		d.Reset = dur(log[len(log)-1].At + window - now)
	}
}

// slidingWindowCounter estimates the units of the last window as the current window's count plus
// the previous window's count weighted by the share of it that the sliding window still covers.
// Only the immediately preceding window carries over.
func (l *Limit) slidingWindowCounter(st *State, now float64, cost int64, d *Decision) {
	window, idx, start, cur, prev, est := l.windowEstimate(st, now)
	limit := float64(l.Limit)
	c := float64(cost)
	*d = Decision{Limit: l.Limit, Allowed: est+c <= limit+slackUnits}
	if d.Allowed {
		if cost > 0 {
			cur += c
			est += c
			st.W, st.N, st.P = idx, cur, prev
		}
	} else if room := limit - cur - c; room >= 0 {
		// Within this window, once enough of the previous window has slid out: down to room
		// units, or to the share that counts as none.
		d.RetryAfter = dur(start + window - fmax(room, lastShare)*window/prev - now)
	} else {
		// In the next window, where the current count becomes the weighted one.
		d.RetryAfter = dur(start + window + fmax(0, window-(limit-c)*window/cur) - now)
	}
	d.Remaining = remaining(l.Limit, limit-est)
	switch {
	case cur > 0:
		d.Reset = dur(start + 2*window - now)
	case prev > 0:
		d.Reset = dur(start + window - now)
	}
}

// concurrency admits a request while the slots of the leases in flight plus its cost fit the
// limit, and gives it a lease of Period. Expired leases are dropped first: they are the requests
// of an enforcer that stopped renewing them. A refusal carries no RetryAfter: a slot frees when a
// request in flight ends, which no clock says.
func (l *Limit) concurrency(st *State, now float64, cost int64, lease string, d *Decision) {
	*st = l.dropExpired(*st, now)
	held := int64(0)
	for _, e := range st.Leases {
		held += e.Units
	}
	// held <= Limit and 0 <= cost <= Limit (Take): the subtraction cannot overflow.
	*d = Decision{Limit: l.Limit, Allowed: cost <= l.Limit-held}
	if d.Allowed && cost > 0 {
		// Appending never changes the elements the caller's slice can see.
		st.Leases = append(st.Leases, Lease{ID: lease, Expiry: now + micros(l.Period), Units: cost})
		held += cost
	}
	latest := 0.0
	for _, e := range st.Leases {
		latest = fmax(latest, e.Expiry)
	}
	d.Remaining = l.Limit - held
	d.Reset = dur(latest - now)
}
