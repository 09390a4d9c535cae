package limiter

import (
	"errors"
	"sync"
	"time"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
)

// errBreakerOpen is the error of a decision the breaker did not let reach the store.
var errBreakerOpen = errors.New("the store circuit breaker is open")

// breaker stops asking a store that keeps failing. After failures consecutive failures it opens
// for open: decisions fail at once, and rules apply their failure modes without waiting for the
// store's timeout. Then one decision probes the store (half-open) while the others still fail
// at once: its success closes the breaker, its failure opens it again. A fault (store.ErrFault)
// is the decision's own and counts as a success; a cancelled decision (the client left) counts
// as neither (abandon). Only the probe's outcome counts while the breaker is open or probing:
// decisions let through before it opened, which fail one after another once the store stalls,
// neither open it again nor close it. Time comes from now, so tests drive the breaker with a
// fake clock.
type breaker struct {
	failures uint32
	open     time.Duration
	now      func() time.Time
	// changed is told whether the breaker now skips the store (open or probing) or not, under
	// its lock, so that it sees the changes in order. told is told the same once the lock is
	// released, with the failure that opened the breaker (nil when it closed), unless a later
	// change was told first. Neither hears of a failed probe opening it again.
	changed func(skipping bool)
	told    func(skipping bool, err error)

	mu          sync.Mutex
	state       breakerState
	consecutive uint32
	until       time.Time // while open
	// opened counts the openings (a failed probe's included): a ticket of an earlier one is a
	// decision let through before the breaker last opened.
	opened uint64
	// changes counts the changes told would hear of, and toldChanges the last one it heard.
	changes     uint64
	tellMu      sync.Mutex
	toldChanges uint64
}

type breakerState int

const (
	breakerClosed breakerState = iota
	breakerOpen
	breakerProbing
)

// ticket is what allow gives a decision it lets through, for done or abandon.
type ticket struct {
	opened uint64
	probe  bool
}

// allow reports whether a decision may go to the store; errBreakerOpen if not. Every allowed
// decision must be followed by done or abandon, with its ticket.
func (b *breaker) allow() (ticket, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch b.state {
	case breakerOpen:
		if b.now().Before(b.until) {
			return ticket{}, errBreakerOpen
		}
		b.state = breakerProbing
		return ticket{opened: b.opened, probe: true}, nil
	case breakerProbing:
		return ticket{}, errBreakerOpen // one probe at a time
	}
	return ticket{opened: b.opened}, nil
}

// done records the outcome of an allowed decision.
func (b *breaker) done(t ticket, err error) {
	change, skipping := b.record(t, err)
	if !skipping {
		err = nil // a fault that counted as a success is not why the breaker closed
	}
	b.tell(change, skipping, err)
}

// tell tells told of a change (0: none), unless a later change was told first.
func (b *breaker) tell(change uint64, skipping bool, err error) {
	if change == 0 || b.told == nil {
		return
	}
	b.tellMu.Lock()
	defer b.tellMu.Unlock()
	if change > b.toldChanges {
		b.toldChanges = change
		b.told(skipping, err)
	}
}

// answered closes a breaker whose open time has passed when the store answered in a decision's
// time otherwise (the enforcer's health ping), as a probe would have: with no request to probe,
// an idle enforcer's breaker would stay open, and alert, for as long as nobody sends one. A
// probe in flight decides instead.
func (b *breaker) answered() {
	b.mu.Lock()
	if b.state != breakerOpen || b.now().Before(b.until) {
		b.mu.Unlock()
		return
	}
	b.state, b.consecutive = breakerClosed, 0
	b.changed(false)
	b.changes++
	change := b.changes
	b.mu.Unlock()
	b.tell(change, false, nil)
}

// record is done's part under the lock: it returns the change the outcome made (its number in
// changes, 0 for none) and whether the breaker now skips the store.
func (b *breaker) record(t ticket, err error) (change uint64, skipping bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	failed := err != nil && !errors.Is(err, store.ErrFault)
	switch {
	case t.probe && b.state == breakerProbing && failed:
		b.trip()
	case t.probe && b.state == breakerProbing:
		b.state, b.consecutive = breakerClosed, 0
		b.changed(false)
		b.changes++
		return b.changes, false
	case t.probe || b.state != breakerClosed || t.opened != b.opened:
		// A probe abandoned meanwhile, or a decision let through before the breaker last
		// opened: its outcome is old news.
	case !failed:
		b.consecutive = 0
	default:
		b.consecutive++
		if b.consecutive >= b.failures {
			b.trip()
			b.changed(true)
			b.changes++
			return b.changes, true
		}
	}
	return 0, b.state != breakerClosed
}

// abandon records an allowed decision that ended with neither a success nor a failure: its
// caller cancelled it. A probe so abandoned lets the next decision probe instead.
func (b *breaker) abandon(t ticket) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if t.probe && b.state == breakerProbing {
		b.state = breakerOpen // its until has passed: the next decision probes
	}
}

func (b *breaker) trip() {
	b.state, b.until, b.consecutive = breakerOpen, b.now().Add(b.open), 0
	b.opened++
}

// skipping reports whether the breaker is open or probing.
func (b *breaker) skipping() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state != breakerClosed
}
