package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

func limitPolicy(limit int) string {
	return fmt.Sprintf(`apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: watched, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: per-client
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: %d, window: 1h}
`, limit)
}

// The enforcer binary follows its ConfigMap through the API server, falls back to the mounted
// file while the API server cannot be reached, and hands back to the ConfigMap once it can be.
// The file is never rewritten behind the watch's back here: what the enforcer serves comes from
// the watch unless the test cut it.
func TestEnforcerBinaryWhenItsConfigMapChangesThenItServesItAndFallsBackToTheFileWithoutTheAPI(t *testing.T) {
	ctx := context.Background()
	tier.Needs(t, "the test control plane")
	env, err := testenv.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	k8s := env.Client
	ns := testenv.Namespace(t, k8s, "watch")
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sluice-watched"}, Data: map[string]string{"policy.yaml": limitPolicy(1)}}
	if err := k8s.Create(ctx, cm); err != nil {
		t.Fatal(err)
	}
	setLimit := func(limit int) {
		t.Helper()
		if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			if err := k8s.Get(ctx, client.ObjectKeyFromObject(cm), cm); err != nil {
				return err
			}
			cm.Data["policy.yaml"] = limitPolicy(limit)
			return k8s.Update(ctx, cm)
		}); err != nil {
			t.Fatal(err)
		}
	}

	// The enforcer reaches the API server through a forwarder the test can cut.
	host, err := url.Parse(env.Config.Host)
	if err != nil {
		t.Fatal(err)
	}
	fwd := newCuttable(t, host.Host)
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	writeKubeconfig(t, env, kubeconfig, "https://"+fwd.addr)

	dir := t.TempDir()
	file := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(file, []byte(limitPolicy(1)), 0o600); err != nil {
		t.Fatal(err)
	}
	proxy, admin := runBinary(t, "--policy="+file, "--reload-interval=100ms", "--configmap="+ns+"/sluice-watched", "--kubeconfig="+kubeconfig)
	// serving waits until the report says the enforcer serves the policy with this limit, from
	// source, and then checks that the proxy decides under it: limit passes of limit+1.
	client := 0
	serving := func(limit int, source string, within time.Duration) time.Duration {
		t.Helper()
		start := time.Now()
		want := report.Revision([]byte(limitPolicy(limit)))
		poll.WaitFor(t, within, func() error {
			if r := readReport(t, admin); r.Revision != want || r.ConfigSource != source {
				return fmt.Errorf("the enforcer serves revision %s from %s, want %s (limit %d) from %s", r.Revision, r.ConfigSource, want, limit, source)
			}
			return nil
		})
		took := time.Since(start)
		client++
		passed := 0
		for range limit + 1 {
			req, _ := http.NewRequest(http.MethodGet, "http://"+proxy+"/", nil)
			req.Header.Set("X-Client", fmt.Sprint("c", client))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				passed++
			}
		}
		if passed != limit {
			t.Errorf("%d of %d passed, want the limit %d", passed, limit+1, limit)
		}
		return took
	}

	serving(1, report.SourceAPI, 10*time.Second)
	setLimit(3)
	t.Logf("a ConfigMap change was served %v after the update", serving(3, report.SourceAPI, 2*time.Second).Round(time.Millisecond))

	// The API server cannot be reached: a change of the mounted file is applied.
	fwd.cut()
	if err := os.WriteFile(file, []byte(limitPolicy(5)), 0o600); err != nil {
		t.Fatal(err)
	}
	serving(5, report.SourceFile, 30*time.Second)

	// Back: the ConfigMap, changed meanwhile, wins again.
	setLimit(7)
	fwd.restore()
	serving(7, report.SourceAPI, 30*time.Second)

	// While the watch delivers, a stale file changing does not take over.
	if err := os.WriteFile(file, []byte(limitPolicy(2)), 0o600); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // real time passes for five file polls: a poll that ignores the file shows nowhere
	serving(7, report.SourceAPI, time.Second)
}

// Redis credentials from files are read at every new connection: a wrong password shows in the
// report in Redis's words, and the corrected file takes effect without a restart.
func TestEnforcerBinaryWhenThePasswordFileIsFixedThenTheStoreConnectsWithoutARestart(t *testing.T) {
	srv := redistest.NewServer(t)
	if err := srv.Client(t).ConfigSet(context.Background(), "requirepass", "right").Err(); err != nil {
		t.Fatal(err)
	}
	password := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(password, []byte("wrong\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	e := startEnforcerWith(t, limitPolicy(3), "--redis-url=redis://"+srv.Addr()+"/0", "--redis-password-file="+password)
	wait := func(connected bool, cause, message string) {
		t.Helper()
		poll.WaitFor(t, 15*time.Second, func() error {
			if r := readReport(t, e.admin); r.Store.Connected != connected || r.Store.Cause != cause || !strings.Contains(r.Store.Message, message) {
				return fmt.Errorf("store %+v, want connected %v, cause %q, message with %q", r.Store, connected, cause, message)
			}
			return nil
		})
	}
	wait(false, report.CauseAuthentication, "WRONGPASS")
	if got := e.send("alice", 5, 1); got[http.StatusOK] != 5 {
		t.Errorf("fail-open rule with a refused password: %v, want every request through", got)
	}
	if err := os.WriteFile(password, []byte("right\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	wait(true, "", "")
	if got := e.send("bob", 5, 1); got[http.StatusOK] != 3 || got[http.StatusTooManyRequests] != 2 {
		t.Errorf("after the fix: %v, want 3 passed and 2 refused", got)
	}
	r := readReport(t, e.admin)
	want := report.Counters{Allowed: 3, Limited: 2, FailedOpen: 5}
	if len(r.Rules) != 1 || r.Rules[0].Policy != "test/watched" || r.Rules[0].Counters != want {
		t.Errorf("report rules %+v, want per-client with %+v", r.Rules, want)
	}
}

func readReport(t *testing.T, admin string) report.Report {
	t.Helper()
	resp, err := http.Get("http://" + admin + report.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	var r report.Report
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		t.Fatal(err)
	}
	if r.Version != report.Version {
		t.Fatalf("report version %q", r.Version)
	}
	return r
}

// writeKubeconfig writes a cluster administrator's kubeconfig for env, with server as its address.
func writeKubeconfig(t *testing.T, env *testenv.Env, path, server string) {
	t.Helper()
	if err := env.WriteKubeconfig(path); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.LoadFromFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cfg.Clusters {
		c.Server = server
		c.TLSServerName = "localhost" // the serving certificate's name, not the forwarder's
	}
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
}

// cuttable forwards TCP connections to a backend until cut: then it closes every connection and
// refuses new ones, until restored.
type cuttable struct {
	addr, backend string
	mu            sync.Mutex
	down          bool
	conns         []net.Conn
}

func newCuttable(t *testing.T, backend string) *cuttable {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	c := &cuttable{addr: ln.Addr().String(), backend: backend}
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			c.mu.Lock()
			down := c.down
			c.mu.Unlock()
			if down {
				_ = in.Close()
				continue
			}
			out, err := net.Dial("tcp", backend)
			if err != nil {
				_ = in.Close()
				continue
			}
			c.mu.Lock()
			c.conns = append(c.conns, in, out)
			c.mu.Unlock()
			go func() { _, _ = io.Copy(out, in); _ = out.Close() }()
			go func() { _, _ = io.Copy(in, out); _ = in.Close() }()
		}
	}()
	return c
}

func (c *cuttable) cut() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.down = true
	for _, conn := range c.conns {
		_ = conn.Close()
	}
	c.conns = nil
}

func (c *cuttable) restore() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.down = false
}

// Each way a store can fail shows in the report with its cause and the store's own words.
func TestEnforcerBinaryWhenTheStoreFailsThenTheReportSaysWhy(t *testing.T) {
	closed, _ := local.FreeAddr()
	cases := []struct {
		name, cause, message string
		flags                func(t *testing.T) []string
	}{
		{"when the password is wrong then authentication", report.CauseAuthentication, "WRONGPASS", func(t *testing.T) []string {
			t.Helper()
			srv := redistest.NewServer(t)
			if err := srv.Client(t).ConfigSet(context.Background(), "requirepass", "right").Err(); err != nil {
				t.Fatal(err)
			}
			password := filepath.Join(t.TempDir(), "password")
			if err := os.WriteFile(password, []byte("wrong"), 0o600); err != nil {
				t.Fatal(err)
			}
			return []string{"--redis-url=redis://" + srv.Addr() + "/0", "--redis-password-file=" + password}
		}},
		{"when the certificate does not verify then tls", report.CauseTLS, "certificate signed by unknown authority", func(t *testing.T) []string {
			t.Helper()
			return []string{"--redis-url=redis://" + redistest.NewTLSServer(t).Addr() + "/0", "--redis-tls"}
		}},
		{"when Redis does not answer in time then timeout", report.CauseTimeout, "timeout", func(t *testing.T) []string {
			t.Helper()
			srv := redistest.NewServer(t)
			srv.Pause()
			t.Cleanup(srv.Resume)
			return []string{"--redis-url=redis://" + srv.Addr() + "/0"}
		}},
		{"when nothing listens then unreachable", report.CauseUnreachable, "connection refused", func(_ *testing.T) []string {
			return []string{"--redis-url=redis://" + closed + "/0"}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := startEnforcerWith(t, limitPolicy(3), c.flags(t)...)
			// The first ping has the decision's timeout, which a TLS handshake on loaded cores may
			// pass; the one after it has a second to spare and names the store's own error.
			poll.WaitFor(t, 10*time.Second, func() error {
				if r := readReport(t, e.admin); r.Store.Connected || r.Store.Cause != c.cause || !strings.Contains(r.Store.Message, c.message) || r.Store.Kind != "redis-standalone" {
					return fmt.Errorf("store %+v, want not connected, cause %s and a message with %q", r.Store, c.cause, c.message)
				}
				return nil
			})
		})
	}
}
