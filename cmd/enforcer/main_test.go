package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/settings"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// decide parses the flags and runs an enforcer with the Redis store they describe and a policy
// of a limit of three, then asks its check API five times. It returns how many passed, and the
// store's error as the enforcer's report gives it when the store is not connected.
func decide(t *testing.T, flags ...string) (int, error) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "policy.yaml")
	policy := "apiVersion: ratelimit.sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p" + strconv.Itoa(int(policies.Add(1))) +
		", namespace: ns}\nspec:\n  targetRef: {name: api, port: 80}\n  rules:\n    - name: r\n      fixedWindow: {limit: 3, window: 1h}\n"
	if err := os.WriteFile(file, []byte(policy), 0o600); err != nil {
		t.Fatal(err)
	}
	// A timeout long enough for go-redis's dial attempts to end in the TLS error itself.
	cfg, err := parse(append([]string{"--policy=" + file, "--redis-timeout=5s",
		"--check-listen=127.0.0.1:0", "--admin-listen=127.0.0.1:0", "--shutdown-delay=0s"}, flags...))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Redis == nil {
		t.Fatal("no Redis store configured")
	}
	ctx, cancel := context.WithCancel(context.Background())
	e, err := enforcer.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = e.Wait() })
	// The store's health as the report gives it, once a ping has ended in more than a timeout (the
	// first ping has a second; the next come every two).
	var r report.Report
	poll.WaitFor(t, 15*time.Second, func() error {
		if err := getJSON("http://"+e.AdminAddr+report.Path, &r); err != nil {
			return err
		}
		if !r.Store.Connected && r.Store.Cause == report.CauseTimeout {
			return errors.New(r.Store.Message)
		}
		return nil
	})
	if !r.Store.Connected {
		return 0, errors.New(r.Store.Message)
	}
	passed := 0
	for range 5 {
		req, _ := http.NewRequest(http.MethodGet, "http://"+e.CheckAddr+enforcer.ForwardAuthPath, nil)
		req.Header.Set("X-Forwarded-Method", http.MethodGet)
		req.Header.Set("X-Forwarded-Uri", "/")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return passed, err
		}
		_ = resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			passed++
		}
	}
	return passed, nil
}

// policies names each decide's policy apart, so that none shares another's counters.
var policies atomic.Int32

func getJSON(url string, v any) error {
	resp, err := http.Get(url) //nolint:gosec // the enforcer's loopback address
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	return json.NewDecoder(resp.Body).Decode(v)
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

// Every setting the flags leave alone is the default the enforcer itself would give a zero
// field, from the one place both read (internal/settings), and the proxy, check API and admin
// addresses are the ports the manager renders.
func TestFlagsWhenNoneIsGivenThenEverySettingIsTheSettingsDefault(t *testing.T) {
	cfg, err := parse([]string{"--policy=p.yaml", "--upstream=http://api:80"})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(settings.Defaults(), cfg.Enforcer); diff != "" {
		t.Errorf("settings from flags (-settings.Defaults +parsed):\n%s", diff)
	}
	if diff := cmp.Diff(settings.Defaults(), settings.Enforcer{ShutdownDelay: settings.Defaults().ShutdownDelay}.WithDefaults()); diff != "" {
		t.Errorf("WithDefaults of a zero Enforcer (-settings.Defaults +filled):\n%s", diff)
	}
	for addr, port := range map[string]int{cfg.Listen: settings.ProxyPort, cfg.CheckListen: settings.CheckPort, cfg.AdminListen: settings.AdminPort} {
		if addr != ":"+strconv.Itoa(port) {
			t.Errorf("address %q, want :%d", addr, port)
		}
	}
}
