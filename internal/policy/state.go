package policy

import (
	"crypto/sha256"
	"encoding/base64"
)

// RuleID names a rule's state in a store, the last part of its Redis keys (store.Check.Key): the
// first 48 bits of the SHA-256 of the policy's ID, the rule's name and its limit's state layout
// (algorithm.Limit.Layout), base64url-encoded in 8 characters. A rule whose algorithm or window
// length changes therefore starts from fresh state and never reads the old as its own; a changed
// limit keeps the counters. Each rule of a policy has its own ID, so `SCAN MATCH "sl{*}<id>"`
// finds every client's key of that rule (the enforcer's admin /keys lists them).
func RuleID(policyID, name, layout string) string {
	sum := sha256.Sum256([]byte(policyID + "\x00" + name + "\x00" + layout))
	return base64.RawURLEncoding.EncodeToString(sum[:6])
}
