package store

import (
	"crypto/sha256"
	"encoding/base64"
	"net/netip"
	"strconv"
	"strings"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/policy"
)

// The key layout, all of it here. Every key of Sluice's in Redis is
//
//	sl{<tag>}<rule>   a rule's state for one client: Check.Key, 28 bytes (a concurrency limit's
//	                  is the sorted set of its client's leases, members <request>:<slots>)
//	sl{<tag>}i<rec>   an idempotency record of that client: Check.recordKey
//	sl{<tag>}l<rule>  the units enforcers lease of a token bucket rule: Check.leaseKey
//
// where <tag> is Tag(policy ID, ClientKey(...)), the Redis Cluster hash tag shared by every key
// of one client of one policy, so that one script decides all of them; <rule> is RuleID; <rec>
// is IdempotencyKey. Raw client keys never reach Redis: every part is a hash.

// KeyPrefix starts every Redis key of Sluice's.
const KeyPrefix = "sl"

// Key is the Redis key of the check: sl{<tag>}<rule>, 28 bytes. Redis keeps a key of up to 30
// bytes in one 32-byte allocation: a shorter name would save nothing, a longer one 16 bytes.
func (c *Check) Key() string { return KeyPrefix + "{" + c.Tag + "}" + c.Rule }

// recordKey is the Redis key of the idempotency record of a check: under its tag.
func (c *Check) recordKey() string {
	return KeyPrefix + "{" + c.Tag + "}i" + c.Idempotency.Key
}

// leaseKey is the Redis key of the leases of a token bucket check: the units each enforcer holds.
func (c *Check) leaseKey() string { return KeyPrefix + "{" + c.Tag + "}l" + c.Rule }

// RulePattern matches every client's key of the rule whose ID is given: redis-cli --scan
// --pattern '<pattern>'.
func RulePattern(rule string) string { return KeyPrefix + "{*}" + rule }

// RuleID names a rule's state, the last part of its keys: the first 48 bits of the SHA-256 of the
// policy's ID, the rule's name and its limit's state layout (algorithm.Limit.Layout),
// base64url-encoded in 8 characters. A rule whose algorithm or window length changes therefore
// starts from fresh state and never reads the old as its own; a changed limit keeps the
// counters. Each rule of a policy has its own ID, so `SCAN MATCH "sl{*}<id>"` finds every
// client's key of that rule (the enforcer's admin /keys lists them).
func RuleID(policyID, name, layout string) string {
	sum := sha256.Sum256([]byte(policyID + "\x00" + name + "\x00" + layout))
	return base64.RawURLEncoding.EncodeToString(sum[:6])
}

// Tag is the Redis hash tag of one client of one policy: the first 96 bits of the SHA-256 of the
// policy's ID and the client key, base64url-encoded in 16 characters. Raw client keys never reach
// Redis, no byte of them can break the key layout, and every rule of one client of one policy
// shares the tag, so one script decides them all, on a Redis Cluster too.
func Tag(policyID, clientKey string) string {
	// Append into a slice of its own: a buffer sized for common keys stays on the stack, and a
	// longer key grows the slice, never past the buffer's end.
	var buf [256]byte
	in := append(append(append(buf[:0], policyID...), 0), clientKey...)
	sum := sha256.Sum256(in)
	var out [16]byte
	base64.RawURLEncoding.Encode(out[:], sum[:12])
	return string(out[:])
}

// ClientKey is the identity of a request's client under a rule, which Tag hashes: its key
// sources, each length-prefixed so that no value can imitate another. A rule without key sources
// has one bucket for all requests it matches.
//
// A request that lacks a key source's header is keyed by its client address instead, under a
// marker that no present header can produce: anonymous requests are limited per address, never
// pooled into one bucket shared with every other such request.
func ClientKey(keys []policy.KeySource, method, path string, header policy.Header, addr netip.Addr) string {
	if len(keys) == 0 {
		return ""
	}
	var b strings.Builder
	part := func(kind byte, v string) {
		b.WriteByte(kind)
		b.WriteString(strconv.Itoa(len(v)))
		b.WriteByte(':')
		b.WriteString(v)
	}
	for _, k := range keys {
		switch k.Type {
		case v1alpha1.KeyRemoteAddress:
			part('a', addr.String())
		case v1alpha1.KeyMethod:
			part('m', method)
		case v1alpha1.KeyPath:
			part('p', path)
		case v1alpha1.KeyHeader:
			if values := header.Values(k.Header); len(values) > 0 {
				part('h', values[0]) // one value: the limiter refuses a repeated key header
			} else {
				part('!', addr.String())
			}
		}
	}
	return b.String()
}

// IdempotencyKey hashes a client's idempotency key and its identity (the client address the
// limiter decided it is) into the 8 characters of its record's name: the first 48 bits of their
// SHA-256, base64url. Raw keys never reach the store.
func IdempotencyKey(key, identity string) string {
	sum := sha256.Sum256([]byte(key + "\x00" + identity))
	return base64.RawURLEncoding.EncodeToString(sum[:6])
}
