package store

import (
	"crypto/sha256"
	"encoding/base64"
)

// Tag is the Redis hash tag of one client of one policy: the first 96 bits of the SHA-256 of the
// policy's ID and the client key, base64url-encoded in 16 characters. Raw client keys never reach
// Redis, no byte of them can break the key layout, and every rule of one client of one policy
// shares the tag, so one script decides them all, on a Redis Cluster too.
func Tag(policyID, clientKey string) string {
	var buf [256]byte // most keys hash without a heap allocation
	in := append(append(append(buf[:0], policyID...), 0), clientKey...)
	sum := sha256.Sum256(in)
	var out [16]byte
	base64.RawURLEncoding.Encode(out[:], sum[:12])
	return string(out[:])
}
