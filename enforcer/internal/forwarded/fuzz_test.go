package forwarded

import (
	"net/netip"
	"strings"
	"testing"
)

// FuzzForwarded holds the Forwarded parser to RFC 7239 on generated values: it never panics;
// what it accepts keeps its first element's host and proto when the proxy appends its own
// element; and a host it returns, quoted by the proxy, reads back as itself.
func FuzzForwarded(f *testing.F) {
	for _, s := range []string{`for=192.0.2.60;proto=http;by=203.0.113.43`, `for="[2001:db8:cafe::17]:4711"`,
		`for=192.0.2.43, for=198.51.100.17;host="a\"b"`, `proto=https;proto=http`, `host=`, `;;, ,for=x`, `for="\`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		host, proto, ok := First(v)
		if !ok {
			if host != "" || proto != "" {
				t.Fatalf("refused %q but returned host %q proto %q", v, host, proto)
			}
			return
		}
		if proto != "" && !IsScheme(proto) {
			t.Fatalf("%q: proto %q is not a scheme", v, proto)
		}
		peer := netip.MustParseAddr("2001:db8::1")
		joined := string(AppendElement([]byte(v+", "), peer, []byte("h")))
		if len(joined) <= MaxBytes {
			h2, p2, ok2 := First(joined)
			if !ok2 || h2 != host || p2 != proto {
				t.Fatalf("%q with the proxy's element appended read as %q %q %v, want %q %q", v, h2, p2, ok2, host, proto)
			}
		}
		if host != "" && !strings.ContainsAny(host, "\x00\r\n\x7f") {
			own := string(AppendElement(nil, peer, []byte(host)))
			if h3, p3, ok3 := First(own); len(own) <= MaxBytes && (!ok3 || h3 != host || p3 != "http") {
				t.Fatalf("the proxy's element %q for host %q read back as %q %q %v", own, host, h3, p3, ok3)
			}
		}
	})
}
