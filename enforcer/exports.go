package enforcer

import (
	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/config"
	"github.com/sluice-dev/sluice/enforcer/internal/front/check"
	"github.com/sluice-dev/sluice/enforcer/internal/front/rls"
	"github.com/sluice-dev/sluice/enforcer/internal/seam"
	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
	"github.com/sluice-dev/sluice/internal/policy"
)

// What the enforcer's packages fix for its users: the paths, bounds and names a gateway, a test
// or the control plane's tests need. Each is its package's own; see there.

// The check API's endpoints (check.API).
const (
	AuthRequestPath = check.AuthRequestPath
	ForwardAuthPath = check.ForwardAuthPath
	PoliciesPath    = check.PoliciesPath
)

// The rate limit service's descriptor entries of a meaning of their own and its bounds
// (rls.Server).
const (
	EntryRemoteAddress = rls.EntryRemoteAddress
	EntryMethod        = rls.EntryMethod
	EntryPath          = rls.EntryPath
	EntryPolicy        = rls.EntryPolicy
	MaxRLSDescriptors  = rls.MaxDescriptors
	MaxRLSEntries      = rls.MaxEntries
	MaxRLSMessageBytes = rls.MaxMessageBytes
)

// The bounds of a request on every front end (package seam).
const (
	MaxTargetBytes = seam.MaxTargetBytes
	MaxHeaderBytes = seam.MaxHeaderBytes
)

// UpstreamSchemes are the schemes --upstream takes.
var UpstreamSchemes = upstream.Schemes

// Load compiles the RateLimitPolicy documents of a policy file exactly as users apply them with
// kubectl (config.Load).
func Load(data []byte) ([]*policy.Policy, []string, error) { return config.Load(data) }

// Validate decodes one RateLimitPolicy document and judges it as the API server would on create
// (config.Validate).
func Validate(raw []byte) (*v1alpha1.RateLimitPolicy, error) { return config.Validate(raw) }
