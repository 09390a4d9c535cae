package panics

import (
	"strings"
	"testing"

	"github.com/go-logr/logr/funcr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Every contained panic is counted, and only the first of a minute is logged, with its stack: a
// client that can make a request panic cannot also flood the log.
func TestPanicsWhenManyAreRecoveredThenEachIsCountedAndOneAMinuteLogged(t *testing.T) {
	var logged []string
	log := funcr.New(func(_, args string) { logged = append(logged, args) }, funcr.Options{})
	p := New(prometheus.NewRegistry(), log)
	for range 100 {
		p.recovered("proxy", "boom")
	}
	if n := testutil.ToFloat64(p.count.WithLabelValues("proxy")); n != 100 {
		t.Errorf("counted %v panics, want 100", n)
	}
	if len(logged) != 1 {
		t.Fatalf("%d log lines, want 1", len(logged))
	}
	if want := "panics_test.go"; !containsAll(logged[0], "boom", "stack", want) {
		t.Errorf("the log line %q lacks the panic, its stack or where it came from", logged[0])
	}
	p.logged.Add(-int64(61e9)) // a minute later
	p.recovered("proxy", "again")
	if len(logged) != 2 {
		t.Errorf("%d log lines a minute later, want 2", len(logged))
	}
}

func containsAll(s string, parts ...string) bool {
	for _, part := range parts {
		if !strings.Contains(s, part) {
			return false
		}
	}
	return true
}
