package enforcer

import (
	"context"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/policy"
)

// The decision seam. Every front end (the HTTP/1.1 proxy, the h2c proxy, the check API and
// Envoy's rate limit service) turns its request into an input, calls decide, and maps the one
// verdict to its protocol. What the seam fixes for all of them, so that none can drift:
//
//   - the context: detached from the client and bounded by the store's own deadline. A client
//     that leaves while its decision is in flight neither fails the store (which would open the
//     breaker for everyone) nor skips the charge; it is counted apart, where the protocol tells;
//   - the path: the request target decoded, dot segments resolved and repeated slashes merged,
//     as fasthttp reads it; the query dropped; a path and query over MaxTargetBytes is 414, a
//     target that is not a path or an absolute URI, or holds a '#', 400;
//   - the method, upper-cased: a rule for GET also decides "get";
//   - the identity: the limiter's ClientAddr and ClientKey, where a repeated key header is 400;
//   - the verdict's status and fields (verdict.write), and the hold of a queued request (hold);
//   - for the proxies, which see responses (input.seesResponse), what an admitted request owes
//     when it ends: the limiter takes the leases of its concurrency rules with the decision and
//     renews them while it lasts, and the proxy tells its end once, through verdict.end (the
//     response's last byte, an upgraded connection's end, or its client gone) or verdict.drop
//     (never forwarded), which releases the leases and charges the rules charged by the
//     response, in one store call in the background. The check API and RLS cannot see a
//     response end: the limiter skips such rules for them, and counts them skipped.
//
// A front end keeps only what its protocol needs: where the method and target come from, the
// nginx endpoint's statuses, the gRPC codes. docs/enforcer.md lists what still differs.

// MaxTargetBytes bounds a request target's path and query (an absolute URI's authority aside): a
// longer one is answered 414 by every front end before anything is decided.
const MaxTargetBytes = 8 << 10

// MaxHeaderBytes bounds a request's line and header block on every listener (431 past it), and
// an upstream response's status line and header block through the proxy (502 past it: big
// cookies and security policies pass, an upstream that never ends its header does not).
const MaxHeaderBytes = 64 << 10

// input is what a front end makes of its request.
type input struct {
	// method and target are as received: the target is the path and query, or an absolute URI.
	method, target string
	header         policy.Header
	peer           netip.Addr
	// policy, when set, names the one policy ("<namespace>/<name>") whose rules decide.
	policy string
	// gone closes when the client leaves, where the protocol tells: an h2c stream reset, a closed
	// HTTP/1.1 connection under net/http. Nil where it cannot tell without reading the connection
	// (fasthttp's HTTP/1.1, which learns it while holding a queued request, see holdConn).
	gone <-chan struct{}
	// seesResponse is true for the proxies, which end every request they admit (owed.end or
	// owed.drop): only they decide concurrency rules and rules charged by the response.
	seesResponse bool
}

// verdict is the seam's answer.
type verdict struct {
	limiter.Result
	// status is the HTTP status that answers it: 200 (allowed, after Result.Wait), 429 (limited),
	// 503 (a fail-closed rule's store unavailable), or 400 and 414 for input that cannot be
	// decided, with detail saying why.
	status int
	detail string
}

// invalid is the verdict on input the seam refuses to decide.
func invalid(status int, detail string) verdict {
	return verdict{Result: limiter.Result{Outcome: limiter.Invalid}, status: status, detail: detail}
}

// request turns an input into the limiter's request, or says why it cannot be decided.
func (in *input) request() (limiter.Request, *verdict) {
	path, bad := requestPath(in.target)
	if bad != nil {
		return limiter.Request{}, bad
	}
	return limiter.Request{Method: strings.ToUpper(in.method), Path: path, Header: in.header, Peer: in.peer, Policy: in.policy, SeesResponse: in.seesResponse}, nil
}

// decide decides one HTTP request, detached from its client; a client that left meanwhile is
// counted (Limiter.Left).
func decide(l *limiter.Limiter, in *input) verdict {
	req, bad := in.request()
	if bad != nil {
		return *bad
	}
	v := judge(l.Decide(context.Background(), &req))
	if in.gone != nil {
		select {
		case <-in.gone:
			l.Left()
		default:
		}
	}
	return v
}

// owed is what an admitted request owes when it ends (its limiter.Pending), which a proxy keeps
// past the decision: a pointer, so that keeping it moves no verdict to the heap.
type owed struct{ p *limiter.Pending }

// owed is what the verdict's request owes; nothing for a refusal.
func (v *verdict) owed() owed { return owed{v.Pending} }

// end ends an admitted request once its response is complete, with its status and a reader of a
// response field's values (header and trailer, copied), or once its client is gone before its
// response (status 0, fields nil): its leases are released and the rules charged by the
// response charged. The proxies call end or drop exactly once per admitted request; a request
// that owes nothing ignores both.
func (o owed) end(status int, fields func(name string) []string) { o.p.End(status, fields) }

// cut ends an admitted request whose response began but whose body did not end (its client left
// during it, or the upstream broke it off): as end, but a rule with costFrom whose response
// reported no valid cost in its header is charged costFrom.max (limiter.Pending.Cut).
func (o owed) cut(status int, fields func(name string) []string) { o.p.Cut(status, fields) }

// drop ends an admitted request that was never forwarded: its leases are released, and nothing
// is charged.
func (o owed) drop() { o.p.Drop() }

// owes reports whether the request owes anything at its end.
func (o owed) owes() bool { return o.p != nil }

// holds reports whether the request holds concurrency slots, which its work at the upstream
// should not outlive: a proxy that can, ends that work when its client leaves.
func (o owed) holds() bool { return o.p.Holds() }

// judge gives a limiter's result its HTTP status.
func judge(res limiter.Result) verdict {
	v := verdict{Result: res, status: http.StatusOK}
	switch res.Outcome {
	case limiter.Limited:
		v.status = http.StatusTooManyRequests
	case limiter.Unavailable:
		v.status = http.StatusServiceUnavailable
	case limiter.Invalid:
		v.status, v.detail = http.StatusBadRequest, res.Reason
	}
	return v
}

// requestPath is the path a request target decides on: decoded, with dot segments resolved and
// repeated slashes merged, without the query. An absolute URI (the absolute form of a request
// target, or nginx's $scheme://$http_host$request_uri) decides on its path, whatever its
// authority holds: the upstream reads the path, and a Host that does not parse must not make
// the path unreadable.
func requestPath(target string) (string, *verdict) {
	if strings.IndexByte(target, '#') >= 0 {
		// No request target has a fragment (RFC 9112, 3.2). fasthttp would cut the path there,
		// while an upstream that reads the '#' as part of the path and resolves "/x#/../admin"
		// serves /admin: the two must not read one target two ways.
		v := invalid(http.StatusBadRequest, "request target "+strconv.Quote(abbreviate(target))+" holds a '#': a request target has no fragment")
		return "", &v
	}
	if !strings.HasPrefix(target, "/") {
		scheme, rest, ok := strings.Cut(target, "://")
		if !ok || scheme == "" || strings.ContainsAny(scheme, "/?#") {
			v := invalid(http.StatusBadRequest, "request target "+strconv.Quote(abbreviate(target))+" is neither a path nor an absolute URI")
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
		v := invalid(http.StatusRequestURITooLong, "request target over "+strconv.Itoa(MaxTargetBytes)+" bytes")
		return "", &v
	}
	u := fasthttp.AcquireURI()
	defer fasthttp.ReleaseURI(u)
	// A host of our own: without one, "//admin" would be parsed as an authority, not a path.
	if err := u.Parse([]byte("sluice"), []byte(target)); err != nil {
		v := invalid(http.StatusBadRequest, "request target "+strconv.Quote(abbreviate(target))+" does not parse: "+err.Error())
		return "", &v
	}
	return string(u.Path()), nil
}

// abbreviate shortens what a message quotes from a client.
func abbreviate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// write answers a verdict through a response's header setter: the RateLimit fields of the rule
// it describes and, for anything but 200, Retry-After (429 and 503) and an RFC 9457 problem,
// whose body it returns.
func (v *verdict) write(set func(name, value string)) []byte {
	setRateLimitHeaders(set, &v.Result)
	switch v.status {
	case http.StatusOK:
		return nil
	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
		_, body := refusal(set, &v.Result)
		return body
	}
	return malformed(set, v.status, v.detail)
}

// hold keeps an allowed request for its wait, as a leaky bucket's queue does, and reports false
// as soon as gone closes: the client left, nobody reads the answer, and the request is released
// and counted (Limiter.Left).
func hold(l *limiter.Limiter, wait time.Duration, gone <-chan struct{}) bool {
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
