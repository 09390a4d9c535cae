// Package limiter decides HTTP requests against compiled policies: it matches rules, identifies
// the client, asks the store, and applies each rule's failure mode when the store cannot answer.
package limiter

import (
	crand "crypto/rand"
	"encoding/hex"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/utils/clock"

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
