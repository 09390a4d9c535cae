package crd_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// The bounds that moved from Go into the schema admit what is at them; one past each is refused
// by the corpus of test/testdata/invalid (sliding-log-limit-above-10000, redis-address-port-*,
// managed-redis-zero-memory, concurrency-*, charge-*, cost-from-*, lease-*).
func TestSchemaBoundsWhenAtTheirEdgeThenAccepted(t *testing.T) {
	ns := testenv.Namespace(t, k8s, "schema-bounds")
	fixed := []v1alpha1.Rule{{Name: "a", FixedWindow: &v1alpha1.Window{Limit: 10, Window: "1s"}}}
	redis := func(addr v1alpha1.HostPort) *v1alpha1.Storage {
		return &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Mode: v1alpha1.RedisStandalone, Addresses: []v1alpha1.HostPort{addr}}}
	}
	cases := []struct {
		name    string
		rules   []v1alpha1.Rule
		storage *v1alpha1.Storage
	}{
		{"when a sliding log's limit is 10000", []v1alpha1.Rule{{Name: "a", SlidingLog: &v1alpha1.Window{Limit: 10_000, Window: "1h"}}}, nil},
		{"when a Redis address's port is 65535", fixed, redis("redis.example:65535")},
		{"when a Redis address's port is 1", fixed, redis("[fd00::1]:1")},
		{"when a managed Redis has one byte of memory", fixed, &v1alpha1.Storage{ManagedRedis: &v1alpha1.ManagedRedis{MaxMemory: ptr.To(resource.MustParse("1"))}}},
		{"when a concurrency limit is 10000 and its lease 1h", []v1alpha1.Rule{{Name: "a", Concurrency: &v1alpha1.Concurrency{Limit: 10_000, LeaseTimeout: ptr.To[v1alpha1.Duration]("1h")}}}, nil},
		{"when a concurrency limit is 1 and its lease 1s", []v1alpha1.Rule{{Name: "a", Cost: ptr.To[int64](1), Concurrency: &v1alpha1.Concurrency{Limit: 1, LeaseTimeout: ptr.To[v1alpha1.Duration]("1s")}}}, nil},
		{"when costFrom.max is the rule's limit and 16 statuses are charged", []v1alpha1.Rule{{Name: "a", TokenBucket: &v1alpha1.TokenBucket{Capacity: 1000, Refill: v1alpha1.TokenRefill{Tokens: 10, Period: "1s"}},
			Charge:   &v1alpha1.Charge{When: v1alpha1.ChargeWhenResponse, Statuses: []v1alpha1.StatusPattern{"1xx", "2xx", "3xx", "4xx", "5xx", "100", "199", "200", "401", "403", "429", "500", "502", "503", "504", "599"}},
			CostFrom: &v1alpha1.CostFrom{ResponseHeader: v1alpha1.HeaderName(strings.Repeat("X", 256)), Max: 1000}}}, nil},
		{"when costFrom.max is a billion", []v1alpha1.Rule{{Name: "a", SlidingWindowCounter: &v1alpha1.Window{Limit: 1_000_000_000, Window: "1h"},
			Charge: &v1alpha1.Charge{When: v1alpha1.ChargeWhenResponse}, CostFrom: &v1alpha1.CostFrom{ResponseHeader: "X-Tokens-Used", Max: 1_000_000_000}}}, nil},
		{"when a lease's max is 2 and its expiry 100ms", []v1alpha1.Rule{{Name: "a", TokenBucket: &v1alpha1.TokenBucket{Capacity: 100, Refill: v1alpha1.TokenRefill{Tokens: 10, Period: "1s"}},
			Lease: &v1alpha1.Lease{Max: 2, Expiry: ptr.To[v1alpha1.Duration]("100ms")}}}, redis("redis.example:6379")},
		{"when a lease's max is a million, a window's limit, and its expiry 1m", []v1alpha1.Rule{{Name: "a", FixedWindow: &v1alpha1.Window{Limit: 1_000_000, Window: "1h"},
			Lease: &v1alpha1.Lease{Max: 1_000_000, Expiry: ptr.To[v1alpha1.Duration]("1m")}}}, redis("redis.example:6379")},
		{"when a lease's max is the bucket's capacity and the rule is charged on the request", []v1alpha1.Rule{{Name: "a", TokenBucket: &v1alpha1.TokenBucket{Capacity: 10, Refill: v1alpha1.TokenRefill{Tokens: 10, Period: "1s"}},
			Mode: v1alpha1.ModeEnforce, Charge: &v1alpha1.Charge{When: v1alpha1.ChargeWhenRequest}, Lease: &v1alpha1.Lease{Max: 10}}}, redis("redis.example:6379")},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := &v1alpha1.RateLimitPolicy{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: fmt.Sprintf("edge-%d", i)},
				Spec:       v1alpha1.RateLimitPolicySpec{TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080}, Rules: c.rules, Storage: c.storage},
			}
			if err := k8s.Create(context.Background(), p); err != nil {
				t.Fatal(err)
			}
		})
	}
}
