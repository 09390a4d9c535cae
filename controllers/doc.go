// Package controllers reconciles RateLimitPolicy objects into enforcers.
//
// The RBAC markers of the manager live beside the code that needs them; controller-gen turns them
// into config/rbac/role.yaml.
//
// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=ratelimitpolicies,verbs=get;list;watch
// +kubebuilder:rbac:groups=ratelimit.sluice.dev,resources=ratelimitpolicies/status,verbs=get;update;patch
package controllers
