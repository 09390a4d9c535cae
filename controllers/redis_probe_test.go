package controllers_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/controllers"
)

// Policies that name the same Redis share one probe: concurrent reconciles wait for the probe in
// flight, and its result serves them for the ttl; another address list is probed on its own.
func TestSharedProbeWhenManyPoliciesNameOneRedisThenItIsProbedOnce(t *testing.T) {
	var calls atomic.Int32
	down := errors.New("connection refused")
	clk := clocktesting.NewFakePassiveClock(time.Unix(1_700_000_000, 0))
	probe := controllers.SharedProbe(func(_ context.Context, addrs []string) error {
		calls.Add(1)
		if addrs[0] == "down:6379" {
			return down
		}
		return nil
	}, 300*time.Millisecond, clk)

	var wg sync.WaitGroup
	errs := make([]error, 50)
	for i := range errs {
		wg.Go(func() { errs[i] = probe(context.Background(), []string{"down:6379"}) })
	}
	wg.Wait()
	for i, err := range errs {
		if !errors.Is(err, down) {
			t.Fatalf("reconcile %d: %v, want the probe's error", i, err)
		}
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("50 concurrent reconciles probed %d times, want 1", n)
	}
	if err := probe(context.Background(), []string{"down:6379"}); !errors.Is(err, down) || calls.Load() != 1 {
		t.Errorf("within the ttl: %v after %d probes, want the cached error after 1", err, calls.Load())
	}
	if err := probe(context.Background(), []string{"up:6379"}); err != nil || calls.Load() != 2 {
		t.Errorf("another Redis: %v after %d probes, want nil after 2", err, calls.Load())
	}
	clk.SetTime(clk.Now().Add(299 * time.Millisecond))
	_ = probe(context.Background(), []string{"down:6379"})
	if calls.Load() != 2 {
		t.Errorf("just within the ttl: %d probes, want 2 (still cached)", calls.Load())
	}
	clk.SetTime(clk.Now().Add(time.Millisecond))
	_ = probe(context.Background(), []string{"down:6379"})
	if calls.Load() != 3 {
		t.Errorf("after the ttl: %d probes, want 3 (probed again)", calls.Load())
	}
}

// The shared probe runs with a context of its own: the reconcile that started it may be
// cancelled, and it alone stops waiting; the others get the probe's real answer, and that, not
// the cancellation, is what is reused.
func TestSharedProbeWhenTheFirstCallerIsCancelledThenTheOthersGetTheRealResult(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	clk := clocktesting.NewFakePassiveClock(time.Unix(1_700_000_000, 0))
	probe := controllers.SharedProbe(func(ctx context.Context, _ []string) error {
		if calls.Add(1) == 1 {
			close(started)
		}
		select { // a dial that a cancelled context ends
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}, time.Minute, clk)
	addrs := []string{"redis:6379"}

	first, cancel := context.WithCancel(context.Background())
	firstErr := make(chan error, 1)
	go func() { firstErr <- probe(first, addrs) }()
	<-started
	waiter := make(chan error, 1)
	go func() { waiter <- probe(context.Background(), addrs) }()
	cancel()
	if err := <-firstErr; !errors.Is(err, context.Canceled) {
		t.Errorf("the cancelled caller got %v, want its own cancellation", err)
	}
	close(release)
	if err := <-waiter; err != nil {
		t.Errorf("when the first caller is cancelled then another waiter gets %v, want the probe's nil", err)
	}
	if err := probe(context.Background(), addrs); err != nil || calls.Load() != 1 {
		t.Errorf("the cached result is %v after %d probes, want nil after 1", err, calls.Load())
	}
}

// Callers that arrive while a probe ends find its result: one that missed the cache just before
// the probe stored its result, and joined no flight since the flight had ended, does not probe
// again.
func TestSharedProbeWhenCallersArriveAsTheProbeEndsThenItIsProbedOnce(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(time.Unix(1_700_000_000, 0))
	for round := range 2000 {
		var calls atomic.Int32
		probe := controllers.SharedProbe(func(context.Context, []string) error {
			calls.Add(1)
			return nil
		}, time.Minute, clk)
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() { _ = probe(context.Background(), []string{"redis:6379"}) })
		}
		wg.Wait()
		if n := calls.Load(); n != 1 {
			t.Fatalf("round %d: 4 callers probed %d times, want 1", round, n)
		}
	}
}
