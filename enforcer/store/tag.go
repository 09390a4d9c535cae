package store

import (
	"crypto/sha256"
	"encoding/base64"
)

// Tag is the Redis hash tag of one client of one policy: "<policy>:<hash>", where the hash is the
// first 96 bits of the SHA-256 of the client key, base64url-encoded. Raw client keys (API keys,
// addresses) never reach Redis, and no byte of them can break the key layout.
func Tag(policyID, clientKey string) string {
	sum := sha256.Sum256([]byte(clientKey))
	return policyID + ":" + base64.RawURLEncoding.EncodeToString(sum[:12])
}
