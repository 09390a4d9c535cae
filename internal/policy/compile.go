// Package policy compiles a RateLimitPolicy into the rules the enforcer runs, and validates what
// the schema cannot say. The schema (its bounds and CEL rules) is run by the API server and, in
// the enforcer's loader, by the API server's own validators over the same CRD; this package
// takes schema-valid input and adds only the checks CEL cannot express: regular expressions
// that compile, a leaky bucket's maxWait within its drain, key parts and header matches that do
// not repeat, requests within limits, a managed Redis's maxMemory within its memory limit, the
// Redis timeout's cap, and the label syntax of bypass sources. The admission webhook, the
// controller and the enforcer all call it, so a policy is judged the same way everywhere.
package policy

import (
	"fmt"
	"net/http"
	"net/netip"
	"regexp"
	"strconv"
	"time"

	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/algorithm"
)

// Policy is a compiled RateLimitPolicy.
type Policy struct {
	// ID is "<namespace>/<name>": the policy's part of every Redis key.
	ID string
	// Namespace and Name are the policy's, apart: the namespace and policy labels of metrics.
	Namespace, Name string
	Rules           []Rule
	TrustedProxies  []netip.Prefix
	// Idempotency, when set, recognizes repeats of a request (spec.retries.idempotencyKey).
	Idempotency *Idempotency
	// RetryJitter is the largest share (0 to 1) added at random to a refusal's Retry-After.
	RetryJitter float64
}

// Idempotency is a compiled spec.retries.idempotencyKey.
type Idempotency struct {
	// Header is canonical.
	Header     string
	Window     time.Duration
	MaxRepeats int64
}

// Rule is a compiled rule.
type Rule struct {
	Name string
	// StateKey names the rule's state in the store, which owns the key layout: the limiter sets
	// it (store.RuleID of the policy, the name and the Limit's Layout) when it takes the policy.
	StateKey string
	Limit    algorithm.Limit
	Cost     int64
	Enforce  bool
	FailOpen bool
	Match    Match
	Key      []KeySource
	// Fields are the rule's RateLimit header members.
	Fields Fields
	// RetryJitter is its policy's (Policy.RetryJitter).
	RetryJitter float64
	// OnResponse is true for a rule charged once its response ends (charge.when Response): a
	// decision checks it, at Cost, without charging it.
	OnResponse bool
	// Statuses are the response statuses a rule charged OnResponse charges; empty, every status.
	Statuses []StatusRange
	// CostFrom, when set, reads the cost of a response from one of its fields.
	CostFrom *CostFrom
	// Lease, when set, lets an enforcer take up to Lease.Max units of a client's limit from
	// Redis at once and decide from them locally (lease); nil, every decision asks the store.
	Lease *Lease
}

// StatusRange is a range of response statuses, both ends included: a code, or a class such as
// 500 to 599.
type StatusRange struct{ From, To int }

// CostFrom is a compiled costFrom: the canonical name of the response field, and the largest
// cost it charges.
type CostFrom struct {
	Header string
	Max    int64
}

// Lease is a compiled lease: the most units one enforcer takes at once, and how long it may use
// them (lease.expiry, 1s when absent).
type Lease struct {
	Max    int64
	Expiry time.Duration
}

// SeesResponse reports whether only a front end that sees the response's end can decide the
// rule: a concurrency limit, released then, or a rule charged by the response.
func (r *Rule) SeesResponse() bool { return r.OnResponse || r.Limit.Kind == algorithm.Concurrency }

// Charges reports whether a rule charged OnResponse charges a response of status code.
func (r *Rule) Charges(code int) bool {
	if len(r.Statuses) == 0 {
		return true
	}
	for _, s := range r.Statuses {
		if code >= s.From && code <= s.To {
			return true
		}
	}
	return false
}

// Match selects requests; the zero Match selects all.
type Match struct {
	Methods []string
	Path    v1alpha1.PathMatchType
	Value   string
	Regexp  *regexp.Regexp
	Headers []HeaderMatch
}

// HeaderMatch is one header condition; Value nil means the header must be present.
type HeaderMatch struct {
	Name  string
	Value *string
}

// KeySource is one part of the client identity; Header is canonical.
type KeySource struct {
	Type   v1alpha1.KeySourceType
	Header string
}

// Compile validates the policy and compiles it. The error, if any, is a field.ErrorList aggregate
// whose entries name the fields.
func Compile(p *v1alpha1.RateLimitPolicy) (*Policy, error) {
	c, errs := compile(p)
	if len(errs) > 0 {
		return nil, errs.ToAggregate()
	}
	return c, nil
}

// Validate returns every problem of the policy, with field paths.
func Validate(p *v1alpha1.RateLimitPolicy) field.ErrorList {
	_, errs := compile(p)
	return errs
}

func compile(p *v1alpha1.RateLimitPolicy) (*Policy, field.ErrorList) {
	spec := field.NewPath("spec")
	var errs field.ErrorList
	out := &Policy{ID: p.Namespace + "/" + p.Name, Namespace: p.Namespace, Name: p.Name}

	defaultOpen := p.Spec.DefaultFailureMode != v1alpha1.FailClosed
	for i := range p.Spec.Rules {
		r := &p.Spec.Rules[i]
		path := spec.Child("rules").Index(i)
		rule, rerrs := compileRule(r, path, defaultOpen)
		errs = append(errs, rerrs...)
		out.Rules = append(out.Rules, rule)
	}
	for i, cidr := range p.Spec.TrustedProxies {
		prefix, err := netip.ParsePrefix(string(cidr))
		if err != nil { // the schema's isCIDR admits nothing else
			errs = append(errs, field.Invalid(spec.Child("trustedProxies").Index(i), cidr, "must be a CIDR such as 10.0.0.0/8 or fd00::/8"))
			continue
		}
		out.TrustedProxies = append(out.TrustedProxies, prefix.Masked())
	}
	if r := p.Spec.Retries; r != nil {
		path := spec.Child("retries")
		if r.RetryAfterJitterPercent != nil {
			out.RetryJitter = float64(*r.RetryAfterJitterPercent) / 100
		}
		if k := r.IdempotencyKey; k != nil {
			out.Idempotency, errs = compileIdempotency(k, path.Child("idempotencyKey"), errs)
		}
		for i := range out.Rules {
			out.Rules[i].RetryJitter = out.RetryJitter
		}
	}
	errs = append(errs, validateSpec(&p.Spec, spec)...)
	return out, errs
}

func compileIdempotency(k *v1alpha1.IdempotencyKey, path *field.Path, errs field.ErrorList) (*Idempotency, field.ErrorList) {
	out := &Idempotency{Header: string(v1alpha1.DefaultIdempotencyHeader), MaxRepeats: int64(v1alpha1.DefaultIdempotencyMaxRepeats)}
	if k.Header != nil {
		out.Header = http.CanonicalHeaderKey(string(*k.Header))
	}
	window := v1alpha1.DefaultIdempotencyWindow
	if k.Window != nil {
		window = *k.Window
	}
	out.Window = duration(window, path.Child("window"), &errs)
	if k.MaxRepeats != nil {
		out.MaxRepeats = int64(*k.MaxRepeats)
	}
	return out, errs
}

func compileRule(r *v1alpha1.Rule, path *field.Path, defaultOpen bool) (Rule, field.ErrorList) {
	rule := Rule{Name: r.Name, Cost: 1, Enforce: r.Mode != v1alpha1.ModeShadow, FailOpen: defaultOpen}
	if r.Cost != nil {
		rule.Cost = *r.Cost
	}
	switch r.FailureMode {
	case v1alpha1.FailOpen:
		rule.FailOpen = true
	case v1alpha1.FailClosed:
		rule.FailOpen = false
	}
	var errs field.ErrorList
	rule.Limit = compileLimit(r, path, &errs)
	if m := r.Match; m != nil {
		rule.Match = compileMatch(m, path.Child("match"), &errs)
	}
	rule.Key = compileKey(r.Key, path.Child("key"), &errs)
	if c := r.Charge; c != nil && c.When == v1alpha1.ChargeWhenResponse {
		rule.OnResponse = true
		for _, st := range c.Statuses { // the schema admits a code or a class: "401", "5xx"
			if st[1:] == "xx" {
				rule.Statuses = append(rule.Statuses, StatusRange{int(st[0]-'0') * 100, int(st[0]-'0')*100 + 99})
			} else if code, err := strconv.Atoi(string(st)); err == nil {
				rule.Statuses = append(rule.Statuses, StatusRange{code, code})
			}
		}
	}
	if cf := r.CostFrom; cf != nil {
		rule.CostFrom = &CostFrom{Header: http.CanonicalHeaderKey(string(cf.ResponseHeader)), Max: cf.Max}
	}
	if l := r.Lease; l != nil {
		expiry := v1alpha1.DefaultLeaseExpiry
		if l.Expiry != nil {
			expiry = *l.Expiry
		}
		rule.Lease = &Lease{Max: l.Max, Expiry: duration(expiry, path.Child("lease", "expiry"), &errs)}
	}
	if len(errs) == 0 {
		rule.Fields = newFields(&rule)
	}
	return rule, errs
}

// compileLimit is the rule's algorithm and parameters. The schema holds a rule to exactly one
// algorithm, its cost to the limit and its durations to their bounds; what it cannot say is a
// leaky bucket's maxWait against the time its queue takes to drain.
func compileLimit(r *v1alpha1.Rule, path *field.Path, errs *field.ErrorList) algorithm.Limit {
	switch {
	case r.TokenBucket != nil:
		b := r.TokenBucket
		return algorithm.Limit{Kind: algorithm.TokenBucket, Limit: b.Capacity, Rate: b.Refill.Tokens,
			Period: duration(b.Refill.Period, path.Child("tokenBucket", "refill", "period"), errs)}
	case r.LeakyBucket != nil:
		return compileLeakyBucket(r.LeakyBucket, path.Child("leakyBucket"), errs)
	case r.FixedWindow != nil:
		return window(algorithm.FixedWindow, r.FixedWindow, path.Child("fixedWindow"), errs)
	case r.SlidingLog != nil:
		return window(algorithm.SlidingLog, r.SlidingLog, path.Child("slidingLog"), errs)
	case r.SlidingWindowCounter != nil:
		return window(algorithm.SlidingWindowCounter, r.SlidingWindowCounter, path.Child("slidingWindowCounter"), errs)
	case r.Concurrency != nil:
		lease := v1alpha1.DefaultLeaseTimeout
		if r.Concurrency.LeaseTimeout != nil {
			lease = *r.Concurrency.LeaseTimeout
		}
		return algorithm.Limit{Kind: algorithm.Concurrency, Limit: r.Concurrency.Limit,
			Period: duration(lease, path.Child("concurrency", "leaseTimeout"), errs)}
	}
	*errs = append(*errs, field.Required(path, "exactly one algorithm must be set: tokenBucket, leakyBucket, fixedWindow, slidingLog, slidingWindowCounter or concurrency"))
	return algorithm.Limit{}
}

func window(kind algorithm.Kind, w *v1alpha1.Window, path *field.Path, errs *field.ErrorList) algorithm.Limit {
	return algorithm.Limit{Kind: kind, Limit: w.Limit, Period: duration(w.Window, path.Child("window"), errs)}
}

func compileLeakyBucket(b *v1alpha1.LeakyBucket, path *field.Path, errs *field.ErrorList) algorithm.Limit {
	l := algorithm.Limit{Kind: algorithm.LeakyBucket, Limit: b.Capacity, Rate: b.Drain.Requests,
		Period: duration(b.Drain.Period, path.Child("drain", "period"), errs)}
	// A full queue drains in capacity intervals: waiting longer is never needed.
	l.MaxWait = l.Horizon()
	if b.MaxWait != nil {
		mw := duration(*b.MaxWait, path.Child("maxWait"), errs)
		if mw > l.MaxWait {
			*errs = append(*errs, field.Invalid(path.Child("maxWait"), *b.MaxWait,
				fmt.Sprintf("must not exceed %v, the time a full queue of %d takes to drain", l.MaxWait, b.Capacity)))
		}
		l.MaxWait = mw
	}
	return l
}

// compileMatch is the rule's match: the schema holds paths to start with '/' (but regular
// expressions); a regular expression must compile, and header conditions must not repeat.
func compileMatch(m *v1alpha1.Match, path *field.Path, errs *field.ErrorList) Match {
	var out Match
	for _, method := range m.Methods {
		out.Methods = append(out.Methods, string(method))
	}
	if m.Path != nil {
		out.Path, out.Value = m.Path.Type, m.Path.Value
		if out.Path == "" {
			out.Path = v1alpha1.PathMatchPrefix
		}
		if out.Path == v1alpha1.PathMatchRegularExpression {
			re, err := regexp.Compile("^(?:" + m.Path.Value + ")$")
			if err != nil {
				*errs = append(*errs, field.Invalid(path.Child("path", "value"), m.Path.Value, "must be a valid RE2 regular expression: "+err.Error()))
			}
			out.Regexp = re
		}
	}
	headers := map[string]bool{}
	for i, h := range m.Headers {
		canonical := http.CanonicalHeaderKey(string(h.Name))
		if headers[canonical] {
			*errs = append(*errs, field.Invalid(path.Child("headers").Index(i).Child("name"), h.Name,
				"must not repeat a header of this match: header names are compared without regard to case, and all conditions must hold"))
		}
		headers[canonical] = true
		out.Headers = append(out.Headers, HeaderMatch{Name: canonical, Value: h.Value})
	}
	return out
}

// compileKey is the rule's client key; no part of it may repeat another.
func compileKey(key []v1alpha1.KeySource, path *field.Path, errs *field.ErrorList) []KeySource {
	var out []KeySource
	parts := map[KeySource]bool{}
	for i, k := range key {
		ks := KeySource{Type: k.Type}
		if k.Type == v1alpha1.KeyHeader && k.Name != nil { // the schema requires the name
			ks.Header = http.CanonicalHeaderKey(string(*k.Name))
		}
		if parts[ks] {
			*errs = append(*errs, field.Duplicate(path.Index(i), describeKey(ks)))
		}
		parts[ks] = true
		out = append(out, ks)
	}
	return out
}

func describeKey(k KeySource) string {
	if k.Type == v1alpha1.KeyHeader {
		return "Header " + k.Header
	}
	return string(k.Type)
}

// duration parses a duration the schema admitted (whole h, m, s and ms, from 1ms to 720h).
func duration(d v1alpha1.Duration, path *field.Path, errs *field.ErrorList) time.Duration {
	v, err := d.Parse()
	if err != nil {
		*errs = append(*errs, field.Invalid(path, d, "must be a duration such as 500ms, 1s, 1m30s or 24h"))
	}
	return v
}
