package limiter

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"k8s.io/utils/clock"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

// Pending is what an admitted request still owes the store once its response ends: the leases
// it holds on concurrency rules, which are renewed every third of their lease timeout until
// then, and the rules its response charges. A front end that sees responses (the proxies,
// through the decision seam) calls End exactly once per admitted request, when the response is
// complete or its client has left.
type Pending struct {
	l      *Limiter
	checks []store.Check
	rules  []matched
	// every is how often the leases are renewed, 0 with no lease.
	every time.Duration
	mu    sync.Mutex
	timer clock.Timer
	ended bool
}

// pending is what a request admitted with checks owes: the leases of its concurrency checks
// that admitted it (all of them when out is nil: the store failed, and may have granted them)
// and its rules charged by the response. Nil when it owes nothing. The renewal of its leases
// starts here, so that no front end can forget it.
func (l *Limiter) pending(checks []store.Check, rules []matched, out []algorithm.Decision) *Pending {
	var p *Pending
	for i := range checks {
		c := &checks[i]
		holds := c.Limit.Kind == algorithm.Concurrency && c.Lease != "" && c.Cost > 0 && (out == nil || out[i].Allowed)
		if !holds && !c.Deferred {
			continue
		}
		if p == nil {
			p = &Pending{l: l}
		}
		p.checks = append(p.checks, *c) // the checks are the decision's pooled buffers: copied
		p.rules = append(p.rules, rules[i])
		if every := c.Limit.Period / 3; holds && (p.every == 0 || every < p.every) {
			p.every = every
		}
	}
	if p != nil && p.every > 0 {
		p.timer = l.clock.AfterFunc(p.every, p.renewLater)
	}
	return p
}

// Holds reports whether the request holds leases (of concurrency rules), rather than owing only
// the charges of its response.
func (p *Pending) Holds() bool { return p != nil && p.every > 0 }

// renewLater renews on a goroutine of its own: a clock may run AfterFunc's function while it
// holds its own lock (a fake clock's Step does), which the store's reading of the time needs.
func (p *Pending) renewLater() {
	go func() {
		defer p.l.contain("renew the leases of a request in flight")
		p.renew()
	}()
}

// contain keeps a panic in a request's background work (its renewals, its end) from ending the
// process, as every request path does: it is logged, and the work is lost (a lease then lasts to
// its timeout; a charge is not made).
func (l *Limiter) contain(what string) {
	if r := recover(); r != nil {
		l.log.Error(fmt.Errorf("panic: %v", r), "A request's background work panicked; the process goes on", "work", what)
	}
}

// renew extends the request's leases, and schedules the next renewal unless the request ended
// meanwhile. A renewal that fails is counted as a store error; the lease then lasts to its
// timeout, and the next renewal tries again. The renewal is counted once the next is scheduled,
// so that whoever sees the count (a test stepping a fake clock) finds the next timer armed.
func (p *Pending) renew() {
	var leases []store.Check
	for i := range p.checks {
		if p.checks[i].Limit.Kind == algorithm.Concurrency {
			leases = append(leases, p.checks[i])
		}
	}
	err := errBreakerOpen
	if !p.l.BreakerOpen() {
		err = p.l.store.Renew(context.Background(), leases, make([]algorithm.Decision, len(leases)))
	}
	p.mu.Lock()
	if !p.ended {
		p.timer = p.l.clock.AfterFunc(p.every, p.renewLater)
	}
	p.mu.Unlock()
	switch {
	case err == nil:
		p.l.metrics.leaseRenewals.WithLabelValues(renewalRenewed).Inc()
	case errors.Is(err, errBreakerOpen):
		p.l.metrics.leaseRenewals.WithLabelValues(renewalFailed).Inc()
	default:
		p.l.metrics.leaseRenewals.WithLabelValues(renewalFailed).Inc()
		p.l.metrics.storeErrors.WithLabelValues(cause(err)).Inc()
	}
}

// End ends the request once its response is complete (status is its status; fields reads a
// response field's values, the header's and the trailer's) or its client has left (status 0,
// fields nil): the renewals stop, and in one store call, in the background so that the response
// is never held back, its leases are released and its rules charged by the response are charged
// what the response says (Cost). Safe on a nil Pending, and only the first call counts.
//
// A rule charged by the response charges a response of one of its statuses; a request whose
// response never came (its client left first) is charged as one that did, at the rule's cost:
// leaving early never escapes a charge.
func (p *Pending) End(status int, fields func(name string) []string) {
	p.end(true, false, status, fields)
}

// Cut ends the request as End does, for a response that began but whose body did not end: its
// client left during it, or the upstream broke it off. A rule with costFrom whose response
// reported no valid cost in its header is charged costFrom.max rather than its cost: the trailer
// that would have reported it never came, and a client that leaves just before it must not pay
// less than one that reads it.
func (p *Pending) Cut(status int, fields func(name string) []string) {
	p.end(true, true, status, fields)
}

// Drop ends a request that was never forwarded (its client left while it was held in a leaky
// bucket's queue): its leases are released, and nothing is charged, as no response was made.
func (p *Pending) Drop() { p.end(false, false, 0, nil) }

func (p *Pending) end(forwarded, cut bool, status int, fields func(name string) []string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	if p.ended {
		p.mu.Unlock()
		return
	}
	p.ended = true
	if p.timer != nil {
		p.timer.Stop()
	}
	p.mu.Unlock()

	checks := make([]store.Check, 0, len(p.checks))
	rules := make([]matched, 0, len(p.rules))
	results := make([]string, 0, len(p.rules))
	for i, c := range p.checks {
		r := p.rules[i]
		result := ""
		if c.Deferred {
			if !forwarded || status != 0 && !r.rule.Charges(status) {
				continue
			}
			c.Cost, result = ResponseCost(r.rule, status, fields)
			if cut && status != 0 && result == chargeDefaultCost && r.rule.CostFrom != nil {
				c.Cost, result = r.rule.CostFrom.Max, chargeIncomplete
			}
			c.Deferred = false
		}
		checks, rules, results = append(checks, c), append(rules, r), append(results, result)
	}
	if len(checks) == 0 {
		return
	}
	p.l.ending.Go(func() {
		defer p.l.contain("end a request")
		p.l.finish(checks, rules, results)
	})
}

// finish releases and charges in one store call, and counts the charges.
func (l *Limiter) finish(checks []store.Check, rules []matched, results []string) {
	err := errBreakerOpen
	if !l.BreakerOpen() {
		err = l.store.Finish(context.Background(), checks, make([]algorithm.Decision, len(checks)))
	}
	if err != nil && !errors.Is(err, errBreakerOpen) {
		l.metrics.storeErrors.WithLabelValues(cause(err)).Inc()
	}
	for i, m := range rules {
		if results[i] == "" {
			continue // a lease released
		}
		if err != nil {
			l.metrics.responseCharge(m.of, m.rule.Name, chargeFailed)
			continue
		}
		l.metrics.responseCharge(m.of, m.rule.Name, results[i])
	}
}

// cause is the cause label of a store error.
func cause(err error) string {
	if errors.Is(err, store.ErrFault) {
		return causeFault
	}
	return causeUnavailable
}

// Settle waits until every request that has ended is written to the store (End works in the
// background), or ctx is done: the enforcer settles before it closes its store.
func (l *Limiter) Settle(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		l.ending.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ResponseCost is what a response of status charges a rule charged by the response, and how
// it was found (a chargeX result): the rule's cost, or with costFrom the value of its field in
// the response, header or trailer: one value, a whole number of units (digits alone, spaces
// around them aside), at most costFrom.max (a larger one, however long, is charged max). A
// field that is missing, sent twice, empty, signed, or anything but digits is charged the rule's
// cost, and so is a response that never came (status 0).
func ResponseCost(r *policy.Rule, status int, fields func(name string) []string) (int64, string) {
	if r.CostFrom == nil {
		return r.Cost, chargeCharged
	}
	if status == 0 || fields == nil {
		return r.Cost, chargeDefaultCost
	}
	values := fields(r.CostFrom.Header)
	if len(values) != 1 {
		return r.Cost, chargeDefaultCost
	}
	v := strings.TrimSpace(values[0])
	if v == "" {
		return r.Cost, chargeDefaultCost
	}
	n, over := int64(0), false
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c < '0' || c > '9' {
			return r.Cost, chargeDefaultCost
		}
		if !over {
			// Max is at most 10^9: n stays below 10^10, far from overflowing.
			n = n*10 + int64(c-'0')
			over = n > r.CostFrom.Max
		}
	}
	if over {
		return r.CostFrom.Max, chargeClamped
	}
	return n, chargeCharged
}
