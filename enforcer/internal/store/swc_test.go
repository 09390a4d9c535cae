package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
)

// A sliding window counter of limit L admits L in every window to a client that keeps sending,
// in Go (memory) and in Lua (Redis) alike: the previous window's weight must not keep its last
// unit out. Before the fix a limit of 10 admitted 9, and a limit of 1 one request every other
// window.
func TestSlidingWindowCounterWhenAClientKeepsSendingThenEveryWindowAdmitsTheLimit(t *testing.T) {
	const windows = 12
	for _, target := range targets() {
		for _, limit := range []int64{1, 2, 10, 100} {
			for _, pace := range []int64{2, 4} { // requests per window, as multiples of the limit
				t.Run(fmt.Sprintf("%s when the limit is %d and the client sends %dx", target.name, limit, pace), func(t *testing.T) {
					start := time.Unix(1_700_000_040, 0) // a minute boundary
					clock := clocktesting.NewFakeClock(start)
					s := target.make(t, clock.Now)
					l := algorithm.Limit{Kind: algorithm.SlidingWindowCounter, Limit: limit, Period: time.Minute}
					checks := []store.Check{{Limit: l, Cost: 1, Enforce: true, Tag: uniqueTag(t, limit, pace), Rule: "r"}}
					out := make([]algorithm.Decision, 1)
					step := time.Minute / time.Duration(pace*limit)
					perWindow := make([]int64, windows)
					for i := range windows * int(pace*limit) {
						ok, err := s.Decide(context.Background(), checks, out)
						if err != nil {
							t.Fatal(err)
						}
						if ok {
							perWindow[i/int(pace*limit)]++
						}
						clock.Step(step)
					}
					for w, n := range perWindow {
						if n != limit {
							t.Errorf("window %d admitted %d, want %d (all windows: %v)", w, n, limit, perWindow)
							break
						}
					}
				})
			}
		}
	}
}
