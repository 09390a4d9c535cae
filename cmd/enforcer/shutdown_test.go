package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

var (
	enforcerBin  string
	enforcerErr  error
	enforcerOnce sync.Once
)

// binary builds the enforcer once per test run: tests of what users run start the real binary.
func binary(t *testing.T) string {
	t.Helper()
	tier.Needs(t, "the built enforcer binary")
	enforcerOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sluice-enforcer-bin")
		if err != nil {
			enforcerErr = err
			return
		}
		enforcerBin, enforcerErr = local.BuildCmd(context.Background(), dir, "enforcer")
	})
	if enforcerErr != nil {
		t.Fatal(enforcerErr)
	}
	return enforcerBin
}

const shutdownPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: drain, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: slow
      match: {path: {value: /slow}}
      fixedWindow: {limit: 1000, window: 1h}
    - name: queue
      match: {path: {value: /queue}}
      leakyBucket: {capacity: 10, drain: {requests: 1, period: 250ms}}
    - name: held
      match: {path: {value: /held}}
      leakyBucket: {capacity: 10, drain: {requests: 1, period: 250ms}}
`

// On SIGTERM the real binary fails /readyz at once, keeps serving through --shutdown-delay, then
// stops accepting and answers every request it had accepted (a slow upstream, a leaky-bucket
// queue on the proxy, answers held by the check API), and exits 0 only after the last of them.
func TestEnforcerBinaryWhenSIGTERMThenEveryAcceptedRequestIsAnsweredBeforeExit0(t *testing.T) {
	for _, storeName := range []string{"memory", "redis"} {
		t.Run("when the store is "+storeName, func(t *testing.T) {
			var storeFlags []string
			if storeName == "redis" {
				storeFlags = []string{"--redis-url=redis://" + redistest.NewServer(t).Addr() + "/0", "--redis-timeout=2s"}
			}
			testShutdown(t, storeFlags)
		})
	}
}

func testShutdown(t *testing.T, storeFlags []string) {
	t.Helper()
	bin := binary(t)
	var slowSeen sync.WaitGroup
	slowSeen.Add(10)
	// The slow requests are answered once the drain is under way, not after a guess at when.
	held := make(chan struct{})
	release := sync.OnceFunc(func() { close(held) })
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			slowSeen.Done()
			<-held
		}
		_, _ = io.WriteString(w, "ok")
	}))
	defer up.Close()
	defer release() // first: Close waits for the handlers

	dir := t.TempDir()
	file := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(file, []byte(shutdownPolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	addrs := make([]string, 3)
	for i := range addrs {
		a, err := local.FreeAddr()
		if err != nil {
			t.Fatal(err)
		}
		addrs[i] = a
	}
	proxy, check, admin := addrs[0], addrs[1], addrs[2]
	log := &local.Output{}
	p, err := local.Start("enforcer", log, bin, append([]string{
		"--policy=" + file, "--upstream=" + up.URL,
		"--listen=" + proxy, "--check-listen=" + check, "--admin-listen=" + admin,
		"--shutdown-delay=1s", "--shutdown-timeout=20s",
	}, storeFlags...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	if err := local.WaitHTTP(p, "http://"+admin+"/readyz", 30*time.Second); err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 30 * time.Second}
	type answer struct {
		kind   string
		status int
		err    error
		at     time.Time
	}
	answers := make(chan answer, 31)
	send := func(kind string, req *http.Request) {
		resp, err := client.Do(req)
		a := answer{kind: kind, err: err}
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			a.status = resp.StatusCode
		}
		a.at = time.Now()
		answers <- a
	}
	for range 10 {
		slow, _ := http.NewRequest(http.MethodGet, "http://"+proxy+"/slow", nil)
		queued, _ := http.NewRequest(http.MethodGet, "http://"+proxy+"/queue", nil)
		held, _ := http.NewRequest(http.MethodGet, "http://"+check+"/forward-auth", nil)
		held.Header.Set("X-Forwarded-Method", "GET")
		held.Header.Set("X-Forwarded-Uri", "/held")
		go send("slow upstream", slow)
		go send("leaky queue", queued)
		go send("check API hold", held)
	}
	// Every request is in flight: the slow ones reached the upstream, the queued and held ones
	// were admitted with a wait of up to 2.25 s.
	slowSeen.Wait()
	for _, rule := range []string{"queue", "held"} {
		waitMetric(t, admin, fmt.Sprintf(`sluice_decisions_total{namespace="test",policy="drain",result="allowed",rule=%q}`, rule), 10)
	}

	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	signalled := time.Now()
	if err := poll.Until(2*time.Second, func() error {
		if s := status(client, "http://"+admin+"/readyz"); s != http.StatusServiceUnavailable {
			return fmt.Errorf("/readyz answers %d after SIGTERM, want 503", s)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	// During the delay the listeners still accept: endpoints may not have dropped the pod yet.
	if time.Since(signalled) < 500*time.Millisecond {
		if s := status(client, "http://"+proxy+"/slow-not"); s != http.StatusOK {
			t.Errorf("a request sent during the shutdown delay got %d, want 200", s)
		}
	}
	// After the delay the proxy refuses new connections while the drain goes on.
	if err := poll.Until(5*time.Second, func() error {
		c, err := net.DialTimeout("tcp", proxy, time.Second)
		if err != nil {
			return nil // refused: what is waited for
		}
		_ = c.Close()
		return errors.New("the proxy still accepts connections after the shutdown delay")
	}); err != nil {
		t.Error(err)
	}
	release()

	var last time.Time
	for range 30 {
		a := <-answers
		if a.err != nil || a.status != http.StatusOK {
			t.Errorf("%s: status %d, error %v; want 200", a.kind, a.status, a.err)
		}
		if a.at.After(last) {
			last = a.at
		}
	}
	if err := p.Wait(); err != nil {
		t.Errorf("exit: %v, want status 0\n%s", err, log.String())
	}
	if exited := time.Now(); exited.Before(last) {
		t.Errorf("exited at %v, before the last answer at %v", exited, last)
	}
	if d := last.Sub(signalled); d < time.Second {
		t.Errorf("the last answer came %v after SIGTERM, within the shutdown delay; the slow upstream answers only once the drain is under way, so the drain did not wait", d)
	}
}

func status(c *http.Client, u string) int {
	resp, err := c.Get(u)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode
}

// waitMetric waits until the admin server's /metrics shows series at want.
func waitMetric(t *testing.T, admin, series string, want float64) {
	t.Helper()
	poll.WaitFor(t, 10*time.Second, func() error {
		if got := scrape(admin, series); got != want {
			return fmt.Errorf("%s = %v, want %v", series, got, want)
		}
		return nil
	})
}

func scrape(admin, series string) float64 {
	resp, err := http.Get("http://" + admin + "/metrics") //nolint:gosec // loopback address we chose
	if err != nil {
		return -1
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	for line := range strings.SplitSeq(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			var f float64
			_, _ = fmt.Sscan(v, &f)
			return f
		}
	}
	return 0
}
