package rls

import (
	"context"
	"testing"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluice-dev/sluice/enforcer/internal/config"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
)

// oneAdminPolicy limits /admin to one request a day.
const oneAdminPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: admin, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: admin
      match: {path: {type: Prefix, value: /admin}}
      fixedWindow: {limit: 1, window: 24h}
`

// A call Envoy gave up on (its timeout, 20 ms by default) is decided detached from it and
// charged, and counted as one whose client left.
func TestRLSWhenEnvoyGaveUpOnACallThenItIsDecidedChargedAndCountedApart(t *testing.T) {
	policies, _, err := config.Load([]byte(oneAdminPolicy))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{SweepInterval: -1}), Metrics: limiter.NewMetrics(reg)})
	l.SetPolicies(policies)
	s := &Server{Limiter: l}
	call := func(ctx context.Context) *rlsv3.RateLimitResponse {
		t.Helper()
		resp, err := s.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "test/admin", Descriptors: []*rlv3.RateLimitDescriptor{{
			Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "path", Value: "/admin"}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	if r := call(gone); r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Errorf("the call Envoy gave up on: %v, want OK: decided as any", r.GetOverallCode())
	}
	if r := call(context.Background()); r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Errorf("the next call: %v, want OVER_LIMIT: the first was charged the limit of 1", r.GetOverallCode())
	}
	if n := gathered(t, reg, "sluice_decisions_cancelled_total"); n != 1 {
		t.Errorf("sluice_decisions_cancelled_total = %v, want 1", n)
	}
}

// gathered is the value of a registered counter without labels.
func gathered(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no %s", name)
	return 0
}
