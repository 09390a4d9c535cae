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
// as neither (abandon). Time comes from now, so tests drive the breaker
// with a fake clock.
type breaker struct {
	failures uint32
	open     time.Duration
	now      func() time.Time
	// changed is told whether the breaker now skips the store (open or probing) or not, under
	// its lock, so that it sees the changes in order; told is told the same once the lock is
	// released, with the failure that opened the breaker (nil when a probe closed it). Neither
	// hears of a failed probe opening it again.
	changed func(skipping bool)
	told    func(skipping bool, err error)

	mu          sync.Mutex
	state       breakerState
	consecutive uint32
	until       time.Time // while open
}

type breakerState int

const (
	breakerClosed breakerState = iota
	breakerOpen
	breakerProbing
)

// allow reports whether a decision may go to the store; errBreakerOpen if not. Every allowed
// decision must be followed by done.
func (b *breaker) allow() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch b.state {
	case breakerOpen:
		if b.now().Before(b.until) {
			return errBreakerOpen
		}
		b.state = breakerProbing
		return nil
	case breakerProbing:
		return errBreakerOpen // one probe at a time
	}
	return nil
}

// done records the outcome of an allowed decision.
func (b *breaker) done(err error) {
	if changed, skipping := b.record(err); changed && b.told != nil {
		if !skipping {
			err = nil
		}
		b.told(skipping, err)
	}
}

// record is done's part under the lock: it reports whether the breaker changed, and to what.
func (b *breaker) record(err error) (changed, skipping bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	failed := err != nil && !errors.Is(err, store.ErrFault)
	switch {
	case b.state == breakerProbing && failed:
		b.trip()
	case b.state == breakerProbing:
		b.state, b.consecutive = breakerClosed, 0
		b.changed(false)
		return true, false
	case !failed:
		b.consecutive = 0
	default:
		b.consecutive++
		if b.consecutive >= b.failures {
			b.trip()
			b.changed(true)
			return true, true
		}
	}
	return false, false
}

// abandon records an allowed decision that ended with neither a success nor a failure: its
// caller cancelled it. A probe so abandoned lets the next decision probe instead.
func (b *breaker) abandon() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == breakerProbing {
		b.state = breakerOpen // its until has passed: the next decision probes
	}
}

func (b *breaker) trip() {
	b.state, b.until, b.consecutive = breakerOpen, b.now().Add(b.open), 0
}

// skipping reports whether the breaker is open or probing.
func (b *breaker) skipping() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state != breakerClosed
}
