package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

const slidingLogPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: logs, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: small
      key: [{type: Header, name: X-Client}]
      match: {path: {value: /small}}
      slidingLog: {limit: 5, window: 1h}
    - name: large
      key: [{type: Header, name: X-Client}]
      match: {path: {value: /large}}
      slidingLog: {limit: 10000, window: 1h}
`

// rlsBinary runs the enforcer binary with the sliding-log policy, its RLS port and storeFlags.
func rlsBinary(t *testing.T, storeFlags ...string) (rlsv3.RateLimitServiceClient, string) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(slidingLogPolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	addr, err := local.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	_, admin := runBinary(t, append([]string{"--policy=" + file, "--rls-listen=" + addr}, storeFlags...)...)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return rlsv3.NewRateLimitServiceClient(conn), admin
}

func hitsRequest(client, path string, hits uint32) *rlsv3.RateLimitRequest {
	return &rlsv3.RateLimitRequest{Domain: "test/logs", HitsAddend: hits, Descriptors: []*rlv3.RateLimitDescriptor{{
		Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "x-client", Value: client}, {Key: "path", Value: path}},
	}}}
}

// One RLS call whose hits_addend takes a sliding log of 5 past its limit killed the binary on
// the memory store (index out of range), and on Redis failed in the script, a fault that the
// default failure mode Open admitted. It is OVER_LIMIT on both, and the binary keeps serving.
func TestEnforcerBinaryWhenHitsAddendExceedsASlidingLogThenOverLimitAndItKeepsServing(t *testing.T) {
	stores := map[string][]string{"memory": nil}
	if !tier.Fast() {
		stores["redis"] = []string{"--redis-url=redis://" + redistest.NewServer(t).Addr() + "/0"}
	}
	for name, flags := range stores {
		t.Run(name, func(t *testing.T) {
			c, admin := rlsBinary(t, flags...)
			ctx := context.Background()
			for _, hits := range []uint32{6, 1000, 1<<32 - 1} {
				r, err := c.ShouldRateLimit(ctx, hitsRequest("mallory", "/small", hits))
				if err != nil || r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
					t.Fatalf("hits %d: %v, %v; want OVER_LIMIT", hits, r.GetOverallCode(), err)
				}
			}
			if r, err := c.ShouldRateLimit(ctx, hitsRequest("mallory", "/small", 5)); err != nil || r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
				t.Errorf("hits 5 afterwards: %v, %v; want OK: nothing was charged", r.GetOverallCode(), err)
			}
			if n := scrape(admin, `sluice_store_errors_total{cause="fault"}`); n != 0 {
				t.Errorf("faults: %v, want 0", n)
			}
		})
	}
}

// hits_addend at a sliding log's limit with a fresh client key on every call took 80 KB per call
// on the memory store (2.4 GB in 6 s): one entry per unit. Now one entry per request: 3,000 such
// calls leave the binary's heap within a few megabytes of where it started.
func TestEnforcerBinaryWhenHitsAddendFillsFreshSlidingLogsThenTheHeapStaysSmall(t *testing.T) {
	c, admin := rlsBinary(t)
	ctx := context.Background()
	before := scrape(admin, "go_memstats_heap_inuse_bytes")
	for i := range 3000 {
		r, err := c.ShouldRateLimit(ctx, hitsRequest("fresh-"+strconv.Itoa(i), "/large", 10000))
		if err != nil || r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
			t.Fatalf("call %d: %v, %v", i, r.GetOverallCode(), err)
		}
	}
	after := scrape(admin, "go_memstats_heap_inuse_bytes")
	if grown := after - before; grown > 32<<20 {
		t.Errorf("the heap grew by %.0f MB over 3,000 calls (before one entry per request: 240 MB)", grown/(1<<20))
	}
	t.Logf("heap in use: %.1f MB before, %.1f MB after", before/(1<<20), after/(1<<20))
}
