// Package store keeps rate-limit state and decides requests against it: in memory for one
// enforcer replica, or in Redis (standalone, Sentinel or Cluster) for many.
//
// Every store decides all the rules that match a request together: it checks every rule first
// and charges them only if every enforced rule allows, so a refused request consumes nothing.
package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/policy"
)

// Check is one rule to decide for one request.
type Check struct {
	// Limit is the rule's algorithm and parameters.
	Limit algorithm.Limit
	// Cost is how many units the request consumes; 0 checks without consuming.
	Cost int64
	// Enforce is false for shadow rules: they never cause a refusal, and are charged only when
	// they allow, as if each were the only rule.
	Enforce bool
	// Tag identifies the client within its policy (see Tag). The Redis key of a check is
	// sl{Tag}Rule, so rules that share a client key share a Redis Cluster hash slot.
	Tag string
	// Rule names the rule's state (RuleID).
	Rule string
	// Idempotency, when set, is the record of this check's policy and client: a repeat of a
	// request that record admitted passes this check without a charge. Checks that name the same
	// record (the same Tag and Idempotency.Key) share it; checks without one are decided and
	// charged as usual, whatever the records of the others say.
	Idempotency *Idempotency
	// Lease names the request, unique across enforcers (the limiter gives each request one):
	// under a concurrency limit, the lease it is admitted with, which Finish releases and Renew
	// extends, found by this name and the check's Cost; on Redis, the name of the member a
	// sliding log keeps for the request too. Empty, the Redis store makes a name of its own.
	Lease string
	// Deferred is true for a rule charged by the response (charge.when Response): Decide checks
	// it at Cost, and refuses the request if it could not admit that now, but charges nothing;
	// Finish charges it once the response has ended.
	Deferred bool
	// UnitLease, on a token bucket or a fixed window, lets the Redis store lease units of the
	// rule ahead and decide later requests from them without Redis (see UnitLease). Other stores
	// decide every request themselves.
	UnitLease *UnitLease

	// The lease path's, for one script call: extra is how many units to lease beyond Cost
	// (taking: and replace what this enforcer held by them and hold, units it keeps holding);
	// back is how many units of a fixed window's lease leased at backAt (Redis's µs), expired
	// or ending, to give back first; spent is when the units this enforcer held were last spent (Redis's µs, 0: now);
	// granted is how many the script leased, at (Redis's µs).
	extra, hold, back, backAt, spent int64
	taking                           bool
	granted, at                      int64
}

// UnitLease is a rule's lease (policy.Lease): an enforcer takes up to Max units of a client's
// limit from Redis at once and decides from them until they run out or Expiry passes. Leased
// units are charged in Redis when taken, so never more than the limit is admitted across
// enforcers; a request may be refused while other enforcers hold units, at most Max-1 each.
type UnitLease = policy.Lease

// Idempotency identifies a request by the key its client sent, for the decision to recognize
// its repeats: the first is decided and charged as any request; a repeat within Window of an
// admitted one passes the checks of its record without a charge, MaxRepeats times, and is
// charged like a new request after that; a repeat of a refused one is refused the same way until
// the first refusal's Retry-After. A record belongs to one policy (the checks' tag) and one
// client identity (hashed into Key), so clients that send the same key never share one, even
// under a rule with no client key.
type Idempotency struct {
	// Key names the record: IdempotencyKey of the client's key and identity.
	Key        string
	Window     time.Duration
	MaxRepeats int64
}

// Store decides requests.
type Store interface {
	// Decide decides one request: out[i] receives the decision of checks[i] (len(out) must be at
	// least len(checks)). It reports whether the request was charged, which is whether every
	// enforced check allowed it.
	Decide(ctx context.Context, checks []Check, out []algorithm.Decision) (charged bool, err error)
	// Finish ends a request that Decide charged, once its response has ended: it releases the
	// leases of its concurrency checks and charges every other check at its Cost (the
	// response's), each in turn, never refusing: a cost over what a rule has left takes the rule
	// to exhaustion (algorithm.Limit.Charge). out[i] receives what checks[i] sees after. Like
	// Decide, it is one script per hash tag.
	Finish(ctx context.Context, checks []Check, out []algorithm.Decision) error
	// Renew extends the leases of the concurrency checks to their lease timeout (Limit.Period)
	// from now; a lease that expired is not brought back. Other checks are only read. out[i]
	// receives what checks[i] sees after.
	Renew(ctx context.Context, checks []Check, out []algorithm.Decision) error
	// Ping checks that the store answers within ctx's deadline.
	Ping(ctx context.Context) error
	// Close releases the store's resources.
	Close() error
}

// LocalDecider is a store that decides some requests without its backend: the Redis store, from
// the units it leased. DecideLocal reports whether it decided the request, which it then
// admitted and charged; a caller that guards the backend (a circuit breaker) asks it first, so
// that decisions that never reached the backend say nothing of its health.
type LocalDecider interface {
	DecideLocal(checks []Check, out []algorithm.Decision) bool
}

// ErrFault marks a decision that failed for a fault of its own, a bug or a configuration
// problem, rather than because the store is unavailable: a script error, a key of the wrong type,
// a reply that does not decode. Other rules and clients are unaffected, so it must not count
// against the store's availability.
var ErrFault = errors.New("decision fault")

// ErrUnexpectedReply means Redis answered a script with something the store cannot decode.
var ErrUnexpectedReply = fmt.Errorf("%w: unexpected reply from the decide script", ErrFault)

// charged reports whether every enforced check allowed.
func charged(checks []Check, out []algorithm.Decision) bool {
	for i := range checks {
		if checks[i].Enforce && !out[i].Allowed {
			return false
		}
	}
	return true
}
