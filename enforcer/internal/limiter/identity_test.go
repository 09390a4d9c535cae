package limiter_test

import (
	"net/http"
	"net/netip"
	"testing"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
)

func TestClientAddr(t *testing.T) {
	trusted := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}
	cases := []struct {
		name, peer string
		xff        []string
		want       string
	}{
		{"when peer is untrusted then its header is ignored", "203.0.113.9", []string{"1.2.3.4"}, "203.0.113.9"},
		{"when peer is trusted then the right-most untrusted hop is the client", "10.0.0.1", []string{"1.2.3.4, 198.51.100.7, 10.0.0.2"}, "198.51.100.7"},
		{"when hops span several headers then the last header is read first", "10.0.0.1", []string{"198.51.100.1", "198.51.100.2"}, "198.51.100.2"},
		{"when every hop is trusted then the left-most hop is the client", "10.0.0.1", []string{"10.1.1.1, 10.2.2.2"}, "10.1.1.1"},
		{"when a hop is garbage then the last trusted hop before it is used", "10.0.0.1", []string{"1.2.3.4, not-an-ip, 10.0.0.3"}, "10.0.0.3"},
		{"when the peer is trusted and sends no header then the peer is the client", "10.0.0.1", nil, "10.0.0.1"},
		{"when addresses are IPv6 then they work the same", "fd00::1", []string{"2001:db8::7"}, "2001:db8::7"},
		{"when a hop is IPv4-mapped IPv6 then it is unmapped", "10.0.0.1", []string{"::ffff:198.51.100.3"}, "198.51.100.3"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := http.Header{}
			for _, v := range c.xff {
				h.Add("X-Forwarded-For", v)
			}
			if got := limiter.ClientAddr(netip.MustParseAddr(c.peer), h, trusted); got.String() != c.want {
				t.Errorf("ClientAddr = %s, want %s", got, c.want)
			}
		})
	}
}
