// Package poll is the tests' one way to wait for a condition that has no channel to wait on: it
// checks again, soon at first and then less often, until the condition holds or time is up.
package poll

import (
	"fmt"
	"testing"
	"time"
)

// Until calls f until it returns nil and returns nil, or returns f's last error once timeout has
// passed. The first retry comes after a millisecond, and the pause doubles up to 100 ms, so a
// condition that holds soon is seen soon and a slow one costs little.
func Until(timeout time.Duration, f func() error) error {
	return Every(100*time.Millisecond, timeout, f)
}

// Every is Until with pauses that grow up to most rather than 100 ms: for a condition that is
// costly to check, such as a list of a thousand objects while a benchmark measures the API
// server.
func Every(most, timeout time.Duration, f func() error) error {
	deadline := time.Now().Add(timeout)
	pause := min(time.Millisecond, most)
	for {
		err := f()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after %v: %w", timeout, err)
		}
		<-time.After(pause)
		pause = min(2*pause, most)
	}
}

// WaitFor is Until that fails the test with f's last error.
func WaitFor(t testing.TB, timeout time.Duration, f func() error) {
	t.Helper()
	if err := Until(timeout, f); err != nil {
		t.Fatal(err)
	}
}

// True adapts a condition to Until and WaitFor: its error says what has not happened yet.
func True(what string, cond func() bool) func() error {
	return func() error {
		if cond() {
			return nil
		}
		return fmt.Errorf("%s: not yet", what)
	}
}
