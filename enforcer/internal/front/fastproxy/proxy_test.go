package fastproxy

import (
	"net/url"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/panics"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
)

// The fast path speaks cleartext HTTP/1.1 to an http:// upstream only. An https:// upstream
// goes by netproxy, whose transport uses the CA, server name and client certificate it is given;
// the fasthttp proxy once had a TLS branch of its own that nothing reached and that ignored all
// three, so an upstream it would serve is refused rather than spoken to without them.
func TestNewWhenTheUpstreamIsNotPlainHTTPThenItIsRefused(t *testing.T) {
	l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{})})
	for upstreamURL, ok := range map[string]bool{"http://api:8080": true, "http://api": true, "https://api:8443": false, "h2c://grpc:50051": false} {
		u, _ := url.Parse(upstreamURL)
		p, err := New(l, u, defaultUpstream, upstream.NewMetrics(prometheus.NewRegistry()), panics.New(prometheus.NewRegistry(), logr.Discard()), logr.Discard())
		switch {
		case ok && err != nil:
			t.Errorf("%s: %v, want the fast path", upstreamURL, err)
		case ok && p.client.Addr != u.Hostname()+":"+map[bool]string{true: u.Port(), false: "80"}[u.Port() != ""]:
			t.Errorf("%s: the client dials %s", upstreamURL, p.client.Addr)
		case !ok && (err == nil || !strings.Contains(err.Error(), "netproxy serves it")):
			t.Errorf("%s: %v, want it refused, naming netproxy", upstreamURL, err)
		}
	}
}
