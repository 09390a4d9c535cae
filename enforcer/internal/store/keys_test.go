package store_test

import (
	"net/http"
	"net/netip"
	"testing"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/policy"
)

func TestClientKeyWhenValuesCouldCollideThenKeysDiffer(t *testing.T) {
	addr := netip.MustParseAddr("198.51.100.1")
	two := []policy.KeySource{{Type: v1alpha1.KeyHeader, Header: "X-A"}, {Type: v1alpha1.KeyHeader, Header: "X-B"}}
	h1 := http.Header{"X-A": {"ab"}, "X-B": {"c"}}
	h2 := http.Header{"X-A": {"a"}, "X-B": {"bc"}}
	if store.ClientKey(two, "GET", "/", h1, addr) == store.ClientKey(two, "GET", "/", h2, addr) {
		t.Error(`"ab"+"c" and "a"+"bc" share a key`)
	}
	one := []policy.KeySource{{Type: v1alpha1.KeyHeader, Header: "X-Api-Key"}}
	missing := store.ClientKey(one, "GET", "/", http.Header{}, addr)
	if missing == store.ClientKey(one, "GET", "/", http.Header{}, netip.MustParseAddr("198.51.100.2")) {
		t.Error("requests without the header from different addresses share a key")
	}
	if missing == store.ClientKey(one, "GET", "/", http.Header{"X-Api-Key": {addr.String()}}, addr) {
		t.Error("a missing header can be imitated by sending the address as the header")
	}
	if store.ClientKey(nil, "GET", "/a", h1, addr) != store.ClientKey(nil, "POST", "/b", h2, netip.MustParseAddr("::1")) {
		t.Error("a rule without key sources must have one shared bucket")
	}
}
