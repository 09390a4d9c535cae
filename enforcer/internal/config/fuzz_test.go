package config

import (
	"context"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
)

// FuzzLoad sends policy files to the loader: it never panics, and what it accepts compiles and
// decides.
func FuzzLoad(f *testing.F) {
	samples, _ := filepath.Glob(filepath.Join("..", "..", "..", "config", "samples", "*.yaml"))
	if len(samples) == 0 {
		f.Fatal("no samples found in config/samples")
	}
	for _, s := range samples {
		data, err := os.ReadFile(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		policies, _, err := Load(data)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("refused without a message")
			}
			return
		}
		l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{})})
		l.SetPolicies(policies)
		h := http.Header{"X-Api-Key": {"k"}}
		for _, p := range []string{"/", "/admin", "/a/b?c"} {
			res := l.Decide(context.Background(), &limiter.Request{Method: "GET", Path: p, Header: h, Peer: netip.MustParseAddr("192.0.2.1")})
			if res.Outcome == limiter.Unavailable {
				t.Fatalf("the memory store failed deciding %s: %+v", p, res)
			}
		}
	})
}
