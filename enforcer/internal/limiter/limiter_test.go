package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

// fakeStore answers every decision with err, or with the decisions refuse gives each check:
// refused until now + RetryAfter when refuse returns a positive duration.
type fakeStore struct {
	mu     sync.Mutex
	calls  int
	err    error
	refuse func(c *store.Check) time.Duration
}

func (f *fakeStore) Decide(_ context.Context, checks []store.Check, out []algorithm.Decision) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.err != nil {
		return false, f.err
	}
	charged := true
	for i := range checks {
		d := algorithm.Decision{Allowed: true, Limit: checks[i].Limit.Limit, Remaining: 1}
		if f.refuse != nil {
			if retry := f.refuse(&checks[i]); retry > 0 {
				d = algorithm.Decision{Limit: checks[i].Limit.Limit, RetryAfter: retry, Reset: retry}
				charged = charged && !checks[i].Enforce
			}
		}
		out[i] = d
	}
	return charged, nil
}

func (f *fakeStore) Finish(context.Context, []store.Check, []algorithm.Decision) error { return f.err }
func (f *fakeStore) Renew(context.Context, []store.Check, []algorithm.Decision) error  { return f.err }
func (f *fakeStore) Ping(context.Context) error                                        { return nil }
func (f *fakeStore) Close() error                                                      { return nil }

func (f *fakeStore) called() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// newClock is a fake clock for the limiter's Now.
func newClock() *clocktesting.FakeClock {
	return clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
}

func policies(t *testing.T, doc string) []*policy.Policy {
	t.Helper()
	ps, _, err := enforcer.Load([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

const twoRules = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: unit, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  trustedProxies: ["10.0.0.0/8"]
  rules:
    - name: open
      match: {path: {value: /open}}
      key: [{type: RemoteAddress}]
      failureMode: Open
      fixedWindow: {limit: %[1]d, window: 1h}
    - name: closed
      match: {path: {value: /closed}}
      key: [{type: RemoteAddress}]
      failureMode: Closed
      fixedWindow: {limit: %[1]d, window: 1h}
`

func request(path, peer string, header ...string) *limiter.Request {
	h := http.Header{}
	for i := 0; i+1 < len(header); i += 2 {
		h.Set(header[i], header[i+1])
	}
	return &limiter.Request{Method: "GET", Path: path, Header: h, Peer: netip.MustParseAddr(peer)}
}

// A refusal is answered locally until the moment the store named, for the same client and rule,
// and the same or a higher cost; then, or after the rule changes, the store is asked again.
func TestLimiterWhenTheStoreRefusedThenTheCacheAnswersUntilRetryAfter(t *testing.T) {
	fs := &fakeStore{refuse: func(*store.Check) time.Duration { return 10 * time.Second }}
	clk := newClock()
	l := limiter.New(limiter.Options{Store: fs, RefusalCache: true, Now: clk.Now})
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 5)))
	ctx := context.Background()

	if res := l.Decide(ctx, request("/open", "192.0.2.1")); res.Outcome != limiter.Limited || res.RetryAfter != 10*time.Second {
		t.Fatalf("first: %+v, want Limited for 10s", res)
	}
	clk.Step(4 * time.Second)
	if res := l.Decide(ctx, request("/open", "192.0.2.1")); res.Outcome != limiter.Limited || res.RetryAfter != 6*time.Second || fs.called() != 1 {
		t.Errorf("4s later: %+v after %d store calls, want Limited for the 6s left, from the cache", res, fs.called())
	}
	l.Decide(ctx, request("/open", "192.0.2.2"))   // another client
	l.Decide(ctx, request("/closed", "192.0.2.1")) // another rule
	if n := fs.called(); n != 3 {
		t.Errorf("store calls = %d, want 3: another client and another rule are not in the cache", n)
	}
	clk.Step(6 * time.Second)
	l.Decide(ctx, request("/open", "192.0.2.1"))
	if n := fs.called(); n != 4 {
		t.Errorf("store calls = %d at retry-after, want the store asked again", n)
	}
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 6))) // the rule changed
	l.Decide(ctx, request("/open", "192.0.2.1"))
	if n := fs.called(); n != 5 {
		t.Errorf("store calls = %d after the limit changed, want the store asked again", n)
	}
}

// Requests decided together (Envoy's descriptors) read the refusal cache as one request does: a
// call with a descriptor the store refused is answered locally until the moment it named, the
// refused descriptor over its limit and the others not charged; a call without it asks the store.
func TestLimiterWhenRequestsDecidedTogetherWereRefusedThenTheCacheAnswersUntilRetryAfter(t *testing.T) {
	var closed string // the state key of rule closed, which the store refuses
	fs := &fakeStore{refuse: func(c *store.Check) time.Duration {
		if c.Rule == closed {
			return 10 * time.Second
		}
		return 0
	}}
	clk := newClock()
	l := limiter.New(limiter.Options{Store: fs, RefusalCache: true, Now: clk.Now})
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 5)))
	closed = l.Policies()[0].Rules[1].StateKey
	ctx := context.Background()
	both := []limiter.Request{*request("/open", "192.0.2.1"), *request("/closed", "192.0.2.1")}

	if _, all := l.DecideAll(ctx, both); all.Outcome != limiter.Limited || all.RetryAfter != 10*time.Second || fs.called() != 1 {
		t.Fatalf("first: %+v after %d store calls, want Limited for 10s by the store", all, fs.called())
	}
	clk.Step(4 * time.Second)
	per, all := l.DecideAll(ctx, both)
	if all.Outcome != limiter.Limited || all.RetryAfter != 6*time.Second || fs.called() != 1 {
		t.Errorf("4s later: %+v after %d store calls, want Limited for the 6s left, from the cache", all, fs.called())
	}
	if per[0].Outcome != limiter.Allowed || per[1].Outcome != limiter.Limited || per[1].Rule == nil || per[1].Rule.Name != "closed" {
		t.Errorf("4s later, each request: %+v, %+v; want the first not refused and the second refused by rule closed", per[0], per[1])
	}
	if _, all := l.DecideAll(ctx, both[:1]); all.Outcome != limiter.Allowed || fs.called() != 2 {
		t.Errorf("the first request alone: %+v after %d store calls, want Allowed by the store", all, fs.called())
	}
	clk.Step(6 * time.Second)
	l.DecideAll(ctx, both)
	if n := fs.called(); n != 3 {
		t.Errorf("store calls = %d at retry-after, want the store asked again", n)
	}
}

// While the store cannot answer, each rule applies its own failure mode; after three failures in
// a row the breaker stops asking the store. A decision's own fault does not count.
func TestLimiterWhenTheStoreFailsThenFailureModesApplyAndTheBreakerOpens(t *testing.T) {
	for _, c := range []struct {
		name      string
		err       error
		wantCalls int
	}{
		{"when the store is unavailable then the breaker opens after 3", errors.New("dial tcp: connection refused"), 3},
		{"when decisions fault then the breaker stays closed", fmt.Errorf("%w: WRONGTYPE", store.ErrFault), 10},
	} {
		t.Run(c.name, func(t *testing.T) {
			fs := &fakeStore{err: c.err}
			l := limiter.New(limiter.Options{Store: fs, BreakerFailures: 3, BreakerOpen: time.Hour})
			l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 5)))
			ctx := context.Background()
			for i := range 10 {
				path, want := "/open", limiter.Allowed
				if i%2 == 1 {
					path, want = "/closed", limiter.Unavailable
				}
				if res := l.Decide(ctx, request(path, "192.0.2.1")); res.Outcome != want {
					t.Fatalf("request %d to %s: %v, want %v", i, path, res.Outcome, want)
				}
			}
			if n := fs.called(); n != c.wantCalls {
				t.Errorf("store calls = %d of 10, want %d", n, c.wantCalls)
			}
		})
	}
}

// The client is the peer, or, behind a trusted proxy, the last untrusted address of
// X-Forwarded-For; a spoofed header from an untrusted peer changes nothing.
func TestLimiterWhenBehindProxiesThenTheClientIsTheFirstUntrustedAddress(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]bool{}
	fs := &fakeStore{refuse: func(c *store.Check) time.Duration {
		mu.Lock()
		defer mu.Unlock()
		seen[c.Tag] = true
		return 0
	}}
	l := limiter.New(limiter.Options{Store: fs})
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 5)))
	ctx := context.Background()
	tagOf := func(req *limiter.Request) string {
		mu.Lock()
		clear(seen)
		mu.Unlock()
		l.Decide(ctx, req)
		for tag := range seen {
			return tag
		}
		return ""
	}
	direct := tagOf(request("/open", "198.51.100.7"))
	viaProxy := tagOf(request("/open", "10.0.0.1", "X-Forwarded-For", "203.0.113.9, 198.51.100.7"))
	spoofed := tagOf(request("/open", "198.51.100.7", "X-Forwarded-For", "203.0.113.9"))
	if viaProxy != direct {
		t.Error("behind a trusted proxy the client is not the address the proxy saw")
	}
	if spoofed != direct {
		t.Error("an untrusted peer's X-Forwarded-For changed the client")
	}
	if other := tagOf(request("/open", "198.51.100.8")); other == direct {
		t.Error("two clients share a key")
	}
}

// The breaker, on the limiter's clock: open after 3 consecutive failures, a second later one probe
// reaches the store; a failed probe opens it again for a second, a successful one closes it. The
// log has one line when it opens, naming the failure, and one when it closes: none for a failed
// probe, which comes every second while Redis is down.
func TestLimiterWhenTheStoreFailsAndRecoversThenTheBreakerOpensProbesAndCloses(t *testing.T) {
	fs := &fakeStore{err: errors.New("dial tcp: connection refused")}
	clk := newClock()
	var logMu sync.Mutex
	var logged []string
	log := funcr.New(func(_, args string) {
		logMu.Lock()
		defer logMu.Unlock()
		logged = append(logged, args)
	}, funcr.Options{})
	lines := func() []string {
		logMu.Lock()
		defer logMu.Unlock()
		return slices.Clone(logged)
	}
	l := limiter.New(limiter.Options{Store: fs, BreakerFailures: 3, BreakerOpen: time.Second, Now: clk.Now, Log: log})
	l.SetPolicies(policies(t, fmt.Sprintf(twoRules, 5)))
	ctx := context.Background()
	decide := func(n int) {
		t.Helper()
		for range n {
			l.Decide(ctx, request("/open", "192.0.2.1"))
		}
	}
	step := func(what string, wantCalls int, wantOpen bool) {
		t.Helper()
		if got := fs.called(); got != wantCalls || l.BreakerOpen() != wantOpen {
			t.Fatalf("%s: %d store calls, breaker open %v; want %d and %v", what, got, l.BreakerOpen(), wantCalls, wantOpen)
		}
	}
	decide(2)
	step("two failures", 2, false)
	if got := lines(); len(got) != 0 {
		t.Fatalf("logged before the breaker opened: %q", got)
	}
	decide(5)
	step("the third failure opens it; the next four skip the store", 3, true)
	if got := lines(); len(got) != 1 || !strings.Contains(got[0], `"msg"="The store circuit breaker opened`) ||
		!strings.Contains(got[0], `"error"="dial tcp: connection refused"`) || !strings.Contains(got[0], `"failures"=3`) {
		t.Fatalf("logged when the breaker opened: %q; want one line naming the failure", got)
	}
	clk.Step(999 * time.Millisecond)
	decide(3)
	step("still open a millisecond before the second ends", 3, true)
	clk.Step(time.Millisecond)
	decide(3)
	step("one probe after the second; it fails and opens the breaker again", 4, true)
	if got := lines(); len(got) != 1 {
		t.Fatalf("a failed probe logged: %q", got[1:])
	}
	clk.Step(time.Second)
	fs.mu.Lock()
	fs.err = nil
	fs.mu.Unlock()
	if res := l.Decide(ctx, request("/closed", "192.0.2.1")); res.Outcome != limiter.Allowed {
		t.Fatalf("the successful probe: %v, want Allowed", res.Outcome)
	}
	step("the probe succeeds and closes it", 5, false)
	if got := lines(); len(got) != 2 || !strings.Contains(got[1], `"msg"="The store circuit breaker closed`) {
		t.Fatalf("logged when the breaker closed: %q; want one more line saying so", got)
	}
	decide(4)
	step("closed: every decision reaches the store", 9, false)
}

// Several requests decided together (Envoy's descriptors) report, when all are admitted, the
// rule closest to its limit, as one request's admission does: not the first request's, which may
// match no rule at all while the others were charged.
func TestLimiterWhenRequestsDecidedTogetherAreAdmittedThenTheRuleClosestToItsLimitIsReported(t *testing.T) {
	l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{SweepInterval: -1})})
	l.SetPolicies(policies(t, `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: unit, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: small
      match: {path: {value: /small}}
      fixedWindow: {limit: 4, window: 1h}
    - name: large
      match: {path: {value: /large}}
      fixedWindow: {limit: 100, window: 1h}
`))
	ctx := context.Background()
	for _, tc := range []struct {
		paths []string
		want  string
	}{
		{[]string{"/none", "/large"}, "large"},
		{[]string{"/none", "/large", "/small"}, "small"},  // 3 of 4 left against 98 of 100
		{[]string{"/small", "/large"}, "small"},           // 2 of 4 left against 97 of 100
		{[]string{"/large", "/large", "/large"}, "large"}, // one rule, charged 3 at once
	} {
		var reqs []limiter.Request
		for _, p := range tc.paths {
			reqs = append(reqs, *request(p, "192.0.2.1"))
		}
		_, all := l.DecideAll(ctx, reqs)
		if all.Outcome != limiter.Allowed || all.Rule == nil || all.Rule.Name != tc.want {
			t.Errorf("%v: %+v, want admitted, describing rule %s", tc.paths, all, tc.want)
		}
	}
}
