// Package policy compiles a RateLimitPolicy into the rules the enforcer runs, and validates what
// the schema cannot. The admission webhook, the controller and the enforcer all call it, so a
// policy is judged the same way everywhere.
package policy

import (
	"fmt"
	"net/http"
	"net/netip"
	"regexp"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/algorithm"
)

// Duration bounds. Shorter windows are noise at Redis round-trip scale; longer ones outlive any
// sensible key TTL.
const (
	MinDuration = time.Millisecond
	MaxDuration = 30 * 24 * time.Hour
)

// MaxSlidingLogLimit bounds a sliding log's limit: its key holds one entry per admitted unit, about
// 40 bytes each in Redis, so a key stays under about 400 KB.
const MaxSlidingLogLimit = 10_000

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
	// StateKey names the rule's state in a store (store.RuleID): a hash of its policy, its name
	// and its Limit's Layout.
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

	if len(p.Spec.Rules) == 0 {
		errs = append(errs, field.Required(spec.Child("rules"), "at least one rule is required"))
	}
	seen := map[string]bool{}
	defaultOpen := p.Spec.DefaultFailureMode != v1alpha1.FailClosed
	for i := range p.Spec.Rules {
		r := &p.Spec.Rules[i]
		path := spec.Child("rules").Index(i)
		if seen[r.Name] {
			errs = append(errs, field.Duplicate(path.Child("name"), r.Name))
		}
		seen[r.Name] = true
		rule, rerrs := compileRule(r, path, defaultOpen)
		errs = append(errs, rerrs...)
		if len(rerrs) == 0 {
			rule.StateKey = RuleID(out.ID, rule.Name, rule.Limit.Layout())
		}
		out.Rules = append(out.Rules, rule)
	}
	for i, cidr := range p.Spec.TrustedProxies {
		prefix, err := netip.ParsePrefix(string(cidr))
		if err != nil {
			errs = append(errs, field.Invalid(spec.Child("trustedProxies").Index(i), cidr, "must be a CIDR such as 10.0.0.0/8 or fd00::/8"))
			continue
		}
		out.TrustedProxies = append(out.TrustedProxies, prefix.Masked())
	}
	if r := p.Spec.Retries; r != nil {
		path := spec.Child("retries")
		if r.RetryAfterJitterPercent != nil {
			if j := *r.RetryAfterJitterPercent; j < 1 || j > 100 {
				errs = append(errs, field.Invalid(path.Child("retryAfterJitterPercent"), j, "must be from 1 to 100"))
			} else {
				out.RetryJitter = float64(j) / 100
			}
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

// Bounds of spec.retries.idempotencyKey.window.
const (
	MinIdempotencyWindow = time.Second
	MaxIdempotencyWindow = 24 * time.Hour
)

func compileIdempotency(k *v1alpha1.IdempotencyKey, path *field.Path, errs field.ErrorList) (*Idempotency, field.ErrorList) {
	out := &Idempotency{Header: string(v1alpha1.DefaultIdempotencyHeader), MaxRepeats: int64(v1alpha1.DefaultIdempotencyMaxRepeats)}
	if k.Header != nil {
		out.Header = http.CanonicalHeaderKey(string(*k.Header))
	}
	window := v1alpha1.DefaultIdempotencyWindow
	if k.Window != nil {
		window = *k.Window
	}
	before := len(errs)
	out.Window = duration(window, path.Child("window"), &errs)
	if len(errs) == before && (out.Window < MinIdempotencyWindow || out.Window > MaxIdempotencyWindow) {
		errs = append(errs, field.Invalid(path.Child("window"), window, "window must be at least 1s and at most 24h"))
	}
	if k.MaxRepeats != nil {
		if m := *k.MaxRepeats; m < 1 || m > 100 {
			errs = append(errs, field.Invalid(path.Child("maxRepeats"), m, "must be from 1 to 100"))
		} else {
			out.MaxRepeats = int64(m)
		}
	}
	return out, errs
}

func compileRule(r *v1alpha1.Rule, path *field.Path, defaultOpen bool) (Rule, field.ErrorList) {
	var errs field.ErrorList
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

	var algs []string
	var capName string
	if b := r.TokenBucket; b != nil {
		algs = append(algs, "tokenBucket")
		p := path.Child("tokenBucket")
		rule.Limit = algorithm.Limit{Kind: algorithm.TokenBucket, Limit: b.Capacity, Rate: b.Refill.Tokens}
		rule.Limit.Period = duration(b.Refill.Period, p.Child("refill", "period"), &errs)
		capName = "tokenBucket.capacity"
	}
	if b := r.LeakyBucket; b != nil {
		algs = append(algs, "leakyBucket")
		p := path.Child("leakyBucket")
		rule.Limit = algorithm.Limit{Kind: algorithm.LeakyBucket, Limit: b.Capacity, Rate: b.Drain.Requests}
		rule.Limit.Period = duration(b.Drain.Period, p.Child("drain", "period"), &errs)
		capName = "leakyBucket.capacity"
		// A full queue drains in capacity intervals: waiting longer is never needed.
		var drainAll time.Duration
		if b.Drain.Requests > 0 {
			drainAll = time.Duration(float64(rule.Limit.Period) * float64(b.Capacity) / float64(b.Drain.Requests))
		}
		rule.Limit.MaxWait = drainAll
		if b.MaxWait != nil {
			mw := duration(*b.MaxWait, p.Child("maxWait"), &errs)
			if mw > drainAll && drainAll > 0 {
				errs = append(errs, field.Invalid(p.Child("maxWait"), *b.MaxWait,
					fmt.Sprintf("must not exceed %v, the time a full queue of %d takes to drain", drainAll, b.Capacity)))
			}
			rule.Limit.MaxWait = mw
		}
	}
	windows := []struct {
		name string
		w    *v1alpha1.Window
		kind algorithm.Kind
	}{
		{"fixedWindow", r.FixedWindow, algorithm.FixedWindow},
		{"slidingLog", r.SlidingLog, algorithm.SlidingLog},
		{"slidingWindowCounter", r.SlidingWindowCounter, algorithm.SlidingWindowCounter},
	}
	for _, w := range windows {
		if w.w == nil {
			continue
		}
		algs = append(algs, w.name)
		p := path.Child(w.name)
		rule.Limit = algorithm.Limit{Kind: w.kind, Limit: w.w.Limit}
		rule.Limit.Period = duration(w.w.Window, p.Child("window"), &errs)
		capName = w.name + ".limit"
		if w.kind == algorithm.SlidingLog && w.w.Limit > MaxSlidingLogLimit {
			errs = append(errs, field.Invalid(p.Child("limit"), w.w.Limit, fmt.Sprintf(
				"must be at most %d: a sliding log keeps one entry per admitted unit; use slidingWindowCounter for larger limits", MaxSlidingLogLimit)))
		}
	}
	switch {
	case len(algs) == 0:
		errs = append(errs, field.Required(path, "exactly one algorithm must be set: tokenBucket, leakyBucket, fixedWindow, slidingLog or slidingWindowCounter"))
	case len(algs) > 1:
		errs = append(errs, field.Invalid(path, strings.Join(algs, ", "), "exactly one algorithm must be set"))
	case rule.Cost > rule.Limit.Limit && rule.Limit.Limit > 0:
		errs = append(errs, field.Invalid(path.Child("cost"), rule.Cost,
			fmt.Sprintf("must not exceed %s (%d): such a request could never pass", capName, rule.Limit.Limit)))
	}

	if m := r.Match; m != nil {
		p := path.Child("match")
		for _, method := range m.Methods {
			rule.Match.Methods = append(rule.Match.Methods, string(method))
		}
		if m.Path != nil {
			rule.Match.Path, rule.Match.Value = m.Path.Type, m.Path.Value
			if rule.Match.Path == "" {
				rule.Match.Path = v1alpha1.PathMatchPrefix
			}
			if rule.Match.Path == v1alpha1.PathMatchRegularExpression {
				re, err := regexp.Compile("^(?:" + m.Path.Value + ")$")
				if err != nil {
					errs = append(errs, field.Invalid(p.Child("path", "value"), m.Path.Value, "must be a valid RE2 regular expression: "+err.Error()))
				}
				rule.Match.Regexp = re
			} else if !strings.HasPrefix(m.Path.Value, "/") {
				errs = append(errs, field.Invalid(p.Child("path", "value"), m.Path.Value, "must start with '/' for types Exact and Prefix"))
			}
		}
		headers := map[string]bool{}
		for i, h := range m.Headers {
			name := p.Child("headers").Index(i).Child("name")
			canonical := http.CanonicalHeaderKey(string(h.Name))
			if headers[canonical] {
				errs = append(errs, field.Invalid(name, h.Name, "must not repeat a header of this match: header names are compared without regard to case, and all conditions must hold"))
			}
			headers[canonical] = true
			rule.Match.Headers = append(rule.Match.Headers, HeaderMatch{Name: http.CanonicalHeaderKey(string(h.Name)), Value: h.Value})
		}
	}
	parts := map[KeySource]bool{}
	for i, k := range r.Key {
		ks := KeySource{Type: k.Type}
		if k.Type == v1alpha1.KeyHeader {
			if k.Name != nil { // the schema requires it
				ks.Header = http.CanonicalHeaderKey(string(*k.Name))
			}
		}
		if parts[ks] {
			errs = append(errs, field.Duplicate(path.Child("key").Index(i), describeKey(ks)))
		}
		parts[ks] = true
		rule.Key = append(rule.Key, ks)
	}
	if len(errs) == 0 {
		rule.Fields = newFields(&rule)
	}
	return rule, errs
}

func describeKey(k KeySource) string {
	if k.Type == v1alpha1.KeyHeader {
		return "Header " + k.Header
	}
	return string(k.Type)
}

func duration(d v1alpha1.Duration, path *field.Path, errs *field.ErrorList) time.Duration {
	v, err := d.Parse()
	switch {
	case err != nil:
		*errs = append(*errs, field.Invalid(path, d, "must be a duration such as 500ms, 1s, 1m30s or 24h"))
	case v < MinDuration || v > MaxDuration:
		*errs = append(*errs, field.Invalid(path, d, "must be at least 1ms and at most 720h (30 days)"))
	case v%time.Millisecond != 0:
		*errs = append(*errs, field.Invalid(path, d, "must be a whole number of milliseconds"))
	default:
		return v
	}
	return 0
}
