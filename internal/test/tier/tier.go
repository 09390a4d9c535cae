// Package tier tells the fast test tier from the full one. `make test-unit` (go test -short) runs
// only the tests that need neither the control plane, nor redis-server, nor a built binary;
// `make test`, which CI runs, runs them all.
package tier

import (
	"os"
	"testing"
)

// Fast reports whether this is the fast tier. In a TestMain, call flag.Parse first.
func Fast() bool { return testing.Short() }

// Needs skips t in the fast tier: it needs what, which only the full tier provides.
func Needs(t testing.TB, what string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("needs %s: make test runs it", what)
	}
}

// RunFast runs m without its environment in the fast tier, and exits; in the full tier it
// returns, and TestMain goes on to start what the tests need.
func RunFast(m *testing.M) {
	if testing.Short() {
		os.Exit(m.Run())
	}
}
