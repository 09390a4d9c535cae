package main

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/sluice-dev/sluice/internal/test/local"
)

// The binary serves Envoy's rate limit service on --rls-listen, as rendered Deployments run it:
// the health service answers SERVING, and a client's second call over a limit of 1 is OVER_LIMIT.
func TestEnforcerBinaryWhenRLSListenIsSetThenEnvoysAPIIsServed(t *testing.T) {
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(limitPolicy(1)), 0o600); err != nil {
		t.Fatal(err)
	}
	addr, err := local.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	runBinary(t, "--policy="+file, "--rls-listen="+addr)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	ctx := context.Background()
	h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: rlsv3.RateLimitService_ServiceDesc.ServiceName})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v, %v", h, err)
	}
	c := rlsv3.NewRateLimitServiceClient(conn)
	req := &rlsv3.RateLimitRequest{Domain: "test/watched", Descriptors: []*rlv3.RateLimitDescriptor{{
		Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "x-client", Value: "alice"}},
	}}}
	for i, want := range []rlsv3.RateLimitResponse_Code{rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT} {
		r, err := c.ShouldRateLimit(ctx, req)
		if err != nil || r.GetOverallCode() != want {
			t.Errorf("call %d: %v, %v; want %v", i, r.GetOverallCode(), err, want)
		}
	}
}
