package store

import (
	"context"
	"sync"
	"time"

	"github.com/sluice-dev/sluice/internal/algorithm"
)

// held is what one enforcer holds of one leased rule of one client: units Redis charged ahead,
// for it to decide requests from without a trip.
type held struct {
	// left is the units still to use, until until (this process's clock): before the lease's
	// expiry in Redis, since the lease was asked for before Redis granted it, and, on a fixed
	// window, before the window ends.
	left  int64
	until time.Time
	// limit is the rule's limit the units were taken under: a policy that changes it leaves them
	// unused (lost), since Redis counted them under the old one.
	limit algorithm.Limit
	// pending is the units of left that requests whose trips are in flight took (covered): Redis
	// must go on counting them held until those trips end, so the scripts that replace its
	// record of this enforcer (a take, a refill) hold them too.
	pending int64
	// remaining and resetAt are what Redis said of the rule at the grant, without what it
	// leased: a request decided from the lease reports remaining + left.
	remaining int64
	resetAt   time.Time
	// at is when Redis leased them, in its µs (a fixed window takes back only its own window's
	// units), asked for at sent by this process's clock; spent is when units were last spent.
	at          int64
	sent, spent time.Time
	// busy, while this enforcer asks Redis for the rule, closes when the answer is in: one trip
	// per rule and client at a time, so that what the enforcer holds is what Redis recorded.
	busy chan struct{}
	// refilling is true while the trip in flight takes units ahead (refill): requests the units
	// left cover go on being decided from them meanwhile.
	refilling bool
	// gen changes whenever left stops counting units a request took from it: a script that
	// replaces what Redis records this enforcer holds by what it holds then (a take, a refill),
	// and a fixed window's refill that drops the last window's units. A refused request gives
	// back what it took from left only if gen is still the one it took them at; else Redis no
	// longer counts them as held here, and they are lost (refused too early), never used twice.
	gen uint64
}

// ready reports whether a request of c may be decided from the units held now: they cover it,
// and no trip is in flight but a refill, which leaves them to use.
func (h *held) ready(c *Check, now time.Time) bool {
	return (h.busy == nil || h.refilling) && h.valid(now) && h.limit == c.Limit && h.left >= c.Cost
}

// usable reports whether a trip to Redis, which may take up to timeout, may decide a request
// with the units held: they are still valid when its answer comes, so they are spent before
// their lease ends in Redis (or their fixed window does).
func (h *held) usable(c *Check, now time.Time, timeout time.Duration) bool {
	return h.valid(now) && h.limit == c.Limit && h.until.Sub(now) > timeout
}

// covers reports whether a trip to Redis decides c from the units held, taking nothing.
func (h *held) covers(c *Check, now time.Time, timeout time.Duration) bool {
	return h.usable(c, now, timeout) && h.left >= c.Cost
}

// leases are the units this enforcer holds, by the checks' keys.
type leases struct {
	mu      sync.Mutex
	held    map[string]*held
	sweepAt int
	// closed is set by Close: no refill starts after it.
	closed bool
}

// leasable reports whether the lease path decides a check from its lease: an enforced check of
// a token bucket or fixed window with a lease, charged now, and no idempotency record to read
// (the API refuses the others; this keeps the store exact whatever it is given). A cost above
// the limit never passes: Redis says so (Never), as without a lease, and no unit held is
// touched.
func leasable(c *Check) bool {
	return c.UnitLease != nil && c.UnitLease.Max > 1 && c.Enforce && !c.Deferred && c.Idempotency == nil &&
		c.Cost >= 0 && c.Cost <= c.Limit.Limit && (c.Limit.Kind == algorithm.TokenBucket || c.Limit.Kind == algorithm.FixedWindow)
}

// leasing reports whether a decision has a leasable check.
func (s *Redis) leasing(checks []Check) bool {
	for i := range checks {
		if leasable(&checks[i]) {
			return true
		}
	}
	return false
}

func (s *Redis) now() time.Time {
	if s.clock != nil {
		return s.clock()
	}
	return time.Now()
}

// decideLeased decides a request with a leased check. When every check is leased and every
// lease holds its cost, the request is decided here, without Redis; otherwise one trip decides
// the checks the leases do not cover, and takes new leases for the leased ones, all or nothing
// as ever: a refused request spends nothing it held.
func (s *Redis) decideLeased(ctx context.Context, checks []Check, out []algorithm.Decision) (bool, error) {
	keys := leaseKeys(checks, make([]string, 0, len(checks)))
	hs := make([]*held, len(checks))
	for {
		t, wait := s.reserve(checks, keys, hs, out)
		switch {
		case t == nil && wait == nil:
			return true, nil // decided from the units held
		case wait == nil:
			return s.trip(ctx, t, out)
		}
		select {
		case <-wait:
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
}

// reserve, under the leases' lock, decides the request from the units held when every check is
// leased and every lease holds its cost (neither a trip nor a wait returned); or returns the
// trip in flight for a rule and client (a take, or a refill) that it must wait for, since a trip
// takes for each leased check it does not cover and may not while another is out; or reserves
// a trip of its own (leaseTrip).
func (s *Redis) reserve(checks []Check, keys []string, hs []*held, out []algorithm.Decision) (*leaseTrip, chan struct{}) {
	now := s.now()
	s.leases.mu.Lock()
	defer s.leases.mu.Unlock()
	s.leases.sweep(now)
	local := true
	for i := range checks {
		if keys[i] == "" {
			local = false
			continue
		}
		hs[i] = s.leases.get(keys[i])
		local = local && hs[i].ready(&checks[i], now)
	}
	if local {
		for i := range checks {
			s.spend(&checks[i], hs[i], now, &out[i])
		}
		return nil, nil
	}
	for i := range checks {
		if keys[i] != "" && hs[i].busy != nil && !hs[i].covers(&checks[i], now, s.timeout) {
			return nil, hs[i].busy
		}
	}
	return s.plan(checks, keys, hs, now), nil
}

// DecideLocal implements LocalDecider: it decides a request from the units this enforcer holds
// when every check is leased and every lease holds its cost, and reports whether it did. It never
// waits for Redis: a request whose rule Redis is being asked for is left to Decide.
func (s *Redis) DecideLocal(checks []Check, out []algorithm.Decision) bool {
	if len(checks) == 0 {
		return false
	}
	for i := range checks {
		if !leasable(&checks[i]) {
			return false
		}
	}
	var buf [4]string
	keys := leaseKeys(checks, buf[:0])
	now := s.now()
	s.leases.mu.Lock()
	defer s.leases.mu.Unlock()
	for i := range checks {
		h := s.leases.held[keys[i]]
		if keys[i] == "" || h == nil || !h.ready(&checks[i], now) {
			return false
		}
	}
	for i := range checks {
		s.spend(&checks[i], s.leases.held[keys[i]], now, &out[i])
	}
	return true
}

// spend decides c from the units h holds, which cover it (s.leases.mu is held), and refills
// the lease ahead once a quarter of max or less is left, so that a busy client's requests
// seldom find it empty and wait for Redis.
func (s *Redis) spend(c *Check, h *held, now time.Time, out *algorithm.Decision) {
	h.left -= c.Cost
	h.spent = now
	*out = h.decision(c, now)
	if h.busy != nil || 4*h.left > c.UnitLease.Max || s.leases.closed {
		return
	}
	done := make(chan struct{})
	h.busy, h.refilling = done, true
	h.gen++ // its record holds h.left, not what requests took from it before
	ahead := *c
	ahead.Cost, ahead.Idempotency = 0, nil
	ahead.taking, ahead.extra, ahead.hold, ahead.spent = true, c.UnitLease.Max-h.left, h.left+h.pending, h.spentAt()
	s.refills.Add(1)
	go s.refill(ahead, h, done, now)
}

// refill takes up to c.extra units more for h, which still holds c.hold: one script, whose
// record of what this enforcer holds counts both; requests go on spending the units held
// meanwhile, so they are at most c.hold when the answer comes. A failed refill changes nothing
// here: units Redis may have leased are lost, never used twice.
func (s *Redis) refill(c Check, h *held, done chan struct{}, sent time.Time) {
	defer s.refills.Done()
	if s.leaseScript != nil {
		s.leaseScript()
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	checks, out := []Check{c}, make([]algorithm.Decision, 1)
	ok, _, err := s.run(ctx, modeDecide, checks, []int{0}, s.requestID(checks), out, nil)
	s.followFailover(ctx, err)
	if s.leaseAnswer != nil {
		s.leaseAnswer()
	}

	s.leases.mu.Lock()
	defer s.leases.mu.Unlock()
	if err == nil && ok && checks[0].granted > 0 {
		if c.Limit.Kind == algorithm.FixedWindow && checks[0].at/c.Limit.Period.Microseconds() != h.at/c.Limit.Period.Microseconds() {
			h.left = 0 // the units left were the last window's, and so was their time
			h.gen++
		}
		h.left += checks[0].granted
		h.grant(&c, checks[0].at, out[0], sent)
	}
	h.busy, h.refilling = nil, false
	close(done)
}

// spentAt is when units of the lease were last spent, in Redis's µs, as late as it may have
// been by Redis's clock (the lease was asked for before Redis granted it); 0 for none.
func (h *held) spentAt() int64 {
	if h.at == 0 {
		return 0
	}
	return h.at + h.spent.Sub(h.sent).Microseconds()
}

// grant notes what Redis said of a take at at (its µs) asked for at sent (this process's clock).
func (h *held) grant(c *Check, at int64, d algorithm.Decision, sent time.Time) {
	h.at, h.sent, h.limit = at, sent, c.Limit
	if h.spent.Before(sent) { // else units a request decided meanwhile passed later, when its answer came
		h.spent = sent
	}
	h.remaining = d.Remaining
	h.resetAt = sent.Add(d.Reset)
	h.until = sent.Add(c.UnitLease.Expiry)
	if c.Limit.Kind == algorithm.FixedWindow && d.Reset < c.UnitLease.Expiry {
		h.until = h.resetAt // a fixed window's units are its window's
	}
}

// leaseKeys appends to keys the key of each check whose lease the store decides from, "" for the
// others: a rule named twice in one decision, leased or not, is decided in Redis, as without a
// lease.
func leaseKeys(checks []Check, keys []string) []string {
	first := len(keys)
	for i := range checks {
		keys = append(keys, checks[i].Key())
	}
	ks := keys[first:]
	for i := range ks {
		named := false
		for j := i + 1; j < len(ks); j++ {
			if ks[i] != "" && ks[j] == ks[i] {
				ks[j], named = "", true
			}
		}
		if named || !leasable(&checks[i]) {
			ks[i] = ""
		}
	}
	return keys
}

// leaseTrip is one trip to Redis for a request of leased checks: sub is what it asks, the
// checks less the units their leases cover, each leased one taking units ahead for its lease;
// the rest is what it took from the leases, to be spent or given back once the answer is in.
type leaseTrip struct {
	checks, sub []Check
	keys        []string
	hs          []*held
	// reserved are the units of each leased check its lease covers (covered) or gives (a take
	// that spends the usable units left); gens, its lease's gen once they were taken.
	reserved []int64
	gens     []uint64
	covered  []bool
	// group are the checks the script decides; done closes once the answer is noted, for the
	// requests that wait for the leases this trip takes.
	group []int
	done  chan struct{}
	now   time.Time
}

// plan reserves a trip (s.leases.mu is held): a leased check its lease covers takes its cost from
// it, spent if the request is admitted and given back if not; any other leased check empties its
// lease for a take, which replaces it.
func (s *Redis) plan(checks []Check, keys []string, hs []*held, now time.Time) *leaseTrip {
	t := &leaseTrip{checks: checks, sub: make([]Check, len(checks)), keys: keys, hs: hs, now: now,
		reserved: make([]int64, len(checks)), gens: make([]uint64, len(checks)), covered: make([]bool, len(checks))}
	copy(t.sub, checks)
	for i := range t.sub {
		h := hs[i]
		switch {
		case keys[i] == "":
			t.group = append(t.group, i)
		case h.covers(&t.sub[i], now, s.timeout):
			t.covered[i], t.reserved[i], t.gens[i] = true, t.sub[i].Cost, h.gen
			h.left -= t.sub[i].Cost
			h.pending += t.sub[i].Cost
		default:
			t.take(i, s.timeout)
		}
	}
	return t
}

// take empties check i's lease for a take that replaces it: the units still usable when the
// answer comes are spent by this request, the rest of a fixed window's given back.
func (t *leaseTrip) take(i int, timeout time.Duration) {
	h, c := t.hs[i], &t.sub[i]
	switch {
	case h.usable(c, t.now, timeout):
		t.reserved[i] = h.left
	case h.left > 0 && h.limit == c.Limit && c.Limit.Kind == algorithm.FixedWindow:
		// Expired, never used, or ending before the answer may come: given back to their
		// window if it is still Redis's current one (and not restored if the trip fails: Redis
		// may have taken them back already). A token bucket's are not: it may have been full
		// since they were taken, and a credit would pass more than one bucket; it refills them
		// instead.
		c.back, c.backAt = h.left, h.at
	}
	h.left = 0
	h.gen++ // a take records what it takes and the units pending, no more
	t.gens[i] = h.gen
	if t.done == nil {
		t.done = make(chan struct{})
	}
	h.busy = t.done
	c.Cost -= t.reserved[i]
	// A check of no cost takes nothing: it charges nothing, and leaves nothing charged.
	c.taking, c.extra, c.hold, c.spent = c.Cost > 0, max(0, c.UnitLease.Max-c.Cost), h.pending, h.spentAt()
	if t.reserved[i] > 0 {
		c.spent = 0 // by this request, if it passes: when the script runs
	}
	t.group = append(t.group, i)
}

// trip asks Redis what a reserved trip asks, and notes the answer in the leases.
func (s *Redis) trip(ctx context.Context, t *leaseTrip, out []algorithm.Decision) (bool, error) {
	if s.leaseScript != nil {
		s.leaseScript()
	}
	ok, sent, err := s.ask(ctx, t, out)
	if s.leaseAnswer != nil {
		s.leaseAnswer()
	}
	s.noteTrip(t, err == nil && ok, sent, err, out)
	if err != nil {
		return false, err
	}
	return ok, nil
}

// ask runs a trip's script, unless its caller gave up before it was sent: a request whose script
// was never sent changes nothing in Redis, and what it took from the leases goes back whole.
func (s *Redis) ask(ctx context.Context, t *leaseTrip, out []algorithm.Decision) (ok, sent bool, err error) {
	id := s.requestID(t.sub)
	if err := ctx.Err(); err != nil {
		return false, false, err
	}
	if !s.cluster {
		ok, _, err = s.run(ctx, modeDecide, t.sub, t.group, id, out, nil)
		return ok, true, err
	}
	groups := s.groups(t.sub, t.group)
	if len(groups) > 1 {
		// Several tags, several scripts: one that took while another refused would need its
		// take undone as well. Decide as without leases; what is held stays held.
		for _, i := range t.group {
			t.sub[i].taking = false
		}
	}
	ok, err = s.decideGroups(ctx, t.sub, groups, id, out)
	s.followFailover(ctx, err)
	return ok, true, err
}

// noteTrip notes a trip's answer in the leases, under their lock, and ends the trip for the
// requests that wait for it.
func (s *Redis) noteTrip(t *leaseTrip, admitted, sent bool, err error, out []algorithm.Decision) {
	s.leases.mu.Lock()
	defer s.leases.mu.Unlock()
	for i := range t.sub {
		if t.keys[i] == "" {
			continue
		}
		h := t.hs[i]
		s.note(t, i, admitted, sent, err, out)
		if err == nil {
			if t.covered[i] || admitted && t.sub[i].taking {
				out[i] = h.decision(&t.checks[i], t.now)
			} else {
				out[i].Remaining = min(t.checks[i].Limit.Limit, out[i].Remaining+h.left)
			}
		}
		if h.busy == t.done {
			h.busy = nil
		}
	}
	if t.done != nil {
		close(t.done)
	}
}

// note settles check i's lease with the trip's answer (s.leases.mu is held): units it covered are
// spent by an admitted request, and given back to a refused one if Redis counts them held here
// still; a take that passed leaves the lease holding what Redis just leased.
func (s *Redis) note(t *leaseTrip, i int, admitted, sent bool, err error, out []algorithm.Decision) {
	h := t.hs[i]
	if t.covered[i] {
		h.pending -= t.reserved[i]
	}
	switch {
	case !admitted:
		// Not spent: back, if Redis counts them held here still. A trip that failed may have
		// run, and a take that ran counted what it held as spent.
		if h.gen == t.gens[i] && (t.covered[i] || err == nil || !sent) {
			h.left += t.reserved[i]
			if !sent {
				h.left += t.sub[i].back
			}
		}
	case t.covered[i]:
		if answered := s.now(); answered.After(h.spent) {
			h.spent = answered // they passed when the answer came
		}
	case t.sub[i].taking:
		// What it held was spent by this request; it holds what Redis just leased.
		h.left = t.sub[i].granted
		h.grant(&t.sub[i], t.sub[i].at, out[i], t.now)
	}
}

// valid reports whether the units held may still be used.
func (h *held) valid(now time.Time) bool { return h.left > 0 && now.Before(h.until) }

// decision is what a request decided from the lease sees of the rule.
func (h *held) decision(c *Check, now time.Time) algorithm.Decision {
	return algorithm.Decision{
		Allowed:   true,
		Limit:     c.Limit.Limit,
		Remaining: min(c.Limit.Limit, h.remaining+h.left),
		Reset:     max(0, h.resetAt.Sub(now)),
	}
}

// get returns the key's entry, made if absent.
func (l *leases) get(key string) *held {
	h := l.held[key]
	if h == nil {
		if l.held == nil {
			l.held = make(map[string]*held)
		}
		h = &held{}
		l.held[key] = h
	}
	return h
}

// sweep drops the entries whose units ran out or expired, with no trip in flight, once the
// table has doubled since the last sweep: it holds at most twice the keys in use.
func (l *leases) sweep(now time.Time) {
	if len(l.held) < l.sweepAt {
		return
	}
	for k, e := range l.held {
		if e.busy == nil && e.pending == 0 && !e.valid(now) {
			delete(l.held, k)
		}
	}
	l.sweepAt = max(1024, 2*len(l.held))
}
