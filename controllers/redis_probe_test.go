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
