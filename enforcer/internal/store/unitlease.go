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
	// remaining and resetAt are what Redis said of the rule at the grant, without what it
	// leased: a request decided from the lease reports remaining + left.
	remaining int64
	resetAt   time.Time
	// at is when Redis leased them, in its µs: a fixed window takes back only its own
	// window's units.
	at int64
	// busy, while this enforcer asks Redis for the rule, closes when the answer is in: one trip
	// per rule and client at a time, so that what the enforcer holds is what Redis recorded.
	busy chan struct{}
}

// leases are the units this enforcer holds, by the checks' keys.
type leases struct {
	mu      sync.Mutex
	held    map[string]*held
	sweepAt int
}

// leasable reports whether the lease path decides a check from its lease: an enforced check of
// a token bucket or fixed window with a lease, charged now, and no idempotency record to read
// (the API refuses the others; this keeps the store exact whatever it is given).
func leasable(c *Check) bool {
	return c.UnitLease != nil && c.UnitLease.Max > 1 && c.Enforce && !c.Deferred && c.Idempotency == nil &&
		c.Cost >= 0 && (c.Limit.Kind == algorithm.TokenBucket || c.Limit.Kind == algorithm.FixedWindow)
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
		now := s.now()
		s.leases.mu.Lock()
		s.leases.sweep(now)
		var wait chan struct{}
		local := true
		for i := range checks {
			if keys[i] == "" {
				local = false
				continue
			}
			hs[i] = s.leases.get(keys[i])
			if hs[i].busy != nil {
				wait = hs[i].busy
				break
			}
			if !hs[i].valid(now) || hs[i].left < checks[i].Cost {
				local = false
			}
		}
		if wait != nil {
			s.leases.mu.Unlock()
			select {
			case <-wait:
				continue
			case <-ctx.Done():
				return false, ctx.Err()
			}
		}
		if local {
			for i := range checks {
				hs[i].left -= checks[i].Cost
				out[i] = hs[i].decision(&checks[i], now)
			}
			s.leases.mu.Unlock()
			return true, nil
		}
		return s.trip(ctx, checks, keys, hs, now, out)
	}
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
		if keys[i] == "" || h == nil || h.busy != nil || !h.valid(now) || h.left < checks[i].Cost {
			return false
		}
	}
	for i := range checks {
		h := s.leases.held[keys[i]]
		h.left -= checks[i].Cost
		out[i] = h.decision(&checks[i], now)
	}
	return true
}

// leaseKeys appends to keys the key of each check whose lease the store decides from, "" for the
// others: a rule named twice in one decision is decided in Redis, as without a lease.
func leaseKeys(checks []Check, keys []string) []string {
	for i := range checks {
		k := ""
		if leasable(&checks[i]) {
			k = checks[i].Key()
		}
		keys = append(keys, k)
	}
	for i := range keys {
		for j := i + 1; j < len(keys); j++ {
			if keys[i] != "" && keys[i] == keys[j] {
				keys[i], keys[j] = "", ""
			}
		}
	}
	return keys
}

// trip asks Redis for what the leases do not cover; s.leases.mu is held and is released.
func (s *Redis) trip(ctx context.Context, checks []Check, keys []string, hs []*held, now time.Time, out []algorithm.Decision) (bool, error) {
	sub := make([]Check, len(checks))
	copy(sub, checks)
	reserved := make([]int64, len(checks))
	covered := make([]bool, len(checks))
	var group []int
	var done chan struct{}
	for i := range sub {
		h := hs[i]
		if keys[i] == "" {
			group = append(group, i)
			continue
		}
		if h.valid(now) && h.left >= sub[i].Cost {
			// Covered: spent if the request is admitted, given back if not.
			covered[i], reserved[i] = true, sub[i].Cost
			h.left -= sub[i].Cost
			continue
		}
		c := &sub[i]
		if h.valid(now) {
			reserved[i] = h.left
		} else if h.left > 0 {
			// Expired, never used: given back (and not restored if the trip fails: Redis may
			// have taken them back already).
			c.back, c.backAt = h.left, h.at
		}
		h.left = 0
		if done == nil {
			done = make(chan struct{})
		}
		h.busy = done
		c.Cost -= reserved[i]
		// A check of no cost takes nothing: it charges nothing, and leaves nothing charged.
		c.taking, c.extra = c.Cost > 0, max(0, c.UnitLease.Max-c.Cost)
		group = append(group, i)
	}
	s.leases.mu.Unlock()

	id := s.requestID(sub)
	var ok bool
	var err error
	if !s.cluster {
		ok, _, err = s.run(ctx, modeDecide, sub, group, id, out, nil)
	} else {
		groups := s.groups(sub, group)
		if len(groups) > 1 {
			// Several tags, several scripts: one that took while another refused would need
			// its take undone as well. Decide as without leases; what is held stays held.
			for _, i := range group {
				sub[i].taking = false
			}
		}
		ok, err = s.decideGroups(ctx, sub, groups, id, out)
		s.followFailover(ctx, err)
	}

	s.leases.mu.Lock()
	defer s.leases.mu.Unlock()
	admitted := err == nil && ok
	for i := range sub {
		h := hs[i]
		if keys[i] == "" {
			continue
		}
		switch {
		case !admitted:
			h.left += reserved[i] // not spent
		case sub[i].taking:
			// What it held was spent by this request; it holds what Redis just leased.
			h.left, h.at = sub[i].granted, sub[i].at
			h.remaining = out[i].Remaining
			h.resetAt = now.Add(out[i].Reset)
			h.until = now.Add(sub[i].UnitLease.Expiry)
			if sub[i].Limit.Kind == algorithm.FixedWindow && out[i].Reset < sub[i].UnitLease.Expiry {
				h.until = h.resetAt // a fixed window's units are its window's
			}
		}
		if err == nil {
			if covered[i] || admitted && sub[i].taking {
				out[i] = h.decision(&checks[i], now)
			} else {
				out[i].Remaining = min(checks[i].Limit.Limit, out[i].Remaining+h.left)
			}
		}
		if h.busy == done {
			h.busy = nil
		}
	}
	if done != nil {
		close(done)
	}
	if err != nil {
		return false, err
	}
	return ok, nil
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
		if e.busy == nil && !e.valid(now) {
			delete(l.held, k)
		}
	}
	l.sweepAt = max(1024, 2*len(l.held))
}
