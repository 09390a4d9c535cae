package limiter_test

import (
	"context"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// A decision that fails for a fault of its own (here a key of the wrong type, as a bug or an
// operator's hand could leave) is not an outage: the rule applies its failure mode, the fault is
// counted under its own cause and logged once with the rule's name, and the breaker stays closed,
// so every other rule and client is still decided by Redis.
func TestLimiterWhenADecisionFaultsThenOnlyItsRuleAppliesItsFailureMode(t *testing.T) {
	srv := redistest.NewServer(t)
	rdb := srv.Client(t)
	ps := policies(t, `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: faults, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  defaultFailureMode: Closed
  rules:
    - name: broken
      match: {path: {value: /broken}}
      slidingLog: {limit: 100, window: 1h}
    - name: fine
      match: {path: {value: /fine}}
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 3, window: 1h}
`)
	reg := prometheus.NewRegistry()
	var logged atomic.Int64
	log := funcr.New(func(_, args string) {
		if strings.Contains(args, `"rule"="broken"`) {
			logged.Add(1)
		}
	}, funcr.Options{})
	s := redisStore(t, standaloneOptions(srv.Addr()))
	l := limiter.New(limiter.Options{Store: s, Metrics: limiter.NewMetrics(reg), BreakerFailures: 3, BreakerOpen: time.Minute, RefusalCache: true, Log: log})
	l.SetPolicies(ps)
	ctx := context.Background()
	req := func(path, peer string) *limiter.Request {
		return &limiter.Request{Method: "GET", Path: path, Peer: netip.MustParseAddr(peer)}
	}

	if res := l.Decide(ctx, req("/broken", "192.0.2.1")); res.Outcome != limiter.Allowed {
		t.Fatalf("first request: %v", res.Outcome)
	}
	keys, err := rdb.Keys(ctx, "sl{*}"+ps[0].Rules[0].StateKey).Result()
	if err != nil || len(keys) != 1 {
		t.Fatalf("keys of the broken rule: %v (%v)", keys, err)
	}
	if err := rdb.Set(ctx, keys[0], "not a sorted set", time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if res := l.Decide(ctx, req("/broken", "192.0.2.1")); res.Outcome != limiter.Unavailable || res.Rule.Name != "broken" {
			t.Fatalf("faulty request %d: outcome %v, want Unavailable from the fail-closed rule", i, res.Outcome)
		}
	}
	for _, peer := range []string{"192.0.2.1", "192.0.2.2"} {
		var allowed int
		for range 5 {
			switch res := l.Decide(ctx, req("/fine", peer)); res.Outcome {
			case limiter.Allowed:
				allowed++
			case limiter.Unavailable:
				t.Fatalf("client %s: the fine rule answered Unavailable; the fault opened the breaker", peer)
			}
		}
		if allowed != 3 {
			t.Errorf("client %s: the fine rule admitted %d of 5, want exactly 3", peer, allowed)
		}
	}
	if n := metric(t, reg, "sluice_store_breaker_open", "", ""); n != 0 {
		t.Errorf("breaker open = %v, want 0", n)
	}
	if n := metric(t, reg, "sluice_store_errors_total", "cause", "fault"); n != 10 {
		t.Errorf(`sluice_store_errors_total{cause="fault"} = %v, want 10`, n)
	}
	if n := metric(t, reg, "sluice_store_errors_total", "cause", "unavailable"); n != 0 {
		t.Errorf(`sluice_store_errors_total{cause="unavailable"} = %v, want 0`, n)
	}
	if n := logged.Load(); n != 1 {
		t.Errorf("the broken rule was logged %d times, want once", n)
	}
}

func standaloneOptions(addr string) store.RedisOptions {
	return store.RedisOptions{Addrs: []string{addr}, Timeout: 2 * time.Second}
}

// metric reads the series of a registry's counter or gauge that has the given label, or its only
// series when label is "".
func metric(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if label == "" || hasLabel(m.GetLabel(), label, value) {
				return m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	return 0
}

func hasLabel(labels []*dto.LabelPair, name, value string) bool {
	for _, l := range labels {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}
