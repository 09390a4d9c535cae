package enforcer

import (
	"encoding/json"
	"fmt"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/sluice-dev/sluice/enforcer/internal/panics"
)

// InjectPanic makes every request path of the given server panic until the returned undo runs.
func InjectPanic(server string) (undo func()) { return panics.Inject(server) }

// RefusedMalformed reports the detail of an RLS answer that refuses a call Sluice does not decide
// for what the request carries (OVER_LIMIT with a malformed-request problem), or why it is not
// one.
func RefusedMalformed(r *rlsv3.RateLimitResponse, err error) (string, error) {
	if err != nil {
		return "", fmt.Errorf("an error, %w, which Envoy's default failure mode lets through", err)
	}
	var p struct{ Type, Detail string }
	if r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || json.Unmarshal(r.GetRawBody(), &p) != nil ||
		p.Type != "https://sluice.dev/problems/malformed-request" {
		return "", fmt.Errorf("%v with body %q, want OVER_LIMIT with a malformed-request problem", r.GetOverallCode(), r.GetRawBody())
	}
	return p.Detail, nil
}
