// Package enforcer is the Sluice data plane: it loads policies, decides every request against
// them, and serves the reverse proxy, the check API for ingress forward-auth, Envoy's rate limit
// service and the admin endpoints. Run starts it all; cmd/enforcer only turns flags into a
// Config.
//
// This package is the wiring. The parts it assembles, under internal/:
//
//	front/fastproxy  the proxy for HTTP/1.1 clients of an http:// upstream (fasthttp)
//	front/netproxy   the proxy for every other client and upstream (net/http, h2c, gRPC)
//	front/check      the check API (nginx auth_request, Traefik ForwardAuth)
//	front/rls        Envoy's rate limit service (gRPC)
//	seam             the one decision every front end makes, and the answers they share
//	limiter, store   the decision against the policies in force, and its counters
//	config           the policies' sources (the file, ConfigMaps through the API server)
//	                 and the one watcher that puts them in force
//	conns, sniff     connection guards, a socket's watch for a client that left, and the
//	                 split of the proxy's listener between HTTP/1.1 and h2c
//	forwarded, fastserve, panics, upstream
//	                 what several front ends share: X-Forwarded-* and Forwarded, fasthttp's
//	                 request fields, contained panics, the hop to the upstream
//
// A front end translates its protocol to and from the seam's input and verdict only: it imports
// no other front end, no store and no config source (depguard, test/architecture).
package enforcer
