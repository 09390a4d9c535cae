// Package controllers reconciles each RateLimitPolicy into its config, in the pool that serves
// it, and its status; and each pool, an EnforcerPool or a policy's pool of one, into its
// enforcers. The RBAC markers of the manager live beside the code that needs them; controller-gen
// turns them into config/rbac/role.yaml.
package controllers
