package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/poll"
)

// stallingStore holds each decision until release closes (when set), then answers err (when set)
// or admits.
type stallingStore struct {
	release chan struct{}
	err     atomic.Pointer[error]
	calls   atomic.Int64
}

func (s *stallingStore) Decide(_ context.Context, checks []store.Check, out []algorithm.Decision) (bool, error) {
	s.calls.Add(1)
	if s.release != nil {
		<-s.release
	}
	if err := s.err.Load(); err != nil {
		return false, *err
	}
	for i := range checks {
		out[i] = algorithm.Decision{Allowed: true, Limit: checks[i].Limit.Limit, Remaining: 1}
	}
	return true, nil
}

func (s *stallingStore) fail(err error) { s.err.Store(&err) }
func (s *stallingStore) heal()          { s.err.Store(nil) }

func (*stallingStore) Finish(context.Context, []store.Check, []algorithm.Decision) error { return nil }
func (*stallingStore) Renew(context.Context, []store.Check, []algorithm.Decision) error  { return nil }
func (*stallingStore) Ping(context.Context) error                                        { return nil }
func (*stallingStore) Close() error                                                      { return nil }

// breakerLines keeps what the breaker logs: "opened" or "closed", in the order written.
type breakerLines struct {
	mu    sync.Mutex
	lines []string
	// hold, when set, is waited on before a "closed" line is written.
	hold chan struct{}
}

func (b *breakerLines) logger() logr.Logger {
	return funcr.New(func(_, args string) {
		line := ""
		switch {
		case strings.Contains(args, "circuit breaker opened"):
			line = "opened"
		case strings.Contains(args, "circuit breaker closed"):
			line = "closed"
			if b.hold != nil {
				<-b.hold
			}
		default:
			return
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		b.lines = append(b.lines, line)
	}, funcr.Options{})
}

func (b *breakerLines) get() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.lines)
}

// breakerLimiter is a limiter on s whose breaker opens after 3 failures for a second of the
// clock it returns, logging to the lines it returns.
func breakerLimiter(t *testing.T, s store.Store) (*limiter.Limiter, *clocktesting.FakeClock, *breakerLines) {
	t.Helper()
	clk := newClock()
	lines := &breakerLines{}
	l := limiter.New(limiter.Options{Store: s, BreakerFailures: 3, BreakerOpen: time.Second, Now: clk.Now, Log: lines.logger()})
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 5)))
	return l, clk, lines
}

// When the store stalls, every decision in flight fails in turn once its deadline passes: one
// outage opens the breaker once and logs it once, and only the probe a second later decides
// whether it closes. Before, every third late failure opened it again, logged again and pushed
// the probe back (ten lines for thirty decisions in flight).
func TestLimiterWhenDecisionsInFlightFailAfterTheBreakerOpensThenItOpensOnceAndOnlyTheProbeCounts(t *testing.T) {
	const inFlight = 30
	s := &stallingStore{release: make(chan struct{})}
	s.fail(context.DeadlineExceeded)
	l, clk, lines := breakerLimiter(t, s)
	var wg sync.WaitGroup
	for i := range inFlight {
		wg.Go(func() { l.Decide(context.Background(), request("/open", fmt.Sprintf("192.0.2.%d", i+1))) })
	}
	poll.WaitFor(t, 10*time.Second, poll.True("the decisions reaching the store", func() bool { return s.calls.Load() >= inFlight }))
	close(s.release)
	wg.Wait()
	if got := lines.get(); !slices.Equal(got, []string{"opened"}) || !l.BreakerOpen() {
		t.Fatalf("%d decisions failed in flight: logged %v, breaker open %v; want one opening", inFlight, got, l.BreakerOpen())
	}

	clk.Step(time.Second)
	s.heal()
	if res := l.Decide(context.Background(), request("/open", "192.0.2.1")); res.Outcome != limiter.Allowed {
		t.Fatalf("the probe a second after the opening: %v, want Allowed", res.Outcome)
	}
	if got := lines.get(); !slices.Equal(got, []string{"opened", "closed"}) || l.BreakerOpen() || s.calls.Load() != inFlight+1 {
		t.Fatalf("after the probe: logged %v, breaker open %v, %d store calls; want it closed by the one probe", got, l.BreakerOpen(), s.calls.Load())
	}
}

// The lines come in the order of the changes: a "closed" line still being written when three
// new failures open the breaker again is followed by their "opened", never overtaken by it, so
// that the last line says what the breaker is.
func TestLimiterWhenTheBreakerReopensWhileItsClosingIsLoggedThenTheLinesKeepTheirOrder(t *testing.T) {
	s := &stallingStore{}
	s.fail(errors.New("dial tcp: connection refused"))
	l, clk, lines := breakerLimiter(t, s)
	decide := func() { l.Decide(context.Background(), request("/open", "192.0.2.1")) }
	for range 3 {
		decide()
	}
	clk.Step(time.Second)
	s.heal()
	lines.hold = make(chan struct{})
	probed := make(chan struct{})
	go func() { defer close(probed); decide() }() // the probe closes the breaker; its line waits
	poll.WaitFor(t, 10*time.Second, poll.True("the probe closing the breaker", func() bool { return !l.BreakerOpen() }))
	s.fail(errors.New("dial tcp: connection refused"))
	reopened := make(chan struct{})
	go func() {
		defer close(reopened)
		for range 3 {
			decide()
		}
	}()
	poll.WaitFor(t, 10*time.Second, poll.True("the three failures reaching the store", func() bool { return s.calls.Load() >= 3+1+3 }))
	close(lines.hold)
	<-probed
	<-reopened
	if got := lines.get(); !slices.Equal(got, []string{"opened", "closed", "opened"}) || !l.BreakerOpen() {
		t.Fatalf("logged %v, breaker open %v; want opened, closed, opened, and open", got, l.BreakerOpen())
	}
}

// panickingStore panics while panics is set, and admits otherwise.
type panickingStore struct {
	stallingStore
	panics atomic.Bool
}

func (s *panickingStore) Decide(ctx context.Context, checks []store.Check, out []algorithm.Decision) (bool, error) {
	if s.panics.Load() {
		s.calls.Add(1)
		panic("the store's bug")
	}
	return s.stallingStore.Decide(ctx, checks, out)
}

// A probe whose store call panics (the front end answers it 500 and serves on) passes its turn to
// the next decision: the breaker was left probing, refusing every decision without asking the
// store, until the process restarted.
func TestLimiterWhenTheProbePanicsThenTheNextDecisionProbes(t *testing.T) {
	s := &panickingStore{}
	s.fail(errors.New("dial tcp: connection refused"))
	l, clk, _ := breakerLimiter(t, s)
	decide := func() limiter.Result { return l.Decide(context.Background(), request("/open", "192.0.2.1")) }
	for range 3 {
		decide()
	}
	clk.Step(time.Second)
	s.panics.Store(true)
	func() {
		defer func() { _ = recover() }()
		decide()
		t.Fatal("the probe's store call did not panic")
	}()
	s.panics.Store(false)
	s.heal()
	if res := decide(); res.Outcome != limiter.Allowed || l.BreakerOpen() || s.calls.Load() != 5 {
		t.Fatalf("the decision after the panicking probe: %v, breaker open %v, %d store calls; want it to probe, pass and close the breaker",
			res.Outcome, l.BreakerOpen(), s.calls.Load())
	}
}

// With no request to probe, the store answering the enforcer's health ping closes the breaker once
// its open time has passed, and logs it: an idle enforcer's breaker stayed open, and its alert
// fired, for as long as nobody sent a request. A ping before the open time has passed does not.
func TestLimiterWhenTheStoreAnswersAHealthPingThenAnOpenBreakerCloses(t *testing.T) {
	s := &stallingStore{}
	s.fail(errors.New("dial tcp: connection refused"))
	l, clk, lines := breakerLimiter(t, s)
	for range 3 {
		l.Decide(context.Background(), request("/open", "192.0.2.1"))
	}
	s.heal()
	l.StoreAnswered()
	if !l.BreakerOpen() {
		t.Fatal("a ping within the open time closed the breaker")
	}
	clk.Step(time.Second)
	l.StoreAnswered()
	if got := lines.get(); l.BreakerOpen() || !slices.Equal(got, []string{"opened", "closed"}) || s.calls.Load() != 3 {
		t.Fatalf("after a ping once the open time passed: breaker open %v, logged %v, %d store calls; want it closed without a probe",
			l.BreakerOpen(), got, s.calls.Load())
	}
}
