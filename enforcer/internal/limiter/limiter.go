// Package limiter decides HTTP requests against compiled policies: it matches rules, identifies
// the client, asks the store, and applies each rule's failure mode when the store cannot answer.
package limiter

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"math"
	"math/rand/v2"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/utils/clock"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/report"
)

// Outcome is what happens to a request.
type Outcome int

// Outcomes.
const (
	// Allowed: forward the request, after Wait.
	Allowed Outcome = iota
	// Limited: refuse with 429.
	Limited
	// Unavailable: the store cannot answer and a fail-closed rule matched; refuse with 503.
	Unavailable
	// Invalid: the request cannot be decided as sent (Result.Reason says why); refuse with 400.
	// Nothing was charged.
	Invalid
)

// String names the outcome in logs.
func (o Outcome) String() string {
	switch o {
	case Allowed:
		return "allowed"
	case Limited:
		return "limited"
	case Unavailable:
		return "unavailable"
	case Invalid:
		return "invalid"
	}
	return "outcome " + strconv.Itoa(int(o))
}

// MaxChecks bounds the rules one decision charges, so that no call is one unbounded store
// script: a request (or Envoy descriptors) matching more is Invalid.
const MaxChecks = 64

// Request is what a decision needs from an HTTP request.
type Request struct {
	Method string
	Path   string
	Header policy.Header
	// Peer is the TCP peer's address.
	Peer netip.Addr
	// Policy, when set, limits the decision to the rules of the policy with this ID; a policy
	// not in force makes the request Invalid (NotServed).
	Policy string
	// Hits multiplies every rule's cost; 0 means 1.
	Hits int64
	// CheckOnly decides the request at a cost of 0: it is refused only where a rule is already
	// past its limit, and charges nothing (an Envoy descriptor's hits_addend of 0, which asks
	// before a charge that comes later, as with apply_on_stream_done).
	CheckOnly bool
	// KeysRequired limits the decision to the rules all of whose key sources the request
	// carries: an Envoy descriptor selects the limits whose keys it names.
	KeysRequired bool
	// SeesResponse is true for a front end that tells when the request's response ends and what
	// it was (the proxies, which then call Result.Pending's End): only it decides concurrency
	// rules and rules charged by the response. Any other front end skips them, and each is
	// counted as skipped.
	SeesResponse bool
}

// carries reports whether a request carries every key source of a rule.
func (req *Request) carries(r *policy.Rule) bool {
	for _, k := range r.Key {
		switch k.Type {
		case v1alpha1.KeyRemoteAddress:
			if !req.Peer.IsValid() {
				return false
			}
		case v1alpha1.KeyMethod:
			if req.Method == "" {
				return false
			}
		case v1alpha1.KeyPath:
			if req.Path == "" {
				return false
			}
		case v1alpha1.KeyHeader:
			if len(req.Header.Values(k.Header)) == 0 {
				return false
			}
		}
	}
	return true
}

// Result is the decision on one request.
type Result struct {
	Outcome Outcome
	// Wait is how long to hold an allowed request (leaky-bucket rules).
	Wait time.Duration
	// RetryAfter is, for a refusal, when the same request may pass.
	RetryAfter time.Duration
	// Never is, for a refusal, that the same request can never pass: its cost (the rule's cost
	// times Hits) exceeds an enforced rule's capacity or limit. RetryAfter is then 0, and a front
	// end sends no Retry-After, which would promise otherwise. It is so whether or not the store
	// answers (see failureModes).
	Never bool
	// Rule is the rule the response's RateLimit headers describe: the refusing rule, or the
	// enforced rule closest to its limit. Nil when no enforced rule has a decision to show.
	Rule *policy.Rule
	// Policy is the ID of Rule's policy.
	Policy string
	// Decision is Rule's decision.
	Decision algorithm.Decision
	// Reason says why an Invalid request cannot be decided.
	Reason string
	// Pending, for an admitted request of a front end that sees responses, is what it still owes
	// once its response ends: the leases it holds and the rules its response charges. Nil when
	// it owes nothing.
	Pending *Pending
}

// Limiter decides requests. It is safe for concurrent use; SetPolicies swaps the rules without
// disturbing requests in flight.
type Limiter struct {
	policies atomic.Pointer[policySet]
	store    store.Store
	breaker  *breaker
	refusals *refusalCache
	metrics  *Metrics
	now      func() time.Time
	log      logr.Logger
	// faulty holds the "<policy>/<rule>" of every rule whose decision has failed with a fault, so
	// each is logged once.
	faulty sync.Map
	// clock schedules lease renewals; leaseBase and leaseSeq name requests (leaseName); ending
	// counts the ends of requests still being written to the store (Settle).
	clock     clock.WithDelayedExecution
	leaseBase string
	leaseSeq  atomic.Uint64
	ending    sync.WaitGroup
}

// Options configure a Limiter.
type Options struct {
	Store   store.Store
	Metrics *Metrics
	// Breaker guards a remote store: after BreakerFailures consecutive failures, decisions stop
	// waiting for the store for BreakerOpen, and rules apply their failure modes at once. Then one
	// probe decides whether the store is back. Zero BreakerFailures disables it (memory store).
	BreakerFailures uint32
	BreakerOpen     time.Duration
	// RefusalCache, for a remote store, answers a key locally until the moment the store said
	// it is refused until.
	RefusalCache bool
	Now          func() time.Time
	// Clock schedules the renewals of the leases of requests in flight. Default the real clock.
	Clock clock.WithDelayedExecution
	// Log receives the first fault of each rule (see store.ErrFault).
	Log logr.Logger
}

// New returns a limiter with no policies.
func New(opts Options) *Limiter {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Metrics == nil {
		opts.Metrics = NewMetrics(nil)
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	var base [6]byte
	_, _ = crand.Read(base[:])
	l := &Limiter{store: opts.Store, metrics: opts.Metrics, now: opts.Now, log: opts.Log, clock: opts.Clock,
		leaseBase: hex.EncodeToString(base[:]) + "."}
	if opts.BreakerFailures > 0 {
		l.breaker = &breaker{failures: opts.BreakerFailures, open: opts.BreakerOpen, now: opts.Now, changed: func(skipping bool) {
			opts.Metrics.breakerOpen.Set(map[bool]float64{true: 1, false: 0}[skipping])
		}, told: func(skipping bool, err error) {
			// One line when the breaker opens, naming the failure that opened it, and one when
			// a probe or a health ping closes it; a failed probe, once a second while Redis is
			// down, logs nothing.
			if skipping {
				l.log.Error(err, "The store circuit breaker opened: decisions failed in a row, and rules apply their failure modes without asking the store until it answers again",
					"failures", opts.BreakerFailures, "probeAfter", opts.BreakerOpen.String())
			} else {
				l.log.Info("The store circuit breaker closed: the store answered, and decisions reach it again")
			}
		}}
	}
	if opts.RefusalCache {
		l.refusals = newRefusalCache(100_000)
	}
	l.policies.Store(&policySet{})
	return l
}

// policySet is the policies in force, in order, and by ID: a decision for one policy (the check
// API's /policies/<namespace>/<name>/..., an RLS domain) finds it in one lookup however many a
// pool serves.
type policySet struct {
	list []*policy.Policy
	byID map[string]*policy.Policy
}

// SetPolicies replaces the policies. Counters live in the store under the policies' and rules'
// names (each rule's StateKey, set here), so unchanged rules keep their state. The refusal cache
// is emptied: a refusal under the old rules says nothing about the new ones.
func (l *Limiter) SetPolicies(ps []*policy.Policy) {
	for _, p := range ps {
		for i := range p.Rules {
			if r := &p.Rules[i]; r.StateKey == "" {
				r.StateKey = store.RuleID(p.ID, r.Name, r.Limit.Layout())
			}
		}
	}
	set := &policySet{list: ps, byID: make(map[string]*policy.Policy, len(ps))}
	for _, p := range ps {
		set.byID[p.ID] = p
	}
	l.policies.Store(set)
	l.refusals.clear()
	l.metrics.serve(ps)
}

// Keys names the store key of each rule of the request's policy (Request.Policy) that the request
// matches, by rule name, as its decision would charge it; or why the request cannot be decided.
func (l *Limiter) Keys(req *Request) (map[string]string, string) {
	r := *req
	r.SeesResponse = true // the keys of every rule the proxy decides
	checks, rules, _, invalid := l.collect(&r, nil, nil)
	if invalid != "" {
		return nil, invalid
	}
	keys := make(map[string]string, len(checks))
	for i := range checks {
		keys[rules[i].rule.Name] = checks[i].Key()
	}
	return keys, ""
}

// Policies are the policies in force.
func (l *Limiter) Policies() []*policy.Policy { return l.policies.Load().list }

// Policy is the policy in force with this ID ("<namespace>/<name>"), or nil.
func (l *Limiter) Policy(id string) *policy.Policy { return l.policies.Load().byID[id] }

// NotServed says that a request named a policy that is not in force here: it is refused as
// Invalid, never decided against no rules at all.
func NotServed(id string) string {
	if len(id) > 320 {
		id = id[:320] + "..."
	}
	return "policy " + strconv.Quote(id) + " is not served here"
}

// BreakerOpen reports whether decisions skip the store for now (open) or wait for one probe
// (half-open).
func (l *Limiter) BreakerOpen() bool {
	return l.breaker != nil && l.breaker.skipping()
}

// StoreAnswered tells the limiter that its store answered within a decision's time, outside any
// decision (the enforcer's health ping): a breaker whose open time has passed closes, as after a
// successful probe, where no request came to probe.
func (l *Limiter) StoreAnswered() {
	if l.breaker != nil {
		l.breaker.answered()
	}
}

// Counters are the decisions of each rule since the limiter was created.
func (l *Limiter) Counters() map[RuleKey]report.Counters { return l.metrics.Counters() }

type matched struct {
	rule *policy.Rule
	of   *policy.Policy
}

// decideBufs hold one decision's checks, rules and decisions. They reach the store through an
// interface, so arrays on Decide's stack would escape, a kilobyte of garbage per request; a pool
// keeps them. Nothing keeps a reference once Decide returns: the Redis store copies what it
// sends, and the refusal cache copies the keys.
type decideBufs struct {
	checks [8]store.Check
	rules  [8]matched
	out    [8]algorithm.Decision
}

var bufPool = sync.Pool{New: func() any { return new(decideBufs) }}

// Decide decides one request. A refusal is logged at V(1) (the enforcer's --log-level=debug), one
// line each, naming its policy and rule, never the client.
func (l *Limiter) Decide(ctx context.Context, req *Request) Result {
	res := l.decideOne(ctx, req)
	if res.Outcome != Allowed {
		if log := l.log.V(1); log.Enabled() {
			args := []any{"outcome", res.Outcome.String(), "method", req.Method, "path", req.Path}
			if res.Rule != nil {
				args = append(args, "policy", res.Policy, "rule", res.Rule.Name, "retryAfter", res.RetryAfter.String())
			}
			if res.Reason != "" {
				args = append(args, "reason", res.Reason)
			}
			log.Info("Request refused", args...)
		}
	}
	return res
}

func (l *Limiter) decideOne(ctx context.Context, req *Request) Result {
	bufs := bufPool.Get().(*decideBufs)
	defer func() {
		*bufs = decideBufs{} // no strings or rules kept alive by the pool
		bufPool.Put(bufs)
	}()
	checks, rules, idemKey, invalid := l.collect(req, bufs.checks[:0], bufs.rules[:0])
	if invalid != "" {
		return Result{Outcome: Invalid, Reason: invalid}
	}
	checks, rules = l.skip(checks, rules)
	if len(checks) == 0 {
		return Result{Outcome: Allowed}
	}

	// A request that names its repeats is always asked of the store: a repeat of an admitted
	// request passes whatever the limits say now, and a refusal the store forced on a repeat
	// says nothing of the client's other requests, so neither may touch the refusal cache.
	cache := idemKey == ""
	if cache {
		if res, ok := l.cachedRefusal(checks, rules); ok {
			return jitter(res)
		}
	}

	out := bufs.out[:0]
	if len(checks) > len(bufs.out) {
		out = make([]algorithm.Decision, 0, len(checks))
	}
	out = out[:len(checks)]
	start := time.Now()
	charged, err := l.decide(ctx, checks, out)
	l.metrics.storeLatency.Observe(time.Since(start).Seconds())
	if err != nil {
		if cancelled(ctx, err) {
			return l.cancelled(rules)
		}
		res := l.failureModes(checks, rules, err)
		if res.Outcome == Allowed {
			// The script may have run before the store failed to answer: its leases are
			// released all the same, and the response is charged if the store is back by then.
			res.Pending = l.pending(checks, rules, nil)
		}
		return res
	}
	res := jitter(l.result(checks, rules, out, charged, cache))
	if charged {
		res.Pending = l.pending(checks, rules, out)
	}
	return res
}

// collect appends the checks and rules of the rules that match a request, and returns the first
// idempotency key the request sends to a policy that asks for one. A request that repeats a
// header a matching rule keys on, or its policy's idempotency header, cannot be decided: the
// upstream reads one of the values, and which one is not ours to guess. invalid says why.
func (l *Limiter) collect(req *Request, checks []store.Check, rules []matched) (_ []store.Check, _ []matched, idemKey, invalid string) {
	hits := max(1, req.Hits)
	if req.CheckOnly {
		hits = 0
	}
	lease := "" // the request's name, made once a rule needs it (leaseName)
	set := l.policies.Load()
	candidates := set.list
	var one [1]*policy.Policy
	if req.Policy != "" {
		if one[0] = set.byID[req.Policy]; one[0] == nil {
			return checks, rules, "", NotServed(req.Policy)
		}
		candidates = one[:]
	}
	for _, p := range candidates {
		var addr netip.Addr
		var idemValue string
		if p.Idempotency != nil {
			v := req.Header.Values(p.Idempotency.Header)
			if len(v) > 1 {
				return checks, rules, "", repeated(p.Idempotency.Header, "")
			}
			if len(v) > 0 && v[0] != "" {
				idemValue = v[0]
				if idemKey == "" {
					idemKey = v[0]
				}
			}
		}
		var idem *store.Idempotency
		var lastKey, lastTag string // rules of a policy often share their client key
		for i := range p.Rules {
			r := &p.Rules[i]
			if !r.Match.Matches(req.Method, req.Path, req.Header) || req.KeysRequired && !req.carries(r) {
				continue
			}
			if name := RepeatedKeyHeader(r.Key, req.Header); name != "" {
				return checks, rules, "", repeated(name, r.Name)
			}
			if !addr.IsValid() {
				addr = ClientAddr(req.Peer, req.Header, p.TrustedProxies)
			}
			if idemValue != "" && idem == nil {
				// The record is this policy's (its checks' tags) and this client's: the key is
				// hashed with the client's address, so clients that send the same key never
				// share a record, even under a rule that has no client key.
				// The request is part of the identity too: a key first sent with one request
				// makes no other request (another route under the same client key) a repeat.
				idem = &store.Idempotency{Key: store.IdempotencyKey(idemValue, addr.String()+" "+req.Method+" "+req.Path), Window: p.Idempotency.Window, MaxRepeats: p.Idempotency.MaxRepeats}
			}
			if key := store.ClientKey(r.Key, req.Method, req.Path, req.Header, addr); lastTag == "" || key != lastKey {
				lastKey, lastTag = key, store.Tag(p.ID, key)
			}
			if len(checks) == MaxChecks {
				return checks, rules, "", "the request matches more than " + strconv.Itoa(MaxChecks) + " rules; at most that many are decided at once"
			}
			c := store.Check{Limit: r.Limit, Cost: mulCost(r.Cost, hits), Enforce: r.Enforce, Tag: lastTag, Rule: r.StateKey, Idempotency: idem, UnitLease: r.Lease}
			if r.SeesResponse() {
				if !req.SeesResponse {
					rules = append(rules, matched{r, p}) // skipped: marked by no check (see skip)
					checks = append(checks, store.Check{})
					continue
				}
				if lease == "" {
					lease = l.leaseName()
				}
				c.Lease, c.Deferred = lease, r.OnResponse
				if r.Limit.Kind == algorithm.Concurrency {
					// A repeat is in flight as any request is: it holds a slot of its own.
					c.Idempotency = nil
				}
			}
			checks = append(checks, c)
			rules = append(rules, matched{r, p})
		}
	}
	return checks, rules, idemKey, ""
}

// skip takes out the rules that collect marked as skipped (those only a front end that sees
// responses decides), counting each, and returns the checks and rules left.
func (l *Limiter) skip(checks []store.Check, rules []matched) ([]store.Check, []matched) {
	n := 0
	for i := range checks {
		if checks[i].Limit.Kind == 0 {
			l.metrics.decision(rules[i].of, rules[i].rule.Name, resultSkipped)
			continue
		}
		checks[n], rules[n] = checks[i], rules[i]
		n++
	}
	return checks[:n], rules[:n]
}

// leaseName is a new request's name, unique across enforcers: 48 random bits of this limiter
// and a count, at most 24 bytes for the first 36^11 requests (algorithm.LeaseSize counts them so).
func (l *Limiter) leaseName() string {
	return l.leaseBase + strconv.FormatUint(l.leaseSeq.Add(1), 36)
}

// repeated says that a header was sent more than once, and which rule keys on it ("" for the
// idempotency header).
func repeated(header, rule string) string {
	if rule == "" {
		return "header " + header + " is sent more than once; the idempotency key must be one value"
	}
	return "header " + header + " is sent more than once; rule " + strconv.Quote(rule) + " keys clients on it and needs one value"
}

// mulCost is cost times hits, saturated at math.MaxInt64 instead of wrapping: a product that
// large exceeds every limit, and the store refuses it as one that can never pass.
func mulCost(cost, hits int64) int64 {
	if cost <= 0 || hits <= 0 {
		return max(0, cost) * max(0, hits)
	}
	if cost > math.MaxInt64/hits {
		return math.MaxInt64
	}
	return cost * hits
}

// outranks reports whether refusal a is the one to report rather than b: one that can never pass
// first, then the longest Retry-After.
func outranks(a, b *Result) bool {
	if a.Never != b.Never {
		return a.Never
	}
	return a.RetryAfter > b.RetryAfter
}

// DecideAll decides several requests as one: every rule that matches any of them is checked, and
// all are charged or none (Envoy's rate limit service asks for one request's descriptors so). It
// returns each request's result and the overall one (reports): a refusal, the one with the
// longest Retry-After, or else the admission whose rule is closest to its limit.
func (l *Limiter) DecideAll(ctx context.Context, reqs []Request) ([]Result, Result) {
	bufs := bufPool.Get().(*decideBufs)
	defer func() {
		*bufs = decideBufs{} // no strings or rules kept alive by the pool
		bufPool.Put(bufs)
	}()
	checks, rules := bufs.checks[:0], bufs.rules[:0]
	var few [len(decideBufs{}.checks) + 1]int // the bounds of up to 8 requests, on the stack
	var bounds []int
	if len(reqs) < len(few) {
		bounds = few[:len(reqs)+1]
	} else {
		bounds = make([]int, len(reqs)+1)
	}
	idem := false
	per := make([]Result, len(reqs))
	for i := range reqs {
		var key, invalid string
		from := len(checks)
		checks, rules, key, invalid = l.collect(&reqs[i], checks, rules)
		if invalid != "" {
			res := Result{Outcome: Invalid, Reason: invalid}
			for j := range per {
				per[j] = res
			}
			return per, res
		}
		c, r := l.skip(checks[from:], rules[from:])
		checks, rules = checks[:from+len(c)], rules[:from+len(r)]
		bounds[i+1], idem = len(checks), idem || key != ""
	}
	if len(checks) == 0 {
		for i := range per {
			per[i] = Result{Outcome: Allowed}
		}
		return per, Result{Outcome: Allowed}
	}
	merged, same := mergeRepeats(checks)
	out := bufs.out[:0]
	if len(merged) > len(bufs.out) {
		out = make([]algorithm.Decision, 0, len(merged))
	}
	out = out[:len(merged)]
	start := time.Now()
	charged, err := l.decide(ctx, merged, out)
	l.metrics.storeLatency.Observe(time.Since(start).Seconds())
	out = spread(out, same)
	// A refusal is cached for its check's cost; a merged check was refused at the sum of several.
	cache := !idem && len(merged) == len(checks)
	if err != nil && cancelled(ctx, err) {
		res := l.cancelled(rules)
		for i := range per {
			per[i] = res
		}
		return per, res
	}
	if err != nil {
		// A merged check's cost is the sum its requests asked for together: the one that can
		// never pass when the store cannot answer either.
		for i, j := range same {
			checks[i].Cost = merged[j].Cost
		}
	}
	overall, wait := Result{Outcome: Allowed}, time.Duration(0)
	for i := range reqs {
		b, e := bounds[i], bounds[i+1]
		switch {
		case b == e:
			per[i] = Result{Outcome: Allowed}
		case err != nil:
			per[i] = l.failureModes(checks[b:e], rules[b:e], err)
		default:
			per[i] = jitter(l.result(checks[b:e], rules[b:e], out[b:e], charged, cache))
		}
		if r := per[i]; i == 0 || reports(&r, &overall) {
			overall = r
		}
		wait = max(wait, per[i].Wait)
	}
	if overall.Outcome == Allowed {
		overall.Wait = wait // every request's wait is held, the longest
	}
	return per, overall
}

// reports tells whether result a, rather than b, is the overall one of several requests decided
// together: a refusal that can never pass first, since no failure mode may admit it; then a
// fail-closed rule's unavailable store; then the refusal outranks prefers; among admissions, the
// rule closest to its limit, as one request's admission reports (result).
func reports(a, b *Result) bool {
	never := func(r *Result) bool { return r.Outcome == Limited && r.Never }
	switch {
	case never(a) || never(b):
		return never(a) && !never(b)
	case a.Outcome == Unavailable || b.Outcome == Unavailable:
		return a.Outcome == Unavailable && b.Outcome != Unavailable
	case a.Outcome == Limited:
		return b.Outcome == Allowed || b.Outcome == Limited && outranks(a, b)
	case a.Outcome == Allowed && b.Outcome == Allowed:
		return closer(a, b)
	}
	return false
}

// closer reports whether admission a describes a rule closer to its limit than b does: a smaller
// share of it left. An admission that describes no rule (none matched) is never closer.
func closer(a, b *Result) bool {
	share := func(r *Result) float64 { return float64(r.Decision.Remaining) / float64(r.Decision.Limit) }
	switch {
	case a.Rule == nil || a.Decision.Limit == 0:
		return false
	case b.Rule == nil || b.Decision.Limit == 0:
		return true
	}
	return share(a) < share(b)
}

// mergeRepeats folds the checks of one rule and one client that several requests of a DecideAll
// share (Envoy descriptors that repeat each other) into one check of their summed cost: the store
// decides each check against the state from before the call, so two checks of one counter would
// charge it once. same[i] is the index in merged of checks[i]; merged is checks itself, and same
// nil, when nothing repeats, which the common call (one descriptor) finds without allocating.
func mergeRepeats(checks []store.Check) (merged []store.Check, same []int) {
	if !repeats(checks) {
		return checks, nil
	}
	type counter struct{ tag, rule string }
	seen := make(map[counter]int, len(checks))
	same = make([]int, len(checks))
	for i := range checks {
		c := counter{checks[i].Tag, checks[i].Rule}
		j, ok := seen[c]
		if !ok {
			seen[c], same[i] = len(merged), len(merged)
			merged = append(merged, checks[i])
			continue
		}
		same[i] = j
		merged[j].Cost = addCost(merged[j].Cost, checks[i].Cost)
		merged[j].Idempotency = nil // a summed charge is no one request's repeat
	}
	return merged, same
}

// repeats reports whether two checks are of one rule and one client: at most MaxChecks, compared
// pairwise.
func repeats(checks []store.Check) bool {
	for i := range checks {
		for j := range i {
			if checks[i].Tag == checks[j].Tag && checks[i].Rule == checks[j].Rule {
				return true
			}
		}
	}
	return false
}

// spread gives every check the decision of the merged check it went into; out itself when
// nothing was merged (same is nil).
func spread(out []algorithm.Decision, same []int) []algorithm.Decision {
	if same == nil {
		return out
	}
	all := make([]algorithm.Decision, len(same))
	for i, j := range same {
		all[i] = out[j]
	}
	return all
}

// addCost adds two costs, saturated at math.MaxInt64 as mulCost multiplies them.
func addCost(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// jitter adds to a refusal's Retry-After, and to the reset its RateLimit field names, a random
// share of up to its policy's spec.retries.retryAfterJitterPercent: clients refused together come
// back spread out. Later than the limit requires is still honest: a request sent then passes.
func jitter(res Result) Result {
	if res.Outcome != Limited || res.Rule == nil || res.Rule.RetryJitter <= 0 {
		return res
	}
	extra := time.Duration(rand.Float64() * res.Rule.RetryJitter * float64(res.RetryAfter))
	res.RetryAfter += extra
	res.Decision.RetryAfter = res.RetryAfter
	res.Decision.Reset = max(res.Decision.Reset, res.RetryAfter)
	return res
}

func (l *Limiter) decide(ctx context.Context, checks []store.Check, out []algorithm.Decision) (bool, error) {
	// Decided from leased units: Redis was not asked, so the breaker learns nothing, and the
	// units decide even while it is open.
	if d, ok := l.store.(store.LocalDecider); ok && d.DecideLocal(checks, out) {
		return true, nil
	}
	if l.breaker == nil {
		return l.store.Decide(ctx, checks, out)
	}
	t, err := l.breaker.allow()
	if err != nil {
		return false, err
	}
	settled := false
	defer func() {
		if !settled {
			// The store panicked (the front end answers 500): a probe's turn passes to the
			// next decision rather than leaving the breaker probing for ever.
			l.breaker.abandon(t)
		}
	}()
	charged, err := l.store.Decide(ctx, checks, out)
	settled = true
	if err != nil && cancelled(ctx, err) {
		l.breaker.abandon(t)
		return charged, err
	}
	l.breaker.done(t, err)
	return charged, err
}

// cancelled reports whether a decision failed because its caller cancelled ctx (the client
// left), rather than because the store failed: the store's own deadline, or any deadline, is
// DeadlineExceeded and still a failure.
func cancelled(ctx context.Context, err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(ctx.Err(), context.Canceled)
}

// cancelled is the result of a decision whose client left before the store answered. It is
// neither a success nor a failure: it is counted (sluice_decisions_cancelled_total) and nothing
// else, neither as a store error nor as a rule's decision, and the breaker does not see it. It
// refuses (Unavailable, naming the first rule): nobody reads the answer, and a request whose
// client left is not to be forwarded undecided.
func (l *Limiter) cancelled(rules []matched) Result {
	l.metrics.cancelled.Inc()
	return Result{Outcome: Unavailable, RetryAfter: time.Second, Rule: rules[0].rule, Policy: rules[0].of.ID}
}

// Left counts a request whose client left before it was answered, as a front end tells: its
// decision was made detached from the client (the seam, enforcer/seam.go), so the store neither
// failed nor was skipped, and nobody reads the answer (sluice_decisions_cancelled_total).
func (l *Limiter) Left() { l.metrics.cancelled.Inc() }

// failureModes decides when the store cannot: fail-open rules let the request through, and any
// enforced fail-closed rule refuses it with 503. A cost that an enforced rule can never admit
// (over its capacity or limit, as hits make it) is refused as never passing first: the store
// would have refused it whatever its state, so no failure mode may admit it. Its decision has
// no state to show (Decision.Limit 0: no RateLimit fields).
func (l *Limiter) failureModes(checks []store.Check, rules []matched, err error) Result {
	switch {
	case errors.Is(err, store.ErrFault):
		l.metrics.storeErrors.WithLabelValues(causeFault).Inc()
		for _, m := range rules {
			if _, seen := l.faulty.LoadOrStore(m.of.ID+"/"+m.rule.Name, true); !seen {
				l.log.Error(err, "A rule's decision failed in the store; it applies its failure mode until fixed. Logged once per rule",
					"policy", m.of.ID, "rule", m.rule.Name, "failOpen", !m.rule.Enforce || m.rule.FailOpen)
			}
		}
	case !errors.Is(err, errBreakerOpen):
		l.metrics.storeErrors.WithLabelValues(causeUnavailable).Inc()
	}
	res := Result{Outcome: Allowed}
	never := false
	for i, m := range rules {
		switch {
		case m.rule.Enforce && (checks[i].Cost < 0 || checks[i].Cost > m.rule.Limit.Limit):
			l.metrics.decision(m.of, m.rule.Name, resultLimited)
			if !never {
				never = true
				res = Result{Outcome: Limited, Never: true, Rule: m.rule, Policy: m.of.ID}
			}
		case !m.rule.Enforce || m.rule.FailOpen:
			l.metrics.decision(m.of, m.rule.Name, resultFailedOpen)
		default:
			l.metrics.decision(m.of, m.rule.Name, resultFailedClosed)
			if !never {
				res = Result{Outcome: Unavailable, RetryAfter: time.Second, Rule: m.rule, Policy: m.of.ID}
			}
		}
	}
	return res
}

func (l *Limiter) result(checks []store.Check, rules []matched, out []algorithm.Decision, charged, cache bool) Result {
	res := Result{Outcome: Allowed}
	closest := 2.0
	for i, m := range rules {
		d := out[i]
		switch {
		case !m.rule.Enforce:
			if d.Allowed {
				l.metrics.decision(m.of, m.rule.Name, resultAllowed)
			} else {
				l.metrics.decision(m.of, m.rule.Name, resultShadowLimited)
			}
			continue
		case !d.Allowed:
			l.metrics.decision(m.of, m.rule.Name, resultLimited)
			if r := (Result{Outcome: Limited, RetryAfter: d.RetryAfter, Never: d.Never, Rule: m.rule, Policy: m.of.ID, Decision: d}); res.Outcome != Limited || outranks(&r, &res) {
				res = r
			}
			if cache {
				l.refusals.put(&checks[i], d, l.now())
			}
		case charged:
			l.metrics.decision(m.of, m.rule.Name, resultAllowed)
		}
		if charged {
			res.Wait = max(res.Wait, d.Wait)
			if share := float64(d.Remaining) / float64(d.Limit); share < closest {
				closest = share
				res.Rule, res.Policy, res.Decision = m.rule, m.of.ID, d
			}
		}
	}
	return res
}

// cachedRefusal answers from the refusal cache when an enforced rule of the request is known to
// refuse it: the store said so, for the same or a lower cost, and the moment it named has not
// come. Nothing else can make that rule admit the request sooner.
func (l *Limiter) cachedRefusal(checks []store.Check, rules []matched) (Result, bool) {
	if l.refusals == nil {
		return Result{}, false
	}
	now := l.now()
	for i := range checks {
		if !checks[i].Enforce {
			continue
		}
		if d, ok := l.refusals.get(&checks[i], now); ok {
			m := rules[i]
			l.metrics.decision(m.of, m.rule.Name, resultLimited)
			l.metrics.cacheHits.Inc()
			return Result{Outcome: Limited, RetryAfter: d.RetryAfter, Rule: m.rule, Policy: m.of.ID, Decision: d}, true
		}
	}
	return Result{}, false
}
