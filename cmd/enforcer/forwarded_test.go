package main

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/sluice-dev/sluice/internal/test/local"
)

// forwardedPolicy trusts the proxies of trusted, a CIDR.
func forwardedPolicy(trusted string) string {
	return `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: forwarded, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  trustedProxies: ["` + trusted + `"]
  rules:
    - name: any
      fixedWindow: {limit: 1000000, window: 1h}
`
}

// Through the binary, on both proxies: the forwarded fields a peer in trustedProxies sent reach
// the upstream kept and extended; those of any other peer are replaced by what the connection
// says. The test client, on 127.0.0.1, is the peer. enforcer/forwarded_test.go has every case of
// the rules.
func TestEnforcerBinaryWhenForwardedFieldsArriveThenTheyAreKeptFromTrustedPeersOnly(t *testing.T) {
	seen := make(chan http.Header, 1)
	up := serveH1(t, http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { seen <- r.Header.Clone() }))
	sent := map[string]string{
		"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Host": "shop.example", "X-Forwarded-Proto": "https",
		"Forwarded": `for=203.0.113.7;host=shop.example;proto=https`,
	}
	mine := "for=127.0.0.1;host=api.example;proto=http"
	cases := []struct {
		name    string
		trusted string
		want    map[string]string
	}{
		{"when the peer is a trusted proxy then its fields are kept and the chains extended", "127.0.0.0/8", map[string]string{
			"X-Forwarded-For": "203.0.113.7, 127.0.0.1", "X-Forwarded-Host": "shop.example", "X-Forwarded-Proto": "https",
			"Forwarded": sent["Forwarded"] + ", " + mine}},
		{"when the peer is not a trusted proxy then its fields are replaced", "10.0.0.0/8", map[string]string{
			"X-Forwarded-For": "127.0.0.1", "X-Forwarded-Host": "api.example", "X-Forwarded-Proto": "http", "Forwarded": mine}},
	}
	for _, c := range cases {
		e := startFrontingWith(t, forwardedPolicy(c.trusted), "http://"+up)
		for _, via := range []string{"HTTP/1.1", "h2c"} {
			t.Run(c.name+" ("+via+")", func(t *testing.T) {
				req, _ := http.NewRequest(http.MethodGet, "http://"+e.proxy+"/f", nil)
				req.Host = "api.example"
				for k, v := range sent {
					req.Header.Set(k, v)
				}
				resp, err := local.ClientFor(via, 20*time.Second).Do(req)
				if err != nil {
					t.Fatal(err)
				}
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d", resp.StatusCode)
				}
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
