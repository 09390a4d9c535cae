package main

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/redistest"
)

const skewPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: skew, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  defaultFailureMode: Closed
  rules:
    - name: fixed
      match: {path: {value: /fixed}}
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: 100, window: 20s}
    - name: counter
      match: {path: {value: /counter}}
      key: [{type: Header, name: X-Client}]
      slidingWindowCounter: {limit: 100, window: 20s}
`

// Three enforcers on one Redis whose own clocks are 40 s apart, two 20 s windows: were any
// decision made on the enforcer's clock, each would count in another window and together they
// would admit up to three times the limit. Decisions use Redis TIME, so the limit is exact.
func TestEnforcerBinariesWhenTheirClocksDisagreeThenRedisTimeKeepsTheLimitExact(t *testing.T) {
	srv := redistest.NewServer(t)
	var enforcers []*enforcerProcess
	for _, offset := range []string{"-40s", "0s", "40s"} {
		enforcers = append(enforcers, startEnforcerWith(t, skewPolicy, "--redis-url=redis://"+srv.Addr()+"/0", "--redis-timeout=2s", "--test-clock-offset="+offset))
	}
	// Stay inside one window of Redis's clock: start at least 2 s after a boundary, with 12 s
	// to go.
	rdb := srv.Client(t)
	for {
		now, err := rdb.Time(context.Background()).Result()
		if err != nil {
			t.Fatal(err)
		}
		if into := now.Sub(now.Truncate(20 * time.Second)); into >= 2*time.Second && into <= 8*time.Second {
			break
		}
		time.Sleep(200 * time.Millisecond)
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
			t.Errorf("%s: three enforcers with clocks 40 s apart admitted %d of 300, want exactly 100", path, admitted)
		}
	}
}
