package webhook

import (
	"fmt"
	"reflect"
	"strings"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

// Warnings returns what is legal but probably not what the author meant. kubectl prints each one.
// The policy must be valid.
func Warnings(p *v1alpha1.RateLimitPolicy) []string {
	c, err := policy.Compile(p)
	if err != nil {
		return nil
	}
	var out []string
	shadow := 0
	for i, r := range c.Rules {
		if !r.Enforce {
			shadow++
		}
		if len(r.Key) == 0 {
			out = append(out, fmt.Sprintf("%s has no key: every client shares one counter, so one client can use up the limit for all",
				ruleRef(i, r.Name)))
		}
		if r.Limit.Kind == algorithm.SlidingWindowCounter && r.Limit.Limit < smallCounterLimit {
			out = append(out, fmt.Sprintf("%s is a slidingWindowCounter of limit %d: below %d its estimate dominates, and on ordinary traffic it "+
				"admits up to 2x the limit in some window; a slidingLog is exact and keeps fewer than %d entries per client",
				ruleRef(i, r.Name), r.Limit.Limit, smallCounterLimit, smallCounterLimit))
		}
	}
	out = append(out, responseWarnings(p, c)...)
	if shadow == len(c.Rules) {
		out = append(out, "spec.rules: every rule is in Shadow mode, so this policy counts requests but never refuses one")
	}
	out = append(out, burstWarnings(p, c)...)
	// A pool's storage is not the policy's to see here; a pool of more than one replica shares a
	// Redis, which can be down.
	store := "Redis"
	if e := p.Spec.Enforcer; e != nil && e.PoolRef != nil {
		store = "the pool's store"
	} else if s := p.Spec.Storage; s == nil || s.Redis == nil && s.ManagedRedis == nil {
		store = "" // memory: no outage to fail open in
	}
	for i, r := range c.Rules {
		if store != "" && r.FailOpen && r.Enforce && isLoginPath(r.Match.Value) {
			out = append(out, fmt.Sprintf("%s fails open on a login path (%s): while %s cannot answer, it admits unlimited attempts such as password guessing; set failureMode: Closed",
				ruleRef(i, r.Name), r.Match.Value, store))
		}
		if store == "" && r.Lease != nil {
			out = append(out, fmt.Sprintf("%s has a lease, which has no effect on memory storage: every decision is local already; remove it, or use storage.redis or storage.managedRedis",
				ruleRef(i, r.Name)))
		}
	}
	return out
}

// responseWarnings says, of every rule that needs to see its response end, that the front ends
// that cannot (the check API that ingresses call, and Envoy's rate limit service) skip it, and
// that a policy in a pool, which only those serve, never decides it; and
// of a rule charged by the response with no concurrency rule over the same requests and clients,
// that what is in flight when its limit is reached passes beyond it.
func responseWarnings(p *v1alpha1.RateLimitPolicy, c *policy.Policy) []string {
	var out []string
	rls := ""
	if e := p.Spec.Enforcer; e != nil && e.RateLimitService != nil && e.RateLimitService.Enabled {
		rls = ", which this policy serves,"
	}
	for i, r := range c.Rules {
		if !r.SeesResponse() {
			continue
		}
		what := "is a concurrency rule, whose slots are freed when responses end"
		if r.OnResponse {
			what = "is charged by the response"
		}
		if e := p.Spec.Enforcer; e != nil && e.PoolRef != nil {
			// A pool serves only the front ends that skip the rule: it is never decided.
			out = append(out, fmt.Sprintf("%s %s: only an enforcer's proxy sees a response end, and a policy in a pool (spec.enforcer.poolRef) is decided only by the pool's check API and Envoy's rate limit service, "+
				"which skip the rule and count it as skipped, so it never limits anything; give the policy its own enforcer and route through its proxy to enforce it",
				ruleRef(i, r.Name), what))
			continue
		}
		out = append(out, fmt.Sprintf("%s %s: only the enforcer's proxy sees a response end; the check API (ingress forward-auth) and Envoy's rate limit service%s skip the rule and count it as skipped",
			ruleRef(i, r.Name), what, rls))
		if !r.OnResponse {
			continue
		}
		bounded := false
		for j, other := range c.Rules {
			bounded = bounded || other.Limit.Kind == algorithm.Concurrency && reflect.DeepEqual(p.Spec.Rules[j].Match, p.Spec.Rules[i].Match) && reflect.DeepEqual(other.Key, r.Key)
		}
		if !bounded {
			out = append(out, fmt.Sprintf("%s is checked before a request is forwarded and charged after its response, so every request in flight when its limit is reached passes beyond it; a concurrency rule over the same requests and key bounds how many",
				ruleRef(i, r.Name)))
		}
	}
	return out
}

// smallCounterLimit is the limit below which a sliding window counter is warned about. Measured
// by the accuracy benchmark (enforcer/algorithm, docs/benchmarks.md) on smooth traffic: at limits
// of 1 to 10 the counter admitted 1.5x to 2x its limit in some window-long interval, with its
// estimate off by 12-22% on average; at 20 and above, 1.25x or less. A sliding log of such a
// limit costs less than a kilobyte per client, so there is nothing to save by approximating.
const smallCounterLimit = 20

// burstWarnings finds pairs of rate rules (a concurrency limit is none) over the same requests
// and clients where the shorter one (the burst rule) admits more at once than the longer window rule (the sustained rule) allows in its
// whole window: one burst spends the sustained allowance, and the burst rule never binds.
func burstWarnings(p *v1alpha1.RateLimitPolicy, c *policy.Policy) []string {
	var out []string
	for s, sustained := range c.Rules {
		if !isWindow(sustained.Limit.Kind) {
			continue
		}
		for b, burst := range c.Rules {
			if b == s || burst.Limit.Kind == algorithm.Concurrency || burst.Limit.Horizon() >= sustained.Limit.Period ||
				!reflect.DeepEqual(p.Spec.Rules[b].Match, p.Spec.Rules[s].Match) || !reflect.DeepEqual(burst.Key, sustained.Key) {
				continue
			}
			if at := burstSize(burst.Limit); at > sustained.Limit.Limit {
				out = append(out, fmt.Sprintf("%s admits up to %d units at once, more than %s allows in its whole %s window (%d): one burst spends the sustained allowance and the burst rule never takes effect",
					ruleRef(b, burst.Name), at, ruleRef(s, sustained.Name), windowOf(&p.Spec.Rules[s]), sustained.Limit.Limit))
			}
		}
	}
	return out
}

// windowOf is the window of a window rule, as the author wrote it.
func windowOf(r *v1alpha1.Rule) v1alpha1.Duration {
	for _, w := range []*v1alpha1.Window{r.FixedWindow, r.SlidingLog, r.SlidingWindowCounter} {
		if w != nil {
			return w.Window
		}
	}
	return ""
}

func ruleRef(i int, name string) string { return fmt.Sprintf("spec.rules[%d] (%q)", i, name) }

func isWindow(k algorithm.Kind) bool {
	return k == algorithm.FixedWindow || k == algorithm.SlidingLog || k == algorithm.SlidingWindowCounter
}

// burstSize is the most a rule admits at one instant: a full bucket, a window's limit, or twice
// the limit of a fixed window straddling its boundary.
func burstSize(l algorithm.Limit) int64 {
	if l.Kind == algorithm.FixedWindow {
		return 2 * l.Limit
	}
	return l.Limit
}

var loginWords = map[string]bool{
	"login": true, "logon": true, "signin": true, "auth": true, "oauth": true, "oauth2": true, "authenticate": true,
	"token": true, "session": true, "sessions": true, "password": true, "passwords": true, "otp": true, "mfa": true,
}

// isLoginPath reports whether a path, prefix or expression names a login or credential endpoint.
func isLoginPath(value string) bool {
	v := strings.ToLower(value)
	for _, compound := range []string{"log-in", "log_in", "sign-in", "sign_in"} {
		if strings.Contains(v, compound) {
			return true
		}
	}
	for _, w := range strings.FieldsFunc(v, func(r rune) bool { return (r < 'a' || r > 'z') && (r < '0' || r > '9') }) {
		if loginWords[w] {
			return true
		}
	}
	return false
}
