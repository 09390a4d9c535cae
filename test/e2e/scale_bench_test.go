//go:build bench

package e2e_test

import (
	"testing"
	"time"
)

// The benchmark tier's run of the idle test: a thousand policies, 20 of them with running
// enforcers, watched for two minutes. `make bench` runs it (go test -tags bench).
func TestStatusWhenAThousandPoliciesIdleThenNothingIsWrittenOrApplied(t *testing.T) {
	idlePolicies(t, 20, 980, 2*time.Minute)
}
