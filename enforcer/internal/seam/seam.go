// Package seam is the decision seam. Every front end (the HTTP/1.1 proxy, the h2c proxy, the
// check API and Envoy's rate limit service) turns its request into an Input, calls Decide, and
// maps the one Verdict to its protocol. What the seam fixes for all of them, so that none can
// drift:
//
//   - the context: detached from the client and bounded by the store's own deadline. A client
//     that leaves while its decision is in flight neither fails the store (which would open the
//     breaker for everyone) nor skips the charge; it is counted apart, where the protocol tells;
//   - the path: the request target decoded, dot segments resolved and repeated slashes merged,
//     as fasthttp reads it; the query dropped; a path and query over MaxTargetBytes is 414, a
//     target that is not a path or an absolute URI, or holds a '#', 400;
//   - the method, upper-cased: a rule for GET also decides "get";
//   - the identity: the limiter's ClientAddr and ClientKey, where a repeated key header is 400;
//   - the verdict's status and fields (Verdict.Write), the hold of a queued request (Hold), and
//     the upgrades a proxy refuses (Upgrade);
//   - for the proxies, which see responses (Input.SeesResponse), what an admitted request owes
//     when it ends: the limiter takes the leases of its concurrency rules with the decision and
//     renews them while it lasts, and the proxy tells its end once, through Owed.End (the
//     response's last byte, an upgraded connection's end, or its client gone) or Owed.Drop
//     (never forwarded), which releases the leases and charges the rules charged by the
//     response, in one store call in the background. The check API and RLS cannot see a
//     response end: the limiter skips such rules for them, and counts them skipped.
//
// A front end keeps only what its protocol needs: where the method and target come from, the
// nginx endpoint's statuses, the gRPC codes. docs/enforcer.md lists what still differs.
package seam

import (
	"context"
	"encoding/json"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

// MaxTargetBytes bounds a request target's path and query (an absolute URI's authority aside): a
// longer one is answered 414 by every front end before anything is decided.
const MaxTargetBytes = 8 << 10

// MaxHeaderBytes bounds a request's line and header block on every listener (431 past it), and
// an upstream response's status line and header block through the proxy (502 past it: big
// cookies and security policies pass, an upstream that never ends its header does not).
const MaxHeaderBytes = 64 << 10

// MaxStreams bounds the concurrent streams of one HTTP/2 connection: a client's (h2c and gRPC),
// and the proxy's to an HTTP/2 upstream.
const MaxStreams = 100

// Input is what a front end makes of its request.
type Input struct {
	// Method and Target are as received: the target is the path and query, or an absolute URI.
	Method, Target string
	Header         policy.Header
	Peer           netip.Addr
	// Policy, when set, names the one policy ("<namespace>/<name>") whose rules decide.
	Policy string
	// Gone closes when the client leaves, where the protocol tells: an h2c stream reset, a closed
	// HTTP/1.1 connection under net/http. Nil where it cannot tell without reading the connection
	// (fasthttp's HTTP/1.1, which learns it while holding a queued request, see conns.Hold).
	Gone <-chan struct{}
	// SeesResponse is true for the proxies, which end every request they admit (Owed.End or
	// Owed.Drop): only they decide concurrency rules and rules charged by the response.
	SeesResponse bool
}

// Verdict is the seam's answer.
type Verdict struct {
	limiter.Result
	// Status is the HTTP status that answers it: 200 (allowed, after Result.Wait), 429 (limited),
	// 503 (a fail-closed rule's store unavailable), or 400 and 414 for input that cannot be
	// decided, with Detail saying why.
	Status int
	Detail string
}

// Invalid is the verdict on input the seam refuses to decide.
func Invalid(status int, detail string) Verdict {
	return Verdict{Result: limiter.Result{Outcome: limiter.Invalid}, Status: status, Detail: detail}
}

// Request turns an input into the limiter's request, or says why it cannot be decided.
func (in *Input) Request() (limiter.Request, *Verdict) {
	path, bad := requestPath(in.Target)
	if bad != nil {
		return limiter.Request{}, bad
	}
	return limiter.Request{Method: strings.ToUpper(in.Method), Path: path, Header: in.Header, Peer: in.Peer, Policy: in.Policy, SeesResponse: in.SeesResponse}, nil
}

// Decide decides one HTTP request, detached from its client; a client that left meanwhile is
// counted (Limiter.Left).
func Decide(l *limiter.Limiter, in *Input) Verdict {
	req, bad := in.Request()
	if bad != nil {
		return *bad
	}
	v := Judge(l.Decide(context.Background(), &req))
	if in.Gone != nil {
		select {
		case <-in.Gone:
			l.Left()
		default:
		}
	}
	return v
}

// Owed is what an admitted request owes when it ends (its limiter.Pending), which a proxy keeps
// past the decision: a pointer, so that keeping it moves no verdict to the heap.
type Owed struct{ p *limiter.Pending }

// Owed is what the verdict's request owes; nothing for a refusal.
func (v *Verdict) Owed() Owed { return Owed{v.Pending} }

// End ends an admitted request once its response is complete, with its status and a reader of a
// response field's values (header and trailer, copied), or once its client is gone before its
// response (status 0, fields nil): its leases are released and the rules charged by the
// response charged. The proxies call End or Drop exactly once per admitted request; a request
// that owes nothing ignores both.
func (o Owed) End(status int, fields func(name string) []string) { o.p.End(status, fields) }

// Cut ends an admitted request whose response began but whose body did not end (its client left
// during it, or the upstream broke it off): as End, but a rule with costFrom whose response
// reported no valid cost in its header is charged costFrom.max (limiter.Pending.Cut).
func (o Owed) Cut(status int, fields func(name string) []string) { o.p.Cut(status, fields) }

// Drop ends an admitted request that was never forwarded: its leases are released, and nothing
// is charged.
func (o Owed) Drop() { o.p.Drop() }

// Owes reports whether the request owes anything at its end.
func (o Owed) Owes() bool { return o.p != nil }

// Holds reports whether the request holds concurrency slots, which its work at the upstream
// should not outlive: a proxy that can, ends that work when its client leaves.
func (o Owed) Holds() bool { return o.p.Holds() }

// Judge gives a limiter's result its HTTP status.
func Judge(res limiter.Result) Verdict {
	v := Verdict{Result: res, Status: http.StatusOK}
	switch res.Outcome {
	case limiter.Limited:
		v.Status = http.StatusTooManyRequests
	case limiter.Unavailable:
		v.Status = http.StatusServiceUnavailable
	case limiter.Invalid:
		v.Status, v.Detail = http.StatusBadRequest, res.Reason
	}
	return v
}

// requestPath is the path a request target decides on: decoded, with dot segments resolved and
// repeated slashes merged, without the query. An absolute URI (the absolute form of a request
// target, or nginx's $scheme://$http_host$request_uri) decides on its path, whatever its
// authority holds: the upstream reads the path, and a Host that does not parse must not make
// the path unreadable.
func requestPath(target string) (string, *Verdict) {
	if strings.IndexByte(target, '#') >= 0 {
		// No request target has a fragment (RFC 9112, 3.2). fasthttp would cut the path there,
		// while an upstream that reads the '#' as part of the path and resolves "/x#/../admin"
		// serves /admin: the two must not read one target two ways.
		v := Invalid(http.StatusBadRequest, "request target "+strconv.Quote(Abbreviate(target))+" holds a '#': a request target has no fragment")
		return "", &v
	}
	if !strings.HasPrefix(target, "/") {
		scheme, rest, ok := strings.Cut(target, "://")
		if !ok || scheme == "" || strings.ContainsAny(scheme, "/?#") {
			v := Invalid(http.StatusBadRequest, "request target "+strconv.Quote(Abbreviate(target))+" is neither a path nor an absolute URI")
			return "", &v
		}
		i := strings.IndexAny(rest, "/?#")
		if i < 0 {
			return "/", nil
		}
		target = rest[i:]
	}
	// The bound is on the path and query, whatever form carries them: nginx's absolute URI adds
	// the client's Host, which the proxy's origin form does not count.
	if len(target) > MaxTargetBytes {
		v := Invalid(http.StatusRequestURITooLong, "request target over "+strconv.Itoa(MaxTargetBytes)+" bytes")
		return "", &v
	}
	u := fasthttp.AcquireURI()
	defer fasthttp.ReleaseURI(u)
	// A host of our own: without one, "//admin" would be parsed as an authority, not a path.
	if err := u.Parse([]byte("sluice"), []byte(target)); err != nil {
		v := Invalid(http.StatusBadRequest, "request target "+strconv.Quote(Abbreviate(target))+" does not parse: "+err.Error())
		return "", &v
	}
	return string(u.Path()), nil
}

// Abbreviate shortens what a message quotes from a client.
func Abbreviate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// Write answers a verdict through a response's header setter: the RateLimit fields of the rule
// it describes and, for anything but 200, Retry-After (429 and 503) and an RFC 9457 problem,
// whose body it returns.
func (v *Verdict) Write(set func(name, value string)) []byte {
	SetRateLimitHeaders(set, &v.Result)
	switch v.Status {
	case http.StatusOK:
		return nil
	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
		_, body := Refusal(set, &v.Result)
		return body
	}
	return Malformed(set, v.Status, v.Detail)
}

// Hold keeps an allowed request for its wait, as a leaky bucket's queue does, and reports false
// as soon as gone closes: the client left, nobody reads the answer, and the request is released
// and counted (Limiter.Left).
func Hold(l *limiter.Limiter, wait time.Duration, gone <-chan struct{}) bool {
	if wait <= 0 {
		return true
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-gone:
		l.Left()
		return false
	}
}

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
