package limiter_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// The refusal cache answers a refused client locally until the moment the store named, but never
// across a change of the rule: a limit raised from 1 to 3 admits the refused client at once.
func TestRefusalCacheWhenTheLimitIsRaisedThenARefusedClientIsAdmittedAtOnce(t *testing.T) {
	policy := func(limit string) string {
		return `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: raise, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: per-client
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: ` + limit + `, window: 1h}
`
	}
	s := redisStore(t, standaloneOptions(redistest.NewServer(t).Addr()))
	l := limiter.New(limiter.Options{Store: s, BreakerFailures: 3, BreakerOpen: time.Second, RefusalCache: true})
	set := func(limit string) {
		l.SetPolicies(policies(t, policy(limit)))
	}
	req := &limiter.Request{Method: "GET", Path: "/", Peer: netip.MustParseAddr("192.0.2.7")}
	ctx := context.Background()
	set("1")
	for i, want := range []limiter.Outcome{limiter.Allowed, limiter.Limited, limiter.Limited} {
		if got := l.Decide(ctx, req).Outcome; got != want {
			t.Fatalf("limit 1, request %d: %v, want %v", i, got, want)
		}
	}
	set("3")
	for i, want := range []limiter.Outcome{limiter.Allowed, limiter.Allowed, limiter.Limited} {
		if got := l.Decide(ctx, req).Outcome; got != want {
			t.Errorf("limit raised to 3, request %d: %v, want %v", i, got, want)
		}
	}
}
