package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/enforcer/algorithm"
	"github.com/sluice-dev/sluice/enforcer/store"
	"github.com/sluice-dev/sluice/test/redistest"
)

// decide parses the flags, connects the Redis store they describe, and sends five requests against
// a limit of three. It returns how many passed and the first error.
func decide(t *testing.T, flags ...string) (int, error) {
	t.Helper()
	// A timeout long enough for go-redis's dial attempts to end in the TLS error itself.
	cfg, err := parse(append([]string{"--policy=unused.yaml", "--redis-timeout=5s"}, flags...))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Redis == nil {
		t.Fatal("no Redis store configured")
	}
	s, err := store.NewRedis(*cfg.Redis)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	checks := []store.Check{{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 3, Period: time.Hour},
		Cost: 1, Enforce: true, Tag: "ns/p:" + strings.ReplaceAll(t.Name(), "/", "-"), Rule: "r"}}
	out := make([]algorithm.Decision, 1)
	passed := 0
	for range 5 {
		ok, err := s.Decide(context.Background(), checks, out)
		if err != nil {
			return passed, err
		}
		if ok && out[0].Allowed {
			passed++
		}
	}
	return passed, nil
}

func TestRedisFlagsWhenRedisSpeaksTLSThenTheStoreVerifiesItsCertificate(t *testing.T) {
	srv := redistest.NewTLSServer(t)
	url := "--redis-url=redis://" + srv.Addr() + "/0"
	cases := []struct {
		name    string
		flags   []string
		wantErr string // "" for exact decisions, "any" for any error
	}{
		{"when the CA file signs the certificate then decisions are exact", []string{url, "--redis-ca-file=" + srv.CAFile}, ""},
		{"when the server name is one the certificate holds then it is verified by that name",
			[]string{url, "--redis-ca-file=" + srv.CAFile, "--redis-server-name=redis.test"}, ""},
		{"when the server name is not in the certificate then nothing is decided",
			[]string{url, "--redis-ca-file=" + srv.CAFile, "--redis-server-name=other.test"}, "certificate is valid for"},
		{"when only the system roots are trusted then the self-signed certificate is refused",
			[]string{url, "--redis-tls"}, "certificate"},
		{"when TLS is off then the TLS-only server is not reached", []string{url}, "any"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			passed, err := decide(t, c.flags...)
			switch {
			case c.wantErr == "any":
				if err == nil {
					t.Fatal("a plain-TCP client decided against a TLS-only server")
				}
			case c.wantErr == "" && (err != nil || passed != 3):
				t.Fatalf("passed %d of 5 with error %v, want exactly 3", passed, err)
			case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
				t.Fatalf("error %v, want one containing %q", err, c.wantErr)
			}
		})
	}
}

func TestRedisFlagsWhenSentinelThenDecisionsGoToTheMasterItNames(t *testing.T) {
	master := redistest.NewServer(t)
	sentinel := redistest.NewSentinel(t, master)
	passed, err := decide(t, "--redis-sentinel="+sentinel.Addr(), "--redis-master="+redistest.SentinelMaster)
	if err != nil || passed != 3 {
		t.Fatalf("passed %d of 5 with error %v, want exactly 3", passed, err)
	}
	if n, err := master.Client(t).DBSize(context.Background()).Result(); err != nil || n != 1 {
		t.Errorf("the master holds %d keys (error %v), want the one key of the rule", n, err)
	}
}

// The connection and timeout flags take positive values only: 0 would refuse every connection
// or cut every response, so it is refused at start, naming the flag; the smallest positive value
// is taken.
func TestFlagsWhenAConnectionBoundIsNotPositiveThenRefusedNamingIt(t *testing.T) {
	for flag, values := range map[string][2]string{
		"--max-conns": {"1", "0"}, "--max-conns-per-client": {"1", "0"},
		"--read-timeout": {"1ms", "0s"}, "--write-timeout": {"1ms", "0s"}, "--idle-timeout": {"1ms", "0s"},
		"--upstream-connect-timeout": {"1ms", "0s"}, "--upstream-response-header-timeout": {"1ms", "0s"}, "--upstream-idle-timeout": {"1ms", "0s"},
	} {
		if _, err := parse([]string{"--policy=p.yaml", flag + "=" + values[0]}); err != nil {
			t.Errorf("%s=%s: %v, want it taken", flag, values[0], err)
		}
		if _, err := parse([]string{"--policy=p.yaml", flag + "=" + values[1]}); err == nil || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s=%s: %v, want an error naming %s", flag, values[1], err, flag)
		}
	}
}

// --upstream takes the three schemes and nothing else, and its TLS flags need an https upstream
// and each other as they say; every refusal names the flags.
func TestFlagsWhenTheUpstreamIsGivenThenOnlyWorkableCombinationsAreTaken(t *testing.T) {
	pki := newTestPKI(t)
	cases := []struct {
		name    string
		flags   []string
		wantErr string // "" when taken
	}{
		{"when the scheme is http then taken", []string{"--upstream=http://api:80"}, ""},
		{"when the scheme is https then taken", []string{"--upstream=https://api:443"}, ""},
		{"when the scheme is h2c then taken", []string{"--upstream=h2c://api:50051"}, ""},
		{"when the scheme is another then refused", []string{"--upstream=ftp://api:21"}, "--upstream"},
		{"when there is no host then refused", []string{"--upstream=http://"}, "--upstream"},
		{"when a CA file is given for https then taken", []string{"--upstream=https://api", "--upstream-ca-file=" + pki.caFile}, ""},
		{"when a CA file is given for http then refused", []string{"--upstream=http://api", "--upstream-ca-file=" + pki.caFile}, "--upstream-ca-file"},
		{"when a server name is given without an upstream then refused", []string{"--upstream-server-name=api.test"}, "--upstream-server-name"},
		{"when the CA file holds no certificate then refused", []string{"--upstream=https://api", "--upstream-ca-file=" + pki.keyFile}, "--upstream-ca-file"},
		{"when a client certificate comes without its key then refused", []string{"--upstream=https://api", "--upstream-cert-file=" + pki.certFile}, "--upstream-key-file"},
		{"when a client certificate comes with its key then taken",
			[]string{"--upstream=https://api", "--upstream-cert-file=" + pki.certFile, "--upstream-key-file=" + pki.keyFile}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := parse(append([]string{"--policy=p.yaml"}, c.flags...))
			switch {
			case c.wantErr == "" && err != nil:
				t.Errorf("%v, want taken", err)
			case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
				t.Errorf("%v, want an error naming %s", err, c.wantErr)
			}
		})
	}
}
