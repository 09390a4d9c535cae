package limiter

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

// The decision path, from a request to its result: its matching rules' checks (collect), the
// refusal cache, the store behind its breaker, the failure modes, and what an admitted request
// owes. A request is decided as a batch of one: Decide and DecideAll (Envoy's descriptors) go
// through decideAll alike.

// decideBufs hold one decision's checks, rules, decisions and the bounds of its requests' checks.
// They reach the store through an interface, so arrays on Decide's stack would escape, a
// kilobyte of garbage per request; a pool keeps them. Nothing keeps a reference once Decide
// returns: the Redis store copies what it sends, and the refusal cache copies the keys.
type decideBufs struct {
	checks [8]store.Check
	rules  [8]matched
	out    [8]algorithm.Decision
	bounds [9]int
}

var bufPool = sync.Pool{New: func() any { return new(decideBufs) }}

// Decide decides one request. A refusal is logged at V(1) (the enforcer's --log-level=debug), one
// line each, naming its policy and rule, never the client.
func (l *Limiter) Decide(ctx context.Context, req *Request) Result {
	var per [1]Result
	res := l.decideAll(ctx, []Request{*req}, per[:])
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

// DecideAll decides several requests as one: every rule that matches any of them is checked, and
// all are charged or none (Envoy's rate limit service asks for one request's descriptors so). It
// returns each request's result and the overall one (reports): a refusal, the one with the
// longest Retry-After, or else the admission whose rule is closest to its limit.
func (l *Limiter) DecideAll(ctx context.Context, reqs []Request) ([]Result, Result) {
	per := make([]Result, len(reqs))
	return per, l.decideAll(ctx, reqs, per)
}

// batch is the checks of requests decided together, and their rules: request i's are from
// bounds[i] to bounds[i+1]. idem is true when a request names its repeats (an idempotency key).
type batch struct {
	checks []store.Check
	rules  []matched
	bounds []int
	idem   bool
}

// of is the index of the request whose check is checks[i].
func (b *batch) of(i int) int {
	r := 0
	for b.bounds[r+1] <= i {
		r++
	}
	return r
}

// gather collects the checks of every request into bufs, or says why one cannot be decided.
func (l *Limiter) gather(reqs []Request, bufs *decideBufs) (batch, string) {
	b := batch{checks: bufs.checks[:0], rules: bufs.rules[:0]}
	if len(reqs) < len(bufs.bounds) {
		b.bounds = bufs.bounds[:len(reqs)+1]
	} else {
		b.bounds = make([]int, len(reqs)+1)
	}
	for i := range reqs {
		var key, invalid string
		from := len(b.checks)
		b.checks, b.rules, key, invalid = l.collect(&reqs[i], b.checks, b.rules)
		if invalid != "" {
			return b, invalid
		}
		c, r := l.skip(b.checks[from:], b.rules[from:])
		b.checks, b.rules = b.checks[:from+len(c)], b.rules[:from+len(r)]
		b.bounds[i+1], b.idem = len(b.checks), b.idem || key != ""
	}
	return b, ""
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

// collect appends the checks and rules of the rules that match a request, and returns the first
// idempotency key the request sends to a policy that asks for one. A request that repeats a
// header a matching rule keys on, or its policy's idempotency header, cannot be decided: the
// upstream reads one of the values, and which one is not ours to guess. invalid says why.
func (l *Limiter) collect(req *Request, checks []store.Check, rules []matched) (_ []store.Check, _ []matched, idemKey, invalid string) {
	c := collector{l: l, hits: max(1, req.Hits), seesResponse: req.SeesResponse, checks: checks, rules: rules}
	if req.CheckOnly {
		c.hits = 0
	}
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
		idemValue, invalid := idempotencyValue(p, req.Header)
		if invalid == "" {
			invalid = c.policy(p, req, idemValue)
		}
		if invalid != "" {
			return c.checks, c.rules, "", invalid
		}
		if idemKey == "" {
			idemKey = idemValue
		}
	}
	return c.checks, c.rules, idemKey, ""
}

// collector gathers the checks of one request's matching rules, policy by policy.
// (Not the request itself, which would then leave the stack.)
type collector struct {
	l            *Limiter
	hits         int64
	seesResponse bool
	// lease is the request's name, made once a rule needs it (leaseName).
	lease  string
	checks []store.Check
	rules  []matched
}

// idempotencyValue is the idempotency key a request sends to a policy that asks for one, "" for
// none; or why the request cannot be decided.
func idempotencyValue(p *policy.Policy, h policy.Header) (value, invalid string) {
	if p.Idempotency == nil {
		return "", ""
	}
	v := h.Values(p.Idempotency.Header)
	switch {
	case len(v) > 1:
		return "", repeated(p.Idempotency.Header, "")
	case len(v) == 1:
		return v[0], ""
	}
	return "", ""
}

// policy appends the checks of the rules of p that match req, whose idempotency key for p is
// idemValue ("" for none), or says why the request cannot be decided.
func (c *collector) policy(p *policy.Policy, req *Request, idemValue string) string {
	var addr netip.Addr
	var idem *store.Idempotency
	var lastKey, lastTag string // rules of a policy often share their client key
	for i := range p.Rules {
		r := &p.Rules[i]
		if !r.Match.Matches(req.Method, req.Path, req.Header) || req.KeysRequired && !req.carries(r) {
			continue
		}
		if name := RepeatedKeyHeader(r.Key, req.Header); name != "" {
			return repeated(name, r.Name)
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
		if len(c.checks) == MaxChecks {
			return "the request matches more than " + strconv.Itoa(MaxChecks) + " rules; at most that many are decided at once"
		}
		c.add(p, r, store.Check{Limit: r.Limit, Cost: mulCost(r.Cost, c.hits), Enforce: r.Enforce, Tag: lastTag, Rule: r.StateKey, Idempotency: idem, UnitLease: r.Lease})
	}
	return ""
}

// add appends a rule's check. A rule that only a front end that sees responses decides is, for
// any other, marked skipped by no check (see skip); for one that does, its check carries the
// request's lease name.
func (c *collector) add(p *policy.Policy, r *policy.Rule, check store.Check) {
	if r.SeesResponse() {
		if !c.seesResponse {
			check = store.Check{}
		} else {
			if c.lease == "" {
				c.lease = c.l.leaseName()
			}
			check.Lease, check.Deferred = c.lease, r.OnResponse
			if r.Limit.Kind == algorithm.Concurrency {
				// A repeat is in flight as any request is: it holds a slot of its own.
				check.Idempotency = nil
			}
		}
	}
	c.checks = append(c.checks, check)
	c.rules = append(c.rules, matched{r, p})
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

// decideAll decides reqs as one, writes each request's result to per, and returns the overall
// one, which carries what the admitted requests owe (Pending).
func (l *Limiter) decideAll(ctx context.Context, reqs []Request, per []Result) Result {
	bufs := bufPool.Get().(*decideBufs)
	defer func() {
		*bufs = decideBufs{} // no strings or rules kept alive by the pool
		bufPool.Put(bufs)
	}()
	b, invalid := l.gather(reqs, bufs)
	switch {
	case invalid != "":
		return fill(per, Result{Outcome: Invalid, Reason: invalid})
	case len(b.checks) == 0:
		return fill(per, Result{Outcome: Allowed})
	}
	// A request that names its repeats is always asked of the store: a repeat of an admitted
	// request passes whatever the limits say now, and a refusal the store forced on a repeat
	// says nothing of the client's other requests, so neither may touch the refusal cache.
	if !b.idem {
		if res, i, ok := l.cachedRefusal(b.checks, b.rules); ok {
			fill(per, Result{Outcome: Allowed})
			r := &per[b.of(i)]
			*r = res
			jitter(r)
			return *r
		}
	}
	merged, same := mergeRepeats(b.checks)
	out := bufs.out[:0]
	if len(merged) > len(bufs.out) {
		out = make([]algorithm.Decision, 0, len(merged))
	}
	out = out[:len(merged)]
	start := time.Now()
	charged, err := l.decide(ctx, merged, out)
	l.metrics.storeLatency.Observe(time.Since(start).Seconds())
	if err != nil {
		return l.failed(ctx, &b, merged, same, per, err)
	}
	out = spread(out, same)
	// A refusal is cached for its check's cost; a merged check was refused at the sum of several.
	cache := !b.idem && same == nil
	for i := range per {
		lo, hi := b.bounds[i], b.bounds[i+1]
		per[i] = l.result(b.checks[lo:hi], b.rules[lo:hi], out[lo:hi], charged, cache)
		jitter(&per[i])
	}
	res := overall(per)
	if charged {
		res.Pending = l.pending(b.checks, b.rules, out)
	}
	return res
}

// failed decides requests whose store call failed: by their rules' failure modes, or, when their
// caller left, as cancelled.
func (l *Limiter) failed(ctx context.Context, b *batch, merged []store.Check, same []int, per []Result, err error) Result {
	if cancelled(ctx, err) {
		return fill(per, l.cancelled(b.rules))
	}
	l.storeFailed(b.rules, err)
	// A merged check's cost is the sum its requests asked for together: the one that can never
	// pass when the store cannot answer either.
	for i, j := range same {
		b.checks[i].Cost = merged[j].Cost
	}
	for i := range per {
		lo, hi := b.bounds[i], b.bounds[i+1]
		per[i] = l.failureModes(b.checks[lo:hi], b.rules[lo:hi])
	}
	res := overall(per)
	if res.Outcome == Allowed {
		// The script may have run before the store failed to answer: its leases are released
		// all the same, and the response is charged if the store is back by then.
		res.Pending = l.pending(b.checks, b.rules, nil)
	}
	return res
}

// fill gives every request the result res, and returns it.
func fill(per []Result, res Result) Result {
	for i := range per {
		per[i] = res
	}
	return res
}

// overall is the result of requests decided together (reports), holding the longest wait of
// all when they are admitted.
func overall(per []Result) Result {
	if len(per) == 1 {
		return per[0]
	}
	res, wait := per[0], time.Duration(0)
	for i := range per {
		if i > 0 && reports(&per[i], &res) {
			res = per[i]
		}
		wait = max(wait, per[i].Wait)
	}
	if res.Outcome == Allowed {
		res.Wait = wait
	}
	return res
}

// outranks reports whether refusal a is the one to report rather than b: one that can never pass
// first, then the longest Retry-After.
func outranks(a, b *Result) bool {
	if a.Never != b.Never {
		return a.Never
	}
	return a.RetryAfter > b.RetryAfter
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

// mergeRepeats folds the checks of one rule and one client that several requests decided together
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
func jitter(res *Result) {
	if res.Outcome != Limited || res.Rule == nil || res.Rule.RetryJitter <= 0 {
		return
	}
	extra := time.Duration(rand.Float64() * res.Rule.RetryJitter * float64(res.RetryAfter))
	res.RetryAfter += extra
	res.Decision.RetryAfter = res.RetryAfter
	res.Decision.Reset = max(res.Decision.Reset, res.RetryAfter)
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
// decision was made detached from the client (the seam, enforcer/internal/seam), so the store neither
// failed nor was skipped, and nobody reads the answer (sluice_decisions_cancelled_total).
func (l *Limiter) Left() { l.metrics.cancelled.Inc() }

// storeFailed counts a store call that failed, and logs the first fault of each of its rules.
func (l *Limiter) storeFailed(rules []matched, err error) {
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
}

// failureModes decides a request when the store cannot: fail-open rules let the request
// through, and any enforced fail-closed rule refuses it with 503. A cost that an enforced rule
// can never admit (over its capacity or limit, as hits make it) is refused as never passing
// first: the store would have refused it whatever its state, so no failure mode may admit it.
// Its decision has no state to show (Decision.Limit 0: no RateLimit fields).
func (l *Limiter) failureModes(checks []store.Check, rules []matched) Result {
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
// come. Nothing else can make that rule admit the request sooner. It returns the refusal and the
// index of the check it is of.
func (l *Limiter) cachedRefusal(checks []store.Check, rules []matched) (Result, int, bool) {
	if l.refusals == nil {
		return Result{}, 0, false
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
			return Result{Outcome: Limited, RetryAfter: d.RetryAfter, Rule: m.rule, Policy: m.of.ID, Decision: d}, i, true
		}
	}
	return Result{}, 0, false
}
