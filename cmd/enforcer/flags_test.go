package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
)

const flagsPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: flags, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: one-an-hour
      fixedWindow: {limit: 1, window: 1h}
`

// run runs the enforcer binary with args until it exits, and returns its exit code and output.
func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	bin := binary(t) // before the timeout starts: a cold build takes minutes
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		code = exit.ExitCode()
	case err != nil:
		t.Fatalf("enforcer %s: %v", strings.Join(args, " "), err)
	}
	return code, out.String(), errOut.String()
}

// Every combination of flags that cannot work is refused before anything starts, with exit code
// 2 and a message naming the flags; --help and --version exit 0. Through the real binary.
func TestFlagsWhenACombinationCannotWorkThenTheBinaryExits2NamingTheFlags(t *testing.T) {
	policy := "--policy=" + filepath.Join(t.TempDir(), "never-read.yaml")
	cases := []struct {
		name     string
		args     []string
		wantCode int
		want     []string // in stderr, or in stdout for exit 0
	}{
		{"when --help is asked then the usage, exit 0", []string{"--help"}, 0, nil},
		{"when --version is asked then version, commit and Go version, exit 0", []string{"--version"}, 0,
			[]string{"enforcer version ", ", commit ", runtime.Version()}},
		{"when --policy is missing then refused", []string{"--upstream=http://127.0.0.1:1"}, 2, []string{"--policy is required"}},
		{"when --listen has no --upstream then refused", []string{policy, "--listen=127.0.0.1:8080"}, 2,
			[]string{"--listen needs --upstream"}},
		{"when neither proxy, check API nor RLS would run then refused", []string{policy, "--check-listen="}, 2,
			[]string{"nothing would decide requests", "--upstream", "--check-listen", "--rls-listen"}},
		{"when --redis-tls has no Redis then refused", []string{policy, "--upstream=http://127.0.0.1:1", "--redis-tls"}, 2,
			[]string{"--redis-tls needs a Redis"}},
		{"when Redis credentials and timeout have no Redis then refused naming each", []string{policy, "--upstream=http://127.0.0.1:1",
			"--redis-password-file=/p", "--redis-username-file=/u", "--redis-timeout=1s", "--redis-ca-file=/ca", "--redis-server-name=r"}, 2,
			[]string{"--redis-ca-file, --redis-server-name, --redis-username-file, --redis-password-file, --redis-timeout need a Redis"}},
		{"when --redis-master has no --redis-sentinel then refused", []string{policy, "--upstream=http://127.0.0.1:1",
			"--redis-url=redis://127.0.0.1:1/0", "--redis-master=mymaster"}, 2, []string{"--redis-master names a Sentinel master set"}},
		{"when --redis-sentinel has no --redis-master then refused", []string{policy, "--upstream=http://127.0.0.1:1",
			"--redis-sentinel=127.0.0.1:1"}, 2, []string{"--redis-sentinel needs --redis-master"}},
		{"when two Redis are given then refused", []string{policy, "--upstream=http://127.0.0.1:1",
			"--redis-url=redis://127.0.0.1:1/0", "--redis-cluster=127.0.0.1:2"}, 2, []string{"--redis-url and --redis-cluster exclude each other"}},
		{"when --kubeconfig has no --configmap then refused", []string{policy, "--upstream=http://127.0.0.1:1", "--kubeconfig=/k"}, 2,
			[]string{"--kubeconfig is for --configmap"}},
		{"when --pprof has no admin address then refused", []string{policy, "--upstream=http://127.0.0.1:1", "--pprof", "--admin-listen="}, 2,
			[]string{"--pprof serves on the admin address"}},
		{"when two listeners share an address then refused", []string{policy, "--upstream=http://127.0.0.1:1", "--listen=127.0.0.1:7001",
			"--admin-listen=127.0.0.1:7001"}, 2, []string{"--listen and --admin-listen both listen on 127.0.0.1:7001"}},
		{"when --log-level is unknown then refused", []string{policy, "--upstream=http://127.0.0.1:1", "--log-level=verbose"}, 2,
			[]string{`--log-level "verbose": want error, info or debug`}},
		{"when a boolean flag is given a separate value then the value is refused", []string{policy, "--upstream=http://127.0.0.1:1", "--pprof", "true"}, 2,
			[]string{`unexpected argument "true"`}},
		{"when a flag does not exist then refused", []string{policy, "--upstreams=http://127.0.0.1:1"}, 2,
			[]string{"flag provided but not defined: -upstreams"}},
		{"when --pool comes with --policy, --configmap or --upstream then refused naming each", []string{policy, "--pool=gateways/shared",
			"--configmap=gateways/x", "--upstream=http://127.0.0.1:1"}, 2,
			[]string{"--pool serves the pool's policies from their ConfigMaps", "--policy, --configmap, --upstream cannot go with it"}},
		{"when --pool is not NAMESPACE/NAME then refused", []string{"--pool=shared"}, 2, []string{`--pool "shared": want NAMESPACE/NAME`}},
		{"when neither --policy nor --pool is given then refused naming both", []string{"--check-listen=127.0.0.1:7002"}, 2,
			[]string{"--policy is required (or --pool"}},
		{"when several combinations cannot work then each is named", []string{policy, "--listen=:8080", "--redis-tls", "--kubeconfig=/k"}, 2,
			[]string{"--listen needs --upstream", "--redis-tls needs a Redis", "--kubeconfig is for --configmap"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := run(t, c.args...)
			if code != c.wantCode {
				t.Fatalf("exit code %d, want %d\nstdout: %s\nstderr: %s", code, c.wantCode, stdout, stderr)
			}
			out := stderr
			if c.wantCode == 0 {
				out = stdout + stderr
			}
			for _, w := range c.want {
				if !strings.Contains(out, w) {
					t.Errorf("output does not say %q:\n%s", w, out)
				}
			}
		})
	}
}

// A URL that cannot be parsed is named in the error without its password: the error ends up in
// logs and, as the container's termination message, in the pod's status (found by a hostile
// review: the parser's own error quotes the whole URL).
func TestFlagsWhenAURLWithAPasswordIsWrongThenTheErrorDoesNotTellThePassword(t *testing.T) {
	policy := "--policy=" + filepath.Join(t.TempDir(), "never-read.yaml")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--upstream=http://127.0.0.1:1", "--redis-url=redis://:S3cret%zzPW@127.0.0.1:6379/0"}, `--redis-url redis://xxxxx@127.0.0.1:6379/0: invalid URL escape "%zz"`},
		{[]string{"--upstream=http://127.0.0.1:1", "--redis-url=redis://user:S3cret@127.0.0.1:port/0"}, "--redis-url redis://xxxxx@127.0.0.1:port/0: "},
		{[]string{"--upstream=http://admin:S3cret@127.0.0.1:1/path%zz"}, `--upstream "http://xxxxx@127.0.0.1:1/path%zz"`},
	} {
		code, stdout, stderr := run(t, append([]string{policy}, c.args...)...)
		if code != 2 || !strings.Contains(stderr, c.want) || strings.Contains(stdout+stderr, "S3cret") {
			t.Errorf("%v: exit %d, stderr:\n%s\nwant exit 2 and %q, and no password", c.args, code, stderr, c.want)
		}
	}
}

// The combinations beside the refused ones, one flag apart, are taken.
func TestFlagsWhenACombinationCanWorkThenItIsTaken(t *testing.T) {
	for _, args := range [][]string{
		{"--check-listen=127.0.0.1:7002"},                            // the check API alone
		{"--check-listen=", "--rls-listen=127.0.0.1:7003"},           // the rate limit service alone
		{"--upstream=http://127.0.0.1:1", "--listen=127.0.0.1:7001"}, // the proxy, with --listen
		{"--upstream=http://127.0.0.1:1", "--redis-url=redis://127.0.0.1:1/0", "--redis-tls", "--redis-timeout=1s"},
		{"--upstream=http://127.0.0.1:1", "--redis-sentinel=127.0.0.1:1", "--redis-master=mymaster"},
		{"--upstream=http://127.0.0.1:1", "--listen=127.0.0.1:0", "--check-listen=127.0.0.1:0"}, // port 0: two ports the kernel picks
		{"--check-listen=", "--listen=127.0.0.1:7001", "--upstream=http://127.0.0.1:1", "--pprof"},
		{"--upstream=http://127.0.0.1:1", "--log-level=debug"},
	} {
		if _, err := parse(append([]string{"--policy=p.yaml"}, args...)); err != nil {
			t.Errorf("%v: %v, want it taken", args, err)
		}
	}
	// A pool's replica, as the manager renders it: no --policy, no proxy.
	t.Setenv("KUBECONFIG", "")
	for _, args := range [][]string{
		{"--pool=gateways/shared", "--check-listen=127.0.0.1:7002", "--rls-listen=127.0.0.1:7003", "--kubeconfig=" + kubeconfigFile(t)},
		{"--pool=gateways/shared", "--kubeconfig=" + kubeconfigFile(t), "--redis-url=redis://127.0.0.1:1/0"},
	} {
		cfg, err := parse(args)
		if err != nil {
			t.Errorf("%v: %v, want it taken", args, err)
			continue
		}
		if cfg.Pool == nil || cfg.Pool.Namespace != "gateways" || cfg.Pool.Name != "shared" || cfg.PolicyFile != "" {
			t.Errorf("%v: pool %+v, policy file %q", args, cfg.Pool, cfg.PolicyFile)
		}
	}
}

// kubeconfigFile writes a kubeconfig of an API server that is never reached.
func kubeconfigFile(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	data := "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: \"https://127.0.0.1:1\"}}]\n" +
		"users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n"
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// --log-level=debug logs every refusal and every failed upstream request, one line each, with
// the rule's name; the default level logs neither. Both binaries export sluice_build_info.
func TestFlagsWhenTheLogLevelIsDebugThenRefusalsAndUpstreamErrorsAreLogged(t *testing.T) {
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(flagsPolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	// The HTTP/1.1 upstream is served by fasthttp, the h2c one by net/http: both log.
	for _, c := range []struct{ level, upstream string }{{"debug", "http://127.0.0.1:1"}, {"debug", "h2c://127.0.0.1:1"}, {"info", "http://127.0.0.1:1"}} {
		level := c.level
		t.Run("when the level is "+level+" and the upstream "+c.upstream, func(t *testing.T) {
			proxy, _ := local.FreeAddr()
			admin, _ := local.FreeAddr()
			log := &local.Output{}
			// An upstream nothing listens on: every request that passes is a 502.
			p, err := local.Start("enforcer", log, binary(t), "--policy="+file, "--upstream="+c.upstream,
				"--listen="+proxy, "--check-listen=", "--admin-listen="+admin, "--shutdown-delay=0s", "--log-level="+level)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(p.Stop)
			if err := local.WaitHTTP(p, "http://"+admin+"/readyz", 30*time.Second); err != nil {
				t.Fatal(err)
			}
			for _, want := range []int{http.StatusBadGateway, http.StatusTooManyRequests} {
				resp, err := http.Get("http://" + proxy + "/") //nolint:noctx // a loopback URL of the test's own process
				if err != nil {
					t.Fatal(err)
				}
				_ = resp.Body.Close()
				if resp.StatusCode != want {
					t.Fatalf("status %d, want %d", resp.StatusCode, want)
				}
			}
			metrics := get(t, "http://"+admin+"/metrics")
			if !strings.Contains(metrics, "sluice_build_info{") || !strings.Contains(metrics, fmt.Sprintf("go_version=%q", runtime.Version())) {
				t.Errorf("no sluice_build_info with go_version %s in the metrics", runtime.Version())
			}
			refused := func() error {
				if !strings.Contains(log.String(), `"msg":"Request refused"`) || !strings.Contains(log.String(), `"rule":"one-an-hour"`) {
					return fmt.Errorf("no refusal of rule one-an-hour logged:\n%s", log.String())
				}
				if !strings.Contains(log.String(), `"msg":"Upstream request failed"`) {
					return fmt.Errorf("no upstream failure logged:\n%s", log.String())
				}
				return nil
			}
			if level == "debug" {
				poll.WaitFor(t, 10*time.Second, refused)
				return
			}
			// The lines are written before the answers are sent: none came, none will.
			if strings.Contains(log.String(), "Request refused") || strings.Contains(log.String(), "Upstream request failed") {
				t.Errorf("at level info, per-request lines were logged:\n%s", log.String())
			}
		})
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url) //nolint:noctx // a loopback URL of the test's own process
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(body)
}
