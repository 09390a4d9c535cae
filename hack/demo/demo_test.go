package main_test

import (
	"bufio"
	"io"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// The README's first command must work, and work again: run the demo twice, read its report, and
// stop it with Ctrl-C each time.
func TestDemoWhenRunTwiceThenEachRunReportsTheBurstAndStopsCleanlyOnCtrlC(t *testing.T) {
	tier.Needs(t, "the test control plane and redis-server")
	dir := t.TempDir()
	bin := filepath.Join(dir, "sluice-demo")
	build := exec.Command("go", "build", "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	for run := 1; run <= 2; run++ {
		cmd := exec.Command(bin, "-dir", filepath.Join(dir, "state"))
		cmd.Dir = testenv.RepoRoot()
		out, w := io.Pipe()
		cmd.Stdout, cmd.Stderr = w, w
		// The demo, and so what it started, dies with the test process, however it ends.
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGINT}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		report := readUntil(t, out, "Ctrl-C stops everything.", 3*time.Minute, cmd)
		for _, want := range []string{"5 passed, 3 refused", "429 Too Many Requests  1", `"per-client";q=5;w=5`, "Programmed   True", "Ready        True", "2/2 replicas serve revision",
			"rule per-client over the last minute: 5 allowed, 3 limited (37.5%)", "kubectl get rlp: READY 2/2, LIMITED 37.5%", "kubectl get rlp"} {
			if !strings.Contains(report, want) {
				t.Errorf("run %d: report lacks %q:\n%s", run, want, report)
			}
		}
		if n := strings.Count(report, "200 OK"); n != 5 {
			t.Errorf("run %d: %d requests passed, want 5:\n%s", run, n, report)
		}
		_ = cmd.Process.Signal(syscall.SIGINT)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait(); _ = w.Close() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("run %d: exit after Ctrl-C: %v", run, err)
			}
		case <-time.After(60 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatalf("run %d: still running 60s after Ctrl-C", run)
		}
	}
}

// readUntil reads lines until one contains marker, and returns everything read.
func readUntil(t *testing.T, r io.Reader, marker string, timeout time.Duration, cmd *exec.Cmd) string {
	t.Helper()
	lines := make(chan string)
	go func() {
		s := bufio.NewScanner(r)
		for s.Scan() {
			lines <- s.Text()
		}
		close(lines)
	}()
	var b strings.Builder
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("the demo ended before %q:\n%s", marker, b.String())
			}
			b.WriteString(l + "\n")
			if strings.Contains(l, marker) {
				go func() {
					for range lines { // keep draining so the demo never blocks on its output
					}
				}()
				return b.String()
			}
		case <-deadline:
			_ = cmd.Process.Kill()
			t.Fatalf("no %q within %v:\n%s", marker, timeout, b.String())
		}
	}
}
