package seam

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

// The answers every front end gives alike: the RateLimit fields, and the RFC 9457 problem that
// describes a refusal or a request that cannot be decided.

// The problem types of what Sluice does not decide.
const (
	// MalformedProblem: the request cannot be decided as sent.
	MalformedProblem = "https://sluice.dev/problems/malformed-request"
	// NotServedProblem: the request names a policy not served here.
	NotServedProblem = "https://sluice.dev/problems/policy-not-served"
)

// SetRateLimitHeaders writes the RateLimit-Policy and RateLimit fields for the rule the result
// describes. set is the response's header setter: http.Header.Set, or the check API server's.
func SetRateLimitHeaders(set func(name, value string), res *limiter.Result) {
	if res.Rule == nil || res.Decision.Limit == 0 || res.Rule.Fields.Policy == "" {
		return
	}
	set("RateLimit-Policy", res.Rule.Fields.Policy)
	set("RateLimit", res.Rule.Fields.Limit(res.Decision.Remaining, policy.Seconds(res.Decision.Reset)))
}

// Problem is an RFC 9457 problem detail.
type Problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail"`
	Policy     string `json:"policy,omitempty"`
	Rule       string `json:"rule,omitempty"`
	RetryAfter int64  `json:"retryAfter,omitempty"`
}

// Refusal describes a refused request: 429 for a limit, 503 when a fail-closed rule's store is
// down. It sets the headers through set and returns the status and the problem+json body. A
// request that can never pass (its cost is over the rule's capacity) gets no Retry-After: no
// time would let it through.
func Refusal(set func(name, value string), res *limiter.Result) (status int, body []byte) {
	p := Describe(res)
	if p.RetryAfter > 0 {
		set("Retry-After", strconv.FormatInt(p.RetryAfter, 10))
	}
	set("Content-Type", "application/problem+json")
	set("Cache-Control", "no-store")
	body, _ = json.Marshal(p) // strings and integers: cannot fail
	return p.Status, append(body, '\n')
}

// Describe is the problem that describes a refused request.
func Describe(res *limiter.Result) Problem {
	retry := max(1, policy.Seconds(res.RetryAfter))
	p := Problem{Policy: res.Policy, RetryAfter: retry}
	if res.Rule != nil {
		p.Rule = res.Rule.Name
	}
	switch {
	case res.Outcome == limiter.Unavailable:
		p.Type, p.Title, p.Status = "https://sluice.dev/problems/store-unavailable", "Service Unavailable", http.StatusServiceUnavailable
		p.Detail = "the rate-limit store is unavailable and rule " + strconv.Quote(p.Rule) + " fails closed"
	case res.Never:
		p.Type, p.Title, p.Status, p.RetryAfter = "https://sluice.dev/problems/never-passes", "Too Many Requests", http.StatusTooManyRequests, 0
		p.Detail = "the request's cost exceeds what rate limit " + strconv.Quote(p.Rule) + " can ever admit; it can never pass"
	case res.Rule != nil && res.Rule.Limit.Kind == algorithm.Concurrency:
		// No clock frees a slot: Retry-After is the shortest the field says, 1, a time to try
		// again rather than a promise.
		p.Type, p.Title, p.Status = "https://sluice.dev/problems/concurrency-limited", "Too Many Requests", http.StatusTooManyRequests
		p.Detail = "concurrency limit " + strconv.Quote(p.Rule) + " allows " + strconv.FormatInt(res.Rule.Limit.Limit, 10) +
			" requests in flight; one frees when a request ends, so no time is promised"
	default:
		p.Type, p.Title, p.Status = "https://sluice.dev/problems/rate-limited", "Too Many Requests", http.StatusTooManyRequests
		p.Detail = "rate limit " + strconv.Quote(p.Rule) + " exceeded; retry after " + strconv.FormatInt(retry, 10) + "s"
	}
	return p
}

// Malformed describes a request that cannot be decided as sent (400, 414, or, for the check API,
// 404): nothing was charged.
func Malformed(set func(name, value string), status int, detail string) []byte {
	p := Problem{Type: MalformedProblem, Title: http.StatusText(status), Status: status, Detail: detail}
	set("Content-Type", "application/problem+json")
	set("Cache-Control", "no-store")
	body, _ := json.Marshal(p)
	return append(body, '\n')
}

// Upgrade is the verdict on a request that asks to switch to protocol before it is decided: nil
// for none and for WebSocket, 400 for anything else. A spliced connection carries requests
// nothing decides: only WebSocket, one request for its whole life, is spliced. h2c upgrades are
// deprecated (RFC 9113, 3.1); HTTP/2 without TLS is served with prior knowledge.
func Upgrade(protocol string) *Verdict {
	if protocol == "" || strings.EqualFold(protocol, "websocket") {
		return nil
	}
	v := Invalid(http.StatusBadRequest, "upgrade to "+strconv.Quote(Abbreviate(protocol))+" refused: only websocket is proxied; speak HTTP/2 with prior knowledge")
	return &v
}
