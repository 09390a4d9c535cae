// Package controllers reconciles RateLimitPolicy objects into enforcers. The RBAC markers of the
// manager live beside the code that needs them; controller-gen turns them into
// config/rbac/role.yaml.
package controllers
