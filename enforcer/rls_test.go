package enforcer_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// rlsClient dials an enforcer's rate limit service with go-control-plane's generated client.
func rlsClient(t *testing.T, e *running) (rlsv3.RateLimitServiceClient, *grpc.ClientConn) {
	t.Helper()
	conn, err := grpc.NewClient(e.RLSAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return rlsv3.NewRateLimitServiceClient(conn), conn
}

func withRLS(c *enforcer.Config) { c.RLSListen = "127.0.0.1:0" }

// descriptor is a descriptor of key/value entries.
func descriptor(kv ...string) *rlv3.RateLimitDescriptor {
	d := &rlv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &rlv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

func shouldRateLimit(t *testing.T, c rlsv3.RateLimitServiceClient, domain string, ds ...*rlv3.RateLimitDescriptor) *rlsv3.RateLimitResponse {
	t.Helper()
	resp, err := c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: domain, Descriptors: ds})
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func header(resp *rlsv3.RateLimitResponse, name string) string {
	for _, h := range resp.GetResponseHeadersToAdd() {
		if strings.EqualFold(h.GetKey(), name) {
			return h.GetValue()
		}
	}
	return ""
}

const algorithmRules = `    - name: token
      match: {headers: [{name: X-Algo, value: token}]}
      key: [{type: RemoteAddress}]
      tokenBucket: {capacity: 3, refill: {tokens: 1, period: 1h}}
    - name: leaky
      match: {headers: [{name: X-Algo, value: leaky}]}
      key: [{type: RemoteAddress}]
      leakyBucket: {capacity: 3, drain: {requests: 1, period: 1h}, maxWait: 3h}
    - name: fixed
      match: {headers: [{name: X-Algo, value: fixed}]}
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 3, window: 1h}
    - name: log
      match: {headers: [{name: X-Algo, value: log}]}
      key: [{type: RemoteAddress}]
      slidingLog: {limit: 3, window: 1h}
    - name: counter
      match: {headers: [{name: X-Algo, value: counter}]}
      key: [{type: RemoteAddress}]
      slidingWindowCounter: {limit: 3, window: 1h}
`

// Over real gRPC, every algorithm admits its limit and refuses the next with OVER_LIMIT, the
// descriptor's status (limit, remaining, reset) and the IETF fields and Retry-After to add; a
// descriptor no rule matches is not limited; on memory and Redis.
func TestRLSWhenEnvoyAsksThenEveryAlgorithmDecidesWithStatusAndHeaders(t *testing.T) {
	for name, opts := range stores(t) {
		t.Run(name, func(t *testing.T) {
			e := start(t, policyDoc(name+"-rls", algorithmRules), nil, opts, withRLS)
			c, _ := rlsClient(t, e)
			domain := "test/" + name + "-rls"
			for _, algo := range []string{"token", "leaky", "fixed", "log", "counter"} {
				d := descriptor("remote_address", "192.0.2.10", "x-algo", algo)
				for i := range 3 {
					if r := shouldRateLimit(t, c, domain, d); r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
						t.Fatalf("%s: call %d: %v", algo, i, r.GetOverallCode())
					}
				}
				r := shouldRateLimit(t, c, domain, d)
				st := r.GetStatuses()
				if r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || len(st) != 1 || st[0].GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
					t.Fatalf("%s: fourth call %v, statuses %v; want OVER_LIMIT", algo, r.GetOverallCode(), st)
				}
				if l := st[0].GetCurrentLimit(); l.GetRequestsPerUnit() != 3 || l.GetName() != algo || st[0].GetLimitRemaining() != 0 || st[0].GetDurationUntilReset().AsDuration() <= 0 {
					t.Errorf("%s: status %v", algo, st[0])
				}
				if header(r, "Retry-After") == "" || !strings.HasPrefix(header(r, "RateLimit"), `"`+algo+`"`) || header(r, "RateLimit-Policy") == "" {
					t.Errorf("%s: headers to add %v", algo, r.GetResponseHeadersToAdd())
				}
			}
			if r := shouldRateLimit(t, c, domain, descriptor("remote_address", "192.0.2.10", "x-algo", "none")); r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
				t.Errorf("a descriptor no rule matches: %v, want OK", r.GetOverallCode())
			}
		})
	}
}

// Several descriptors in one call are decided together: when one refuses, none is charged;
// hits_addend multiplies the cost.
func TestRLSWhenOneDescriptorRefusesThenNoneIsCharged(t *testing.T) {
	for name, opts := range stores(t) {
		t.Run(name, func(t *testing.T) {
			e := start(t, policyDoc(name+"-rls-all", `    - name: per-tenant
      key: [{type: Header, name: X-Tenant}]
      fixedWindow: {limit: 10, window: 1h}
    - name: per-user
      key: [{type: Header, name: X-User}]
      fixedWindow: {limit: 1, window: 1h}
`), nil, opts, withRLS)
			c, _ := rlsClient(t, e)
			domain := "test/" + name + "-rls-all"
			tenant := func() *rlv3.RateLimitDescriptor { return descriptor("x-tenant", "acme") }
			shouldRateLimit(t, c, domain, descriptor("x-user", "ann")) // ann's one request
			for range 3 {
				r := shouldRateLimit(t, c, domain, tenant(), descriptor("x-user", "ann"))
				if r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || r.GetStatuses()[0].GetCode() != rlsv3.RateLimitResponse_OK {
					t.Fatalf("tenant and a refused user: %v", r)
				}
			}
			d := tenant()
			d.HitsAddend = wrapperspb.UInt64(4)
			r := shouldRateLimit(t, c, domain, d)
			if got := r.GetStatuses()[0].GetLimitRemaining(); r.GetOverallCode() != rlsv3.RateLimitResponse_OK || got != 6 {
				t.Errorf("after three refused calls and one of 4 hits: %v, %d remaining; want 6: the refused calls charged the tenant nothing", r.GetOverallCode(), got)
			}
		})
	}
}

// A descriptor's own hits_addend of 0 asks without charging (a gateway that charges later, as
// Envoy's apply_on_stream_done does): it passes until the limit is used up and past it is
// refused, and it charges nothing; the request's hits_addend of 0 is its default, 1.
func TestRLSWhenADescriptorsHitsAddendIsZeroThenItIsAskedNotCharged(t *testing.T) {
	for name, opts := range stores(t) {
		t.Run(name, func(t *testing.T) {
			e := start(t, policyDoc(name+"-rls-ask", algorithmRules), nil, opts, withRLS)
			c, _ := rlsClient(t, e)
			domain := "test/" + name + "-rls-ask"
			ask := func() *rlv3.RateLimitDescriptor {
				d := descriptor("remote_address", "192.0.2.20", "x-algo", "fixed")
				d.HitsAddend = wrapperspb.UInt64(0)
				return d
			}
			for i := range 5 {
				r := shouldRateLimit(t, c, domain, ask())
				if got := r.GetStatuses()[0].GetLimitRemaining(); r.GetOverallCode() != rlsv3.RateLimitResponse_OK || got != 3 {
					t.Fatalf("ask %d: %v, %d remaining; want OK and 3: an ask charges nothing", i, r.GetOverallCode(), got)
				}
			}
			for i := range 3 { // the request's hits_addend, 0, charges 1
				if r := shouldRateLimit(t, c, domain, descriptor("remote_address", "192.0.2.20", "x-algo", "fixed")); r.GetStatuses()[0].GetLimitRemaining() != uint32(2-i) {
					t.Fatalf("charge %d: %v", i, r)
				}
			}
			if r := shouldRateLimit(t, c, domain, ask()); r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
				t.Errorf("an ask at the limit, not past it: %v, want OK", r.GetOverallCode())
			}
			if r := shouldRateLimit(t, c, domain, descriptor("remote_address", "192.0.2.20", "x-algo", "fixed")); r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
				t.Errorf("a charge past the limit: %v, want OVER_LIMIT", r.GetOverallCode())
			}
		})
	}
}

// 1,000 concurrent calls against a limit of 100, spread over 3 enforcers sharing one Redis,
// admit exactly 100.
func TestRLSWhenThreeEnforcersShareRedisThenExactlyTheLimitPasses(t *testing.T) {
	opts := standalone(t)
	doc := policyDoc("rls-exact", `    - name: per-client
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 100, window: 1h}
`)
	var clients []rlsv3.RateLimitServiceClient
	for range 3 {
		c, _ := rlsClient(t, start(t, doc, nil, opts, withRLS))
		clients = append(clients, c)
	}
	var ok, over atomic.Int64
	var wg sync.WaitGroup
	for i := range 1000 {
		wg.Go(func() {
			r, err := clients[i%3].ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{
				Domain: "test/rls-exact", Descriptors: []*rlv3.RateLimitDescriptor{descriptor("remote_address", "198.51.100.7")}})
			switch {
			case err != nil:
				t.Error(err)
			case r.GetOverallCode() == rlsv3.RateLimitResponse_OK:
				ok.Add(1)
			default:
				over.Add(1)
			}
		})
	}
	wg.Wait()
	if ok.Load() != 100 || over.Load() != 900 {
		t.Errorf("%d OK, %d OVER_LIMIT; want exactly 100 and 900", ok.Load(), over.Load())
	}
}

// With Redis killed, a fail-open rule answers OK and a fail-closed one UNAVAILABLE, for Envoy's
// failure_mode_deny to decide; the health service says SERVING; an unknown domain is refused by
// name.
func TestRLSWhenRedisIsDownThenEachRuleAppliesItsFailureMode(t *testing.T) {
	srv := redistest.NewServer(t)
	e := start(t, policyDoc("rls-down", `    - name: catalogue
      match: {path: {type: Prefix, value: /catalogue}}
      fixedWindow: {limit: 100, window: 1h}
      failureMode: Open
    - name: payments
      match: {path: {type: Prefix, value: /payments}}
      fixedWindow: {limit: 100, window: 1h}
      failureMode: Closed
`), nil, &store.RedisOptions{Addrs: []string{srv.Addr()}, Timeout: 50 * time.Millisecond}, withRLS)
	c, conn := rlsClient(t, e)
	h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{Service: rlsv3.RateLimitService_ServiceDesc.ServiceName})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health: %v, %v", h, err)
	}
	if r := shouldRateLimit(t, c, "test/rls-down", descriptor("path", "/payments/1")); r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Fatalf("payments with Redis up: %v", r.GetOverallCode())
	}
	srv.Kill()
	for range 3 {
		if r := shouldRateLimit(t, c, "test/rls-down", descriptor("path", "/catalogue/1")); r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
			t.Errorf("the fail-open rule with Redis down: %v, want OK", r.GetOverallCode())
		}
		_, err := c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "test/rls-down", Descriptors: []*rlv3.RateLimitDescriptor{descriptor("path", "/payments/1")}})
		if status.Code(err) != codes.Unavailable {
			t.Errorf("the fail-closed rule with Redis down: %v, want UNAVAILABLE", err)
		}
		// Hits no limit holds are refused whatever the store's state: Redis down, the fail-open
		// rule admits nothing of them.
		over := descriptor("path", "/catalogue/1")
		over.HitsAddend = wrapperspb.UInt64(101)
		if r := shouldRateLimit(t, c, "test/rls-down", over); r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || header(r, "Retry-After") != "" {
			t.Errorf("hits 101 on the fail-open rule with Redis down: %v, Retry-After %q; want OVER_LIMIT without one", r.GetOverallCode(), header(r, "Retry-After"))
		}
	}
	// An unknown domain is refused, not an error that Envoy's default failure mode lets through.
	if r := shouldRateLimit(t, c, "test/other", descriptor("path", "/")); r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT ||
		!strings.Contains(string(r.GetRawBody()), `\"test/other\"`) {
		t.Errorf("an unknown domain: %v, body %q; want OVER_LIMIT naming it", r.GetOverallCode(), r.GetRawBody())
	}
}
