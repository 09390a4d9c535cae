package main

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// skewPolicy has two rules whose windows last window: a whole number of seconds.
func skewPolicy(window time.Duration) string {
	return fmt.Sprintf(`apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: skew, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  defaultFailureMode: Closed
  rules:
    - name: fixed
      match: {path: {value: /fixed}}
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: 100, window: %[1]ds}
    - name: counter
      match: {path: {value: /counter}}
      key: [{type: Header, name: X-Client}]
      slidingWindowCounter: {limit: 100, window: %[1]ds}
`, int(window.Seconds()))
}

// Three enforcers on one Redis whose own clocks are two windows apart: were any decision made
// on the enforcer's clock, each would count in another window and together they would admit up
// to three times the limit. Decisions use Redis TIME, so the limit is exact.
//
// The test runs inside one window of Redis's clock without waiting for a boundary: windows
// begin at multiples of their length since the Unix epoch, so of the lengths from 20 s to 60 s
// it takes the one that began at least 2 s ago and has the most time left.
func TestEnforcerBinariesWhenTheirClocksDisagreeThenRedisTimeKeepsTheLimitExact(t *testing.T) {
	// Built before the window is chosen: a cold build takes minutes, the window seconds.
	binary(t)
	srv := redistest.NewServer(t)
	rdb := srv.Client(t)
	redisNow := func() time.Time {
		t.Helper()
		now, err := rdb.Time(context.Background()).Result()
		if err != nil {
			t.Fatal(err)
		}
		return now
	}
	into := func(now time.Time, window time.Duration) time.Duration {
		return time.Duration(now.UnixMicro()%window.Microseconds()) * time.Microsecond
	}
	now := redisNow()
	var window, left time.Duration
	for w := 20 * time.Second; w <= 60*time.Second; w += time.Second {
		if in := into(now, w); in >= 2*time.Second && w-in > left {
			window, left = w, w-in
		}
	}
	if left < 12*time.Second {
		t.Fatalf("no window of 20-60 s began 2 s ago with 12 s to go at %v", now)
	}
	var enforcers []*enforcerProcess
	for _, offset := range []time.Duration{-2 * window, 0, 2 * window} {
		enforcers = append(enforcers, startEnforcerWith(t, skewPolicy(window), "--redis-url=redis://"+srv.Addr()+"/0", "--redis-timeout=2s", "--test-clock-offset="+offset.String()))
	}
	// Started within the window, with time to go.
	if later := redisNow(); later.Sub(now) > left-8*time.Second {
		t.Fatalf("starting three enforcers took %v of the %v left in the %v window", later.Sub(now), left, window)
	}
	for _, path := range []string{"/fixed", "/counter"} {
		var mu sync.Mutex
		admitted := 0
		var wg sync.WaitGroup
		for _, e := range enforcers {
			wg.Go(func() {
				n := e.sendTo(path, "skewed", 100, 16)[http.StatusOK]
				mu.Lock()
				admitted += n
				mu.Unlock()
			})
		}
		wg.Wait()
		if admitted != 100 {
			t.Errorf("%s: three enforcers with clocks %v apart (windows of %v) admitted %d of 300, want exactly 100", path, 2*window, window, admitted)
		}
	}
}
