// Package argocd embeds the Argo CD health check of RateLimitPolicy, for its tests.
package argocd

import _ "embed"

// HealthLua is health.lua.
//
//go:embed health.lua
var HealthLua string
