package enforcer_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/sluice-dev/sluice/internal/test/local"
)

// The forwarded fields a trusted proxy set reach the upstream extended, not overwritten; those
// of any other peer are replaced by what the connection says. Each case on both proxies: HTTP/1.1
// (fasthttp) and h2c (net/http).
func TestProxyWhenForwardedFieldsArriveThenTheyAreKeptFromTrustedPeersOnly(t *testing.T) {
	seen := make(chan http.Header, 1)
	up := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { seen <- r.Header.Clone() }))
	defer up.Close()
	long := "for=10.0.0.9;host=" + strings.Repeat("a", 4096-len("for=10.0.0.9;host="))
	mine := "for=127.0.0.1;host=api.example;proto=http"
	cases := []struct {
		name    string
		trusted bool
		sent    map[string]string
		want    map[string]string
	}{
		{"when an untrusted peer sends nothing then the connection's values are set", false, nil,
			map[string]string{"X-Forwarded-For": "127.0.0.1", "X-Forwarded-Host": "api.example", "X-Forwarded-Proto": "http", "Forwarded": mine}},
		{"when an untrusted peer sends every field then each is replaced", false,
			map[string]string{"X-Forwarded-For": "6.6.6.6", "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https", "Forwarded": "for=6.6.6.6;proto=https"},
			map[string]string{"X-Forwarded-For": "127.0.0.1", "X-Forwarded-Host": "api.example", "X-Forwarded-Proto": "http", "Forwarded": mine}},
		{"when a trusted peer sends the X-Forwarded fields then they are kept and the chain extended", true,
			map[string]string{"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Host": "shop.example", "X-Forwarded-Proto": "https"},
			map[string]string{"X-Forwarded-For": "203.0.113.7, 127.0.0.1", "X-Forwarded-Host": "shop.example", "X-Forwarded-Proto": "https", "Forwarded": mine}},
		{"when a trusted peer sends only Forwarded then its first element gives the host and proto", true,
			map[string]string{"Forwarded": `for="[2001:db8::7]";host="shop.example:8443";proto=https, for=10.0.0.2`},
			map[string]string{"X-Forwarded-For": "127.0.0.1", "X-Forwarded-Host": "shop.example:8443", "X-Forwarded-Proto": "https",
				"Forwarded": `for="[2001:db8::7]";host="shop.example:8443";proto=https, for=10.0.0.2, ` + mine}},
		{"when a trusted peer's Forwarded does not parse then it is replaced", true,
			map[string]string{"Forwarded": `for=1.2.3.4;proto="https`},
			map[string]string{"X-Forwarded-For": "127.0.0.1", "X-Forwarded-Host": "api.example", "X-Forwarded-Proto": "http", "Forwarded": mine}},
		{"when a trusted peer's Forwarded is 4 KiB then it is kept", true,
			map[string]string{"Forwarded": long},
			map[string]string{"X-Forwarded-For": "127.0.0.1", "X-Forwarded-Host": strings.Repeat("a", 4096-len("for=10.0.0.9;host=")), "X-Forwarded-Proto": "http", "Forwarded": long + ", " + mine}},
		{"when a trusted peer's Forwarded is one byte over 4 KiB then it is replaced", true,
			map[string]string{"Forwarded": long + "a"},
			map[string]string{"X-Forwarded-For": "127.0.0.1", "X-Forwarded-Host": "api.example", "X-Forwarded-Proto": "http", "Forwarded": mine}},
	}
	trusted := start(t, policyDoc("trusting", anyRule, "  trustedProxies: [\"127.0.0.0/8\"]\n"), &upstream{Server: up}, nil)
	untrusted := start(t, policyDoc("wary", anyRule, "  trustedProxies: [\"10.0.0.0/8\"]\n"), &upstream{Server: up}, nil)
	for _, c := range cases {
		for _, via := range []string{"HTTP/1.1", "h2c"} {
			t.Run(c.name+" ("+via+")", func(t *testing.T) {
				e := untrusted
				if c.trusted {
					e = trusted
				}
				req, _ := http.NewRequest(http.MethodGet, e.proxy+"/f", nil)
				req.Host = "api.example"
				for k, v := range c.sent {
					req.Header.Set(k, v)
				}
				resp, err := local.ClientFor(via, 0).Do(req)
				if err != nil {
					t.Fatal(err)
				}
				_ = resp.Body.Close()
				got := <-seen
				have := map[string]string{}
				for k := range c.want {
					have[k] = strings.Join(got.Values(k), " | ")
				}
				if diff := cmp.Diff(c.want, have); diff != "" {
					t.Errorf("the upstream read (-want +got):\n%s", diff)
				}
			})
		}
	}
}
