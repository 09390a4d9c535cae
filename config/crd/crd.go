// Package crd embeds the generated CustomResourceDefinition, so that a binary can validate a
// RateLimitPolicy with the very schema and CEL rules the API server enforces.
package crd

import _ "embed"

// RateLimitPolicies is bases/ratelimit.sluice.dev_ratelimitpolicies.yaml, which `make manifests`
// generates from api/v1alpha1.
//
//go:embed bases/ratelimit.sluice.dev_ratelimitpolicies.yaml
var RateLimitPolicies []byte
