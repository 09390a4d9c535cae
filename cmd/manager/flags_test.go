package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

var (
	managerBin  string
	managerErr  error
	managerOnce sync.Once
)

// binary builds the manager once per test run.
func binary(t *testing.T) string {
	t.Helper()
	tier.Needs(t, "the built manager binary")
	managerOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sluice-manager-bin")
		if err != nil {
			managerErr = err
			return
		}
		managerBin, managerErr = local.BuildCmd(context.Background(), dir, "manager")
	})
	if managerErr != nil {
		t.Fatal(managerErr)
	}
	return managerBin
}

// Every combination of the manager's flags that cannot work is refused before it connects to
// anything, with exit code 2 and a message naming the flags; --help and --version exit 0.
// Through the real binary, with no cluster to reach: a refusal must come first.
func TestFlagsWhenACombinationCannotWorkThenTheManagerExits2NamingTheFlags(t *testing.T) {
	cases := []struct {
		name     string
		args     []string
		wantCode int
		want     []string
	}{
		{"when --help is asked then the usage, exit 0", []string{"--help"}, 0, []string{"-version"}},
		{"when --version is asked then version, commit and Go version, exit 0", []string{"--version"}, 0,
			[]string{"manager version ", ", commit ", runtime.Version()}},
		{"when lease timings have no --leader-elect then refused", []string{"--leader-elect-lease-duration=30s"}, 2,
			[]string{"--leader-elect-lease-duration time leader election, which needs --leader-elect"}},
		{"when the renew deadline is the lease duration then refused", []string{"--leader-elect", "--leader-elect-lease-duration=10s"}, 2,
			[]string{"--leader-elect-renew-deadline 10s must be shorter than --leader-elect-lease-duration 10s"}},
		{"when the renew deadline is 1.2 retry periods then refused", []string{"--leader-elect", "--leader-elect-retry-period=5s", "--leader-elect-renew-deadline=6s"}, 2,
			[]string{"--leader-elect-renew-deadline 6s must be longer than 1.2 times --leader-elect-retry-period 5s"}},
		{"when built-in certificate flags come with --webhook-cert-dir then refused", []string{"--webhook-cert-dir=/certs", "--webhook-secret=s", "--webhook-cert-hosts=a"}, 2,
			[]string{"--webhook-secret, --webhook-cert-hosts shape the built-in certificates, which --webhook-cert-dir replaces"}},
		{"when a count or interval is 0 then refused", []string{"--workers=0", "--kube-api-qps=0", "--report-interval=0s"}, 2,
			[]string{"--workers, --kube-api-qps, --report-interval must be positive"}},
		{"when the probe interval is negative then refused", []string{"--redis-probe-interval=-1s"}, 2,
			[]string{"--redis-probe-interval must not be negative"}},
		{"when a boolean flag is given a separate value then the value is refused", []string{"--leader-elect", "true"}, 2,
			[]string{`unexpected argument "true"`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			bin := binary(t) // before the timeout starts: a cold build takes minutes
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, c.args...)
			// No cluster: a manager that got past its flags would fail to find one, with exit 1.
			cmd.Env = append(os.Environ(), "KUBECONFIG=/nonexistent")
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			err := cmd.Run()
			code := 0
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				code = exit.ExitCode()
			} else if err != nil {
				t.Fatal(err)
			}
			if code != c.wantCode {
				t.Fatalf("exit code %d, want %d:\n%s", code, c.wantCode, out.String())
			}
			for _, w := range c.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output does not say %q:\n%s", w, out.String())
				}
			}
		})
	}
}

// The values beside the refused ones, one apart, are taken: the manager goes on to look for a
// cluster (and, here, finds none: exit 1, not 2).
func TestFlagsWhenACombinationCanWorkThenTheManagerGoesOn(t *testing.T) {
	for _, args := range [][]string{
		{"--leader-elect", "--leader-elect-lease-duration=30s"},
		{"--leader-elect", "--leader-elect-lease-duration=11s"},
		{"--leader-elect", "--leader-elect-retry-period=5s", "--leader-elect-renew-deadline=6001ms", "--leader-elect-lease-duration=7s"},
		{"--webhook-cert-dir=/certs"},
		{"--workers=1", "--kube-api-qps=0.1", "--kube-api-burst=1", "--report-interval=1ms", "--redis-probe-interval=0s"},
	} {
		bin := binary(t) // before the timeout starts: a cold build takes minutes
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Env = append(os.Environ(), "KUBECONFIG=/nonexistent")
		out, err := cmd.CombinedOutput()
		cancel()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() == 2 {
			t.Errorf("%v: %v, want the flags taken and exit 1 for want of a cluster:\n%s", args, err, out)
		}
	}
}
