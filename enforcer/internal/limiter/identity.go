package limiter

import (
	"net/netip"
	"strings"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/policy"
)

// ClientAddr is the address of the client behind a request. It is the TCP peer, unless the peer
// is a trusted proxy: then it is the right-most X-Forwarded-For hop that is not a trusted proxy.
// Hops are read from the right, the only end a client cannot forge, so a spoofed header from an
// untrusted peer changes nothing. A hop that is not an address ends the walk at the last trusted
// hop before it.
func ClientAddr(peer netip.Addr, header policy.Header, trusted []netip.Prefix) netip.Addr {
	if !contains(trusted, peer) {
		return peer
	}
	addr := peer
	values := header.Values("X-Forwarded-For")
	for i := len(values) - 1; i >= 0; i-- {
		hops := strings.Split(values[i], ",")
		for j := len(hops) - 1; j >= 0; j-- {
			hop, err := netip.ParseAddr(strings.TrimSpace(hops[j]))
			if err != nil {
				return addr
			}
			addr = hop.Unmap()
			if !contains(trusted, addr) {
				return addr
			}
		}
	}
	return addr
}

func contains(prefixes []netip.Prefix, a netip.Addr) bool {
	for _, p := range prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// RepeatedKeyHeader is the name of a header among a rule's key sources that a request sends more
// than once, or "". Such a request has no one identity: the key would be the join of the values
// while the upstream reads the first, so a client could pose as new with every extra line.
func RepeatedKeyHeader(keys []policy.KeySource, header policy.Header) string {
	for _, k := range keys {
		if k.Type == v1alpha1.KeyHeader && len(header.Values(k.Header)) > 1 {
			return k.Header
		}
	}
	return ""
}
