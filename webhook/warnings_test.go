package webhook_test

import (
	"testing"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/webhook"
)

type warningCase struct {
	name   string
	policy func() *v1alpha1.RateLimitPolicy
	want   []string // substrings, one per expected warning
}

var byClient = []v1alpha1.KeySource{{Type: v1alpha1.KeyRemoteAddress}}

func bucket(name string, capacity, tokens int64, period v1alpha1.Duration) v1alpha1.Rule {
	return v1alpha1.Rule{Name: name, Key: byClient,
		TokenBucket: &v1alpha1.TokenBucket{Capacity: capacity, Refill: v1alpha1.TokenRefill{Tokens: tokens, Period: period}}}
}

func policyOf(rules ...v1alpha1.Rule) func() *v1alpha1.RateLimitPolicy {
	return func() *v1alpha1.RateLimitPolicy {
		p := validPolicy("", "")
		p.Spec.Rules = rules
		return p
	}
}

func withRedis(f func() *v1alpha1.RateLimitPolicy) func() *v1alpha1.RateLimitPolicy {
	return func() *v1alpha1.RateLimitPolicy {
		p := f()
		p.Spec.Storage = &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{"redis.example:6379"}}}
		return p
	}
}

func onPath(r v1alpha1.Rule, t v1alpha1.PathMatchType, value string, mode v1alpha1.FailureMode) v1alpha1.Rule {
	r.Match = &v1alpha1.Match{Path: &v1alpha1.PathMatch{Type: t, Value: value}}
	r.FailureMode = mode
	return r
}

func warningCases() []warningCase {
	sustained := v1alpha1.Rule{Name: "sustained", Key: byClient, SlidingWindowCounter: &v1alpha1.Window{Limit: 100, Window: "1m"}}
	noKey := bucket("global", 10, 1, "1s")
	noKey.Key = nil
	shadow := bucket("trial", 10, 1, "1s")
	shadow.Mode = v1alpha1.ModeShadow
	boundary := v1alpha1.Rule{Name: "per-second", Key: byClient, FixedWindow: &v1alpha1.Window{Limit: 60, Window: "1s"}}
	exact := v1alpha1.Rule{Name: "per-minute", Key: byClient, SlidingLog: &v1alpha1.Window{Limit: 100, Window: "1m"}}
	otherKey := bucket("burst", 200, 10, "1s")
	otherKey.Key = []v1alpha1.KeySource{{Type: v1alpha1.KeyMethod}}
	slots := v1alpha1.Rule{Name: "in-flight", Key: byClient, Concurrency: &v1alpha1.Concurrency{Limit: 10}}
	failures := v1alpha1.Rule{Name: "failures", Key: byClient, FixedWindow: &v1alpha1.Window{Limit: 5, Window: "1h"},
		Charge: &v1alpha1.Charge{When: v1alpha1.ChargeWhenResponse, Statuses: []v1alpha1.StatusPattern{"401"}}}
	onRequest := v1alpha1.Rule{Name: "requests", Key: byClient, FixedWindow: &v1alpha1.Window{Limit: 5, Window: "1h"},
		Charge: &v1alpha1.Charge{When: v1alpha1.ChargeWhenRequest}}
	withRLS := func(f func() *v1alpha1.RateLimitPolicy) func() *v1alpha1.RateLimitPolicy {
		return func() *v1alpha1.RateLimitPolicy {
			p := f()
			p.Spec.Enforcer = &v1alpha1.EnforcerSpec{RateLimitService: &v1alpha1.RateLimitService{Enabled: true}}
			return p
		}
	}
	inPool := func(f func() *v1alpha1.RateLimitPolicy) func() *v1alpha1.RateLimitPolicy {
		return func() *v1alpha1.RateLimitPolicy {
			p := f()
			p.Spec.Enforcer = &v1alpha1.EnforcerSpec{PoolRef: &v1alpha1.PoolRef{Name: "shared"}}
			return p
		}
	}
	leased := bucket("leased", 100, 10, "1s")
	leased.Lease = &v1alpha1.Lease{Max: 10}
	withMemory := func(f func() *v1alpha1.RateLimitPolicy) func() *v1alpha1.RateLimitPolicy {
		return func() *v1alpha1.RateLimitPolicy {
			p := f()
			p.Spec.Storage = &v1alpha1.Storage{Memory: &v1alpha1.MemoryStorage{}}
			return p
		}
	}
	return []warningCase{
		{"when every rule has a key and enforces then nothing is said", policyOf(bucket("a", 10, 1, "1s")), nil},
		{"when a leased rule has no storage then the lease has no effect on memory",
			policyOf(bucket("a", 10, 1, "1s"), leased),
			[]string{`spec.rules[1] ("leased") has a lease, which has no effect on memory storage: every decision is local already`}},
		{"when a leased rule has memory storage then the lease has no effect", withMemory(policyOf(leased)),
			[]string{`spec.rules[0] ("leased") has a lease, which has no effect on memory storage: every decision is local already`}},
		{"when a leased rule has Redis storage then nothing is said", withRedis(policyOf(leased)), nil},
		{"when a leased rule is in a pool then nothing is said: the pool's store is not the policy's to see", inPool(policyOf(leased)), nil},
		{"when a policy in a pool has a concurrency rule and a rule charged by the response then neither is ever decided",
			inPool(policyOf(failures, slots)),
			[]string{`spec.rules[0] ("failures") is charged by the response: only an enforcer's proxy sees a response end, and a policy in a pool (spec.enforcer.poolRef) is decided only by the pool's check API and Envoy's rate limit service, which skip the rule and count it as skipped, so it never limits anything`,
				`spec.rules[1] ("in-flight") is a concurrency rule, whose slots are freed when responses end: only an enforcer's proxy sees a response end, and a policy in a pool`}},
		{"when a policy in a pool has rules charged on the request then nothing is said", inPool(policyOf(onRequest)), nil},
		{"when a rule is a concurrency limit then the check API and RLS skip it",
			policyOf(slots),
			[]string{`spec.rules[0] ("in-flight") is a concurrency rule, whose slots are freed when responses end: only the enforcer's proxy sees a response end; the check API (ingress forward-auth) and Envoy's rate limit service skip the rule and count it as skipped`}},
		{"when the policy serves RLS then the warning says so", withRLS(policyOf(slots)),
			[]string{`Envoy's rate limit service, which this policy serves, skip the rule`}},
		{"when a rule is charged by the response without a concurrency rule then what is in flight passes beyond its limit",
			policyOf(failures),
			[]string{`spec.rules[0] ("failures") is charged by the response: only the enforcer's proxy sees a response end`,
				`spec.rules[0] ("failures") is checked before a request is forwarded and charged after its response, so every request in flight when its limit is reached passes beyond it`}},
		{"when a concurrency rule bounds the requests in flight then only the front ends are named",
			policyOf(failures, slots),
			[]string{`spec.rules[0] ("failures") is charged by the response`, `spec.rules[1] ("in-flight") is a concurrency rule`}},
		{"when a rule is charged on the request then nothing is said", policyOf(onRequest), nil},
		{"when a sliding window counter has a small limit then the sliding log is suggested",
			policyOf(v1alpha1.Rule{Name: "few", Key: byClient, SlidingWindowCounter: &v1alpha1.Window{Limit: 5, Window: "1m"}}),
			[]string{`spec.rules[0] ("few") is a slidingWindowCounter of limit 5: below 20 its estimate dominates`}},
		{"when a sliding window counter's limit is 20 then nothing is said",
			policyOf(v1alpha1.Rule{Name: "enough", Key: byClient, SlidingWindowCounter: &v1alpha1.Window{Limit: 20, Window: "1m"}}), nil},
		{"when a rule has no key then one counter is shared by every client", policyOf(noKey),
			[]string{`spec.rules[0] ("global") has no key: every client shares one counter`}},
		{"when every rule is Shadow then the policy never refuses", policyOf(shadow),
			[]string{"every rule is in Shadow mode, so this policy counts requests but never refuses one"}},
		{"when a burst rule admits more at once than the sustained window allows then the burst never binds",
			policyOf(bucket("burst", 200, 10, "1s"), sustained),
			[]string{`spec.rules[0] ("burst") admits up to 200 units at once, more than spec.rules[1] ("sustained") allows in its whole 1m window (100)`}},
		{"when a fixed window can pass twice its limit around a boundary then that counts as its burst",
			policyOf(boundary, exact),
			[]string{`spec.rules[0] ("per-second") admits up to 120 units at once, more than spec.rules[1] ("per-minute") allows in its whole 1m window (100)`}},
		{"when the burst fits in the sustained window then nothing is said", policyOf(bucket("burst", 10, 10, "1s"), sustained), nil},
		{"when the rules count different clients then they are not a burst and sustained pair",
			policyOf(otherKey, sustained), nil},
		{"when a rule fails open on a login path with Redis then guessing is unlimited during an outage",
			withRedis(policyOf(onPath(bucket("login", 5, 1, "1m"), v1alpha1.PathMatchExact, "/login", v1alpha1.FailOpen))),
			[]string{`spec.rules[0] ("login") fails open on a login path (/login)`}},
		{"when a rule fails open on an OAuth token expression then it is a login path too",
			withRedis(policyOf(onPath(bucket("token", 5, 1, "1m"), v1alpha1.PathMatchRegularExpression, "/api/v[0-9]+/oauth/token", v1alpha1.FailOpen))),
			[]string{`fails open on a login path (/api/v[0-9]+/oauth/token)`}},
		{"when a rule fails closed on a login path then nothing is said",
			withRedis(policyOf(onPath(bucket("login", 5, 1, "1m"), v1alpha1.PathMatchPrefix, "/sign-in", v1alpha1.FailClosed))), nil},
		{"when a fail-open rule is on a path that only contains a login word then nothing is said",
			withRedis(policyOf(onPath(bucket("authors", 5, 1, "1m"), v1alpha1.PathMatchPrefix, "/authors", v1alpha1.FailOpen))), nil},
		{"when a policy in a pool fails open on a login path then the pool's store is named",
			inPool(policyOf(onPath(bucket("login", 5, 1, "1m"), v1alpha1.PathMatchExact, "/login", v1alpha1.FailOpen))),
			[]string{`spec.rules[0] ("login") fails open on a login path (/login): while the pool's store cannot answer, it admits unlimited attempts`}},
		{"when storage is memory then there is no outage to fail open in",
			policyOf(onPath(bucket("login", 5, 1, "1m"), v1alpha1.PathMatchExact, "/login", v1alpha1.FailOpen)), nil},
	}
}

func TestWarnings(t *testing.T) {
	for _, c := range warningCases() {
		t.Run(c.name, func(t *testing.T) {
			requireWarnings(t, webhook.Warnings(c.policy()), c.want)
		})
	}
}
