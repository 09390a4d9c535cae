package main

import (
	"fmt"
	"io"
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
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// leasePolicy is one rule per client, leased: rule is the algorithm's YAML, lease the lease's.
func leasePolicy(rule, lease string) string {
	return fmt.Sprintf(`apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: leased, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  defaultFailureMode: Closed
  rules:
    - name: per-client
      key: [{type: Header, name: X-Client}]
      %s
      lease: %s
`, rule, lease)
}

// sendAll sends n requests of client through the enforcers at once, conc each, and returns how
// many passed; any answer but 200 or 429 fails the test.
func sendAll(t *testing.T, es []*enforcerProcess, client string, n, conc int) int {
	t.Helper()
	var mu sync.Mutex
	total := map[int]int{}
	var wg sync.WaitGroup
	for _, e := range es {
		wg.Go(func() {
			got := e.send(client, n, conc)
			mu.Lock()
			for k, v := range got {
				total[k] += v
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	if len(total) > 2 || total[http.StatusOK]+total[http.StatusTooManyRequests] != n*len(es) {
		t.Fatalf("answers %v, want only 200 and 429", total)
	}
	return total[http.StatusOK]
}

// Three enforcer binaries on one Redis, standalone or Cluster, lease a fixed window of 100 ten
// units at a time: of 999 requests of one client sent to the three at once exactly 100 pass,
// run after run; and a hot client under a large limit costs Redis at most one script per 20
// decisions (a lease of 100).
func TestEnforcerBinariesWhenTheyLeaseOneClientsUnitsThenExactlyTheLimitPassesOnFewScripts(t *testing.T) {
	standalone := redistest.NewServer(t)
	cluster := redistest.NewCluster(t, 3)
	for name, flag := range map[string]string{
		"standalone": "--redis-url=redis://" + standalone.Addr() + "/0",
		"cluster":    "--redis-cluster=" + strings.Join(cluster.Addrs(), ","),
	} {
		t.Run(name, func(t *testing.T) {
			policy := leasePolicy("fixedWindow: {limit: 100, window: 1h}", "{max: 10, expiry: 1m}")
			var es []*enforcerProcess
			for range 3 {
				es = append(es, startEnforcerWith(t, policy, flag, "--redis-timeout=2s"))
			}
			for run := range 3 {
				if got := sendAll(t, es, fmt.Sprintf("exact-%d", run), 333, 16); got != 100 {
					t.Fatalf("run %d: %d of 999 passed, want exactly 100", run, got)
				}
			}
		})
	}
	t.Run("scripts", func(t *testing.T) {
		policy := leasePolicy("fixedWindow: {limit: 1000000, window: 1h}", "{max: 100}")
		var es []*enforcerProcess
		for range 3 {
			es = append(es, startEnforcerWith(t, policy, "--redis-url=redis://"+standalone.Addr()+"/0", "--redis-timeout=2s"))
		}
		admin := standalone.Client(t)
		before := redistest.ScriptCalls(t, admin)
		if got := sendAll(t, es, "hot", 1000, 16); got != 3000 {
			t.Fatalf("%d of 3000 passed, want all", got)
		}
		if scripts := redistest.ScriptCalls(t, admin) - before; scripts > 150 {
			t.Fatalf("%d scripts for 3,000 decisions, want at most 150 (0.05 a decision)", scripts)
		}
	})
}

// An enforcer that leased 49 units of a token bucket of 100 and was killed with SIGKILL: while
// its lease lasts (10 s) the bucket refills to at most the 51 others, so three seconds later the
// enforcer left passes 51 (and what refills while they send), not the 100 a bucket that forgot the
// lease would hold; once the lease has expired and the bucket had the time to refill (2 s), the
// whole capacity passes again. The survivor's own lease never lowers what it may take.
func TestEnforcerBinaryWhenKilledHoldingLeasedUnitsThenTheBucketIsWholeOnceTheLeaseExpires(t *testing.T) {
	srv := redistest.NewServer(t)
	policy := leasePolicy("tokenBucket: {capacity: 100, refill: {tokens: 100, period: 2s}}", "{max: 50, expiry: 10s}")
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(policy), 0o600); err != nil {
		t.Fatal(err)
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }))
	t.Cleanup(up.Close)
	proxy, _ := local.FreeAddr()
	admin, _ := local.FreeAddr()
	p, err := local.Start("doomed", &local.Output{}, binary(t), "--policy="+file, "--redis-url=redis://"+srv.Addr()+"/0", "--redis-timeout=2s",
		"--upstream="+up.URL, "--listen="+proxy, "--check-listen=", "--admin-listen="+admin, "--shutdown-delay=0s")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	if err := local.WaitHTTP(p, "http://"+admin+"/readyz", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	// One survivor: the units a live enforcer leased and spent keep lowering the bucket for the
	// others until its next trip or its lease's expiry (at most max-1 each), which this test
	// does not measure.
	survivors := []*enforcerProcess{startEnforcerWith(t, policy, "--redis-url=redis://"+srv.Addr()+"/0", "--redis-timeout=2s")}
	doomed := &enforcerProcess{proxy: "http://" + proxy, client: &http.Client{Timeout: 10 * time.Second}}
	leased := time.Now()
	if got := doomed.send("k", 1, 1); got[http.StatusOK] != 1 {
		t.Fatalf("the first request: %v", got)
	}
	if err := p.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// sendFor sends n requests through the survivors and returns how many passed and the most
	// that may: want units, and what refills meanwhile (50 a second).
	sendFor := func(n, want int) (got, most int) {
		start := time.Now()
		got = sendAll(t, survivors, "k", n, 8)
		return got, want + int(time.Since(start).Seconds()*50) + 1
	}
	// Real time for the bucket to refill past what it may hold while the lease lasts.
	time.Sleep(time.Until(leased.Add(3 * time.Second)))
	got, most := sendFor(100, 51)
	if during := time.Since(leased); during >= 10*time.Second {
		t.Fatalf("the survivors took until %v after the lease, past its expiry", during)
	}
	if got < 51 || got > most {
		t.Fatalf("3 s into the lease: %d passed, want 51 to %d: the bucket refills to 100 less the 49 leased", got, most)
	}
	// Real time for the lease to expire (10 s) and the bucket to refill whole (2 s).
	time.Sleep(time.Until(leased.Add(10*time.Second + 2*time.Second + 500*time.Millisecond)))
	if got, most := sendFor(150, 100); got < 100 || got > most {
		t.Fatalf("after the lease expired and the bucket refilled: %d passed, want the whole capacity (100 to %d)", got, most)
	}
}
