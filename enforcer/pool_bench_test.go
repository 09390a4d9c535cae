package enforcer

import (
	"context"
	"fmt"
	"net"
	"testing"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/valyala/fasthttp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/front/check"
	"github.com/sluice-dev/sluice/enforcer/internal/front/rls"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/policy"
)

// poolPolicies compiles n one-rule policies bench/p0 ... bench/p<n-1>, as a pool holds them.
func poolPolicies(b *testing.B, n int) []*policy.Policy {
	b.Helper()
	out := make([]*policy.Policy, n)
	for i := range n {
		p, err := policy.Compile(&v1alpha1.RateLimitPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: fmt.Sprintf("p%d", i)},
			Spec: v1alpha1.RateLimitPolicySpec{
				TargetRef: v1alpha1.TargetRef{Name: "api", Port: 80},
				Rules: []v1alpha1.Rule{{Name: "per-client", Key: []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("X-Client")}},
					FixedWindow: &v1alpha1.Window{Limit: 1_000_000_000, Window: "1h"}}},
			},
		})
		if err != nil {
			b.Fatal(err)
		}
		out[i] = p
	}
	return out
}

// BenchmarkPoolDecision is one decision of the check API (by path) and of the rate limit
// service (by domain), for the same policy and client, with 10 and with 10,000 policies loaded,
// on the memory store: a decision finds its policy by ID, so its cost does not grow with the
// policies a pool serves (issue 30: within 10%).
//
//	go test -run '^$' -bench PoolDecision -benchtime 2s -count 5 ./enforcer/
func BenchmarkPoolDecision(b *testing.B) {
	for _, n := range []int{10, 10_000} {
		ps := poolPolicies(b, n)
		l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{})})
		l.SetPolicies(ps)
		b.Run(fmt.Sprintf("check/policies=%d", n), func(b *testing.B) {
			c := &check.API{Limiter: l, Pool: true}
			var req fasthttp.Request
			req.SetRequestURI("/policies/bench/p5/forward-auth")
			req.Header.Set("X-Forwarded-Method", "GET")
			req.Header.Set("X-Forwarded-Uri", "/orders/1")
			req.Header.Set("X-Client", "client-1")
			var ctx fasthttp.RequestCtx
			ctx.Init(&req, &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 40000}, nil)
			b.ReportAllocs()
			for b.Loop() {
				ctx.Response.Reset()
				c.Serve(&ctx)
				if ctx.Response.StatusCode() != fasthttp.StatusOK {
					b.Fatalf("status %d: %s", ctx.Response.StatusCode(), ctx.Response.Body())
				}
			}
		})
		b.Run(fmt.Sprintf("rls/policies=%d", n), func(b *testing.B) {
			s := &rls.Server{Limiter: l}
			req := &rlsv3.RateLimitRequest{Domain: "bench/p5", Descriptors: []*rlv3.RateLimitDescriptor{{Entries: []*rlv3.RateLimitDescriptor_Entry{
				{Key: "x-client", Value: "client-1"}, {Key: EntryRemoteAddress, Value: "10.0.0.1"}}}}}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				resp, err := s.ShouldRateLimit(ctx, req)
				if err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
					b.Fatalf("%v %v", resp.GetOverallCode(), err)
				}
			}
		})
	}
}
