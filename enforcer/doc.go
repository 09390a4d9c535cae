// Package enforcer is the Sluice data plane: it loads policies, decides every request against
// them, and serves the reverse proxy, the check API for ingress forward-auth, and the admin
// endpoints. Run starts it all; cmd/enforcer only turns flags into a Config.
package enforcer
