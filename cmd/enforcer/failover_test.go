package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

const failoverPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: failover, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  defaultFailureMode: Closed
  rules:
    - name: per-client
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: 100, window: 1h}
`

// redisKey is the Redis key of a client of failoverPolicy, to find the node that holds it, as the
// enforcer's admin endpoint /keys names it.
func (e *enforcerProcess) redisKey(t *testing.T, client string) string {
	t.Helper()
	q := url.Values{"policy": {"test/failover"}, "addr": {"127.0.0.1"}, "header": {"X-Client:" + client}}
	var reply struct {
		Rules []struct{ Key string } `json:"rules"`
	}
	resp, err := http.Get("http://" + e.admin + enforcer.KeysPath + "?" + q.Encode())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	if err := json.NewDecoder(resp.Body).Decode(&reply); err != nil || len(reply.Rules) != 1 || reply.Rules[0].Key == "" {
		t.Fatalf("/keys: %+v, %v; want the key of the one rule", reply, err)
	}
	return reply.Rules[0].Key
}

// enforcerProcess runs the enforcer binary with failoverPolicy and the given store flags.
type enforcerProcess struct {
	proxy, admin string
	client       *http.Client
}

func startEnforcer(t *testing.T, storeFlags ...string) *enforcerProcess {
	t.Helper()
	return startEnforcerWith(t, failoverPolicy, storeFlags...)
}

// startEnforcerWith runs the enforcer binary with the policy document and flags given.
func startEnforcerWith(t *testing.T, policy string, storeFlags ...string) *enforcerProcess {
	t.Helper()
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(policy), 0o600); err != nil {
		t.Fatal(err)
	}
	proxy, admin := runBinary(t, append([]string{"--policy=" + file, "--redis-timeout=100ms"}, storeFlags...)...)
	return &enforcerProcess{proxy: "http://" + proxy, admin: admin, client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 10 * time.Second}}
}

// runBinary runs the enforcer binary with flags, in front of an upstream that answers "ok", on
// loopback addresses with no check API and no shutdown delay, until the test ends, and waits
// until it is ready. It returns the proxy's and the admin server's addresses; the test prints the
// enforcer's log if it fails.
func runBinary(t *testing.T, flags ...string) (proxy, admin string) {
	t.Helper()
	proxy, admin, _ = runBinaryLogged(t, flags...)
	return proxy, admin
}

// runBinaryLogged is runBinary that also returns the enforcer's log.
func runBinaryLogged(t *testing.T, flags ...string) (proxy, admin string, log *local.Output) {
	t.Helper()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }))
	t.Cleanup(up.Close)
	proxy, _ = local.FreeAddr()
	admin, _ = local.FreeAddr()
	log = &local.Output{}
	p, err := local.Start("enforcer", log, binary(t), append([]string{
		"--upstream=" + up.URL, "--listen=" + proxy, "--check-listen=", "--admin-listen=" + admin, "--shutdown-delay=0s",
	}, flags...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("enforcer log:\n%s", log.String())
		}
	})
	if err := local.WaitHTTP(p, "http://"+admin+"/readyz", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	return proxy, admin, log
}

// send sends n requests for client, conc at a time, and counts the answers by status.
func (e *enforcerProcess) send(client string, n, conc int) map[int]int {
	return e.sendTo("/", client, n, conc)
}

// sendTo is send to a path.
func (e *enforcerProcess) sendTo(path, client string, n, conc int) map[int]int {
	var mu sync.Mutex
	counts := map[int]int{}
	work := make(chan struct{}, n)
	for range n {
		work <- struct{}{}
	}
	close(work)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for range work {
				req, _ := http.NewRequest(http.MethodGet, e.proxy+path, nil)
				req.Header.Set("X-Client", client)
				status := 0
				if resp, err := e.client.Do(req); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					_ = resp.Body.Close()
					status = resp.StatusCode
				}
				mu.Lock()
				counts[status]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return counts
}

// switchover sends one request for client every 20 ms from the moment fail is called until 25
// answers in a row (half a second) are decisions again (200 or 429), for at most 60 s: a
// Cluster's nodes may still be agreeing on the new slot map after the first decisions come back. It returns how long the
// switch took and the answers meanwhile.
func (e *enforcerProcess) switchover(t *testing.T, client string, fail func()) (time.Duration, map[int]int) {
	t.Helper()
	counts := map[int]int{}
	start := time.Now()
	fail()
	var recovered time.Duration
	// Recovered once 25 requests in a row are decided; a failure mode's answer starts over.
	err := poll.Until(60*time.Second, func() error {
		for streak := 0; streak < 25; streak++ {
			decided := false
			for status, n := range e.send(client, 1, 1) {
				counts[status] += n
				decided = status == http.StatusOK || status == http.StatusTooManyRequests
			}
			if !decided {
				return fmt.Errorf("answers %v", counts)
			}
			if streak == 0 {
				recovered = time.Since(start)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("no decisions after the failure: %v", err)
	}
	return recovered, counts
}

// checkFailover is the shared course of a failover: a client charged before the failure, the
// switch with fail-closed answers meanwhile, then exactness on a fresh client and what the
// charged client lost.
func checkFailover(t *testing.T, e *enforcerProcess, before, during, after string, fail func()) {
	t.Helper()
	if got := e.send(before, 60, 8); got[http.StatusOK] != 60 {
		t.Fatalf("before the failure: %v, want 60 admitted", got)
	}
	took, meanwhile := e.switchover(t, during, fail)
	if meanwhile[http.StatusServiceUnavailable] == 0 {
		t.Errorf("no fail-closed answer during the switch (%v): the failure was not seen", meanwhile)
	}
	if wrong := meanwhile[0] + meanwhile[http.StatusBadGateway]; wrong > 0 {
		t.Errorf("%d requests failed otherwise than by the rule's failure mode: %v", wrong, meanwhile)
	}
	if took > 15*time.Second {
		t.Errorf("decisions came back %v after the failure, want within 15 s", took)
	}
	if got := e.send(after, 150, 16); got[http.StatusOK] != 100 || got[http.StatusTooManyRequests] != 50 {
		t.Errorf("a fresh client after the switch: %v, want exactly 100 admitted and 50 refused", got)
	}
	again := e.send(before, 100, 8)[http.StatusOK]
	if again < 40 {
		t.Errorf("the client charged 60 before the failure was admitted %d of 100 after it, want at least 40", again)
	}
	t.Logf("decisions back %v after the failure; during the switch %v (503 = fail-closed); the client charged 60 before was admitted %d of 100 after (%d increments lost)",
		took.Round(10*time.Millisecond), meanwhile, again, again-40)
}

// An enforcer that nobody sends a request to after its breaker opened closes it once Redis
// answers its health ping: the breaker waited for a request to probe, and the alert on it
// (SluiceStoreBreakerOpen) paged for an idle enforcer while Redis answered every ping.
func TestEnforcerBinaryWhenRedisComesBackWithoutTrafficThenTheBreakerCloses(t *testing.T) {
	srv := redistest.NewServer(t)
	e := startEnforcer(t, "--redis-url=redis://"+srv.Addr()+"/0")
	if got := e.send("idle", 1, 1); got[http.StatusOK] != 1 {
		t.Fatalf("a request while Redis answers: %v", got)
	}
	srv.Pause()
	got := e.send("idle", 3, 1)
	srv.Resume()
	if got[http.StatusServiceUnavailable] != 3 || adminMetric(t, e.admin, "sluice_store_breaker_open") != 1 {
		t.Fatalf("three requests while Redis was stopped: %v, breaker open %v; want three fail-closed answers opening it",
			got, adminMetric(t, e.admin, "sluice_store_breaker_open"))
	}
	waitUntil(t, "the breaker closed with no request sent", func() bool {
		return adminMetric(t, e.admin, "sluice_store_breaker_open") == 0
	})
}

// Kill a Sentinel-watched master under traffic: the enforcer follows the promoted replica within
// seconds, fail-closed rules answer 503 meanwhile, and the limit is exact again after the switch.
func TestEnforcerBinaryWhenTheSentinelMasterIsKilledThenItFollowsThePromotedReplica(t *testing.T) {
	master := redistest.NewServer(t)
	replica := redistest.NewReplica(t, master)
	sentinel := redistest.NewSentinel(t, master)
	e := startEnforcer(t, "--redis-sentinel="+sentinel.Addr(), "--redis-master="+redistest.SentinelMaster)
	checkFailover(t, e, "early", "during", "late", master.Kill)
	addr, err := sentinel.Client(t).Do(context.Background(), "SENTINEL", "get-master-addr-by-name", redistest.SentinelMaster).StringSlice()
	if err != nil || len(addr) != 2 || addr[1] != fmt.Sprint(replica.Port) {
		t.Errorf("the sentinel names master %v (%v), want the promoted replica on port %d", addr, err, replica.Port)
	}
}

// Kill a Redis Cluster master under traffic: its replica is promoted, the enforcer follows the
// new slot owner, fail-closed rules answer 503 meanwhile, and the limit is exact again after.
func TestEnforcerBinaryWhenAClusterMasterIsKilledThenItFollowsThePromotedReplica(t *testing.T) {
	cluster := redistest.NewClusterWithReplicas(t, 3)
	ctx := context.Background()
	// The clients of the test all live on one master: the one killed.
	cc := cluster.Client(t)
	e := startEnforcer(t, "--redis-cluster="+strings.Join(cluster.Addrs(), ","))
	owner := func(client string) string {
		m, err := cc.MasterForKey(ctx, e.redisKey(t, client))
		if err != nil {
			t.Fatal(err)
		}
		return m.Options().Addr
	}
	doomed := owner("early")
	clients := []string{"early"}
	for i := 0; len(clients) < 3; i++ {
		if c := fmt.Sprintf("client-%d", i); owner(c) == doomed {
			clients = append(clients, c)
		}
	}
	var victim *redistest.Server
	for _, n := range cluster.Nodes {
		if n.Addr() == doomed {
			victim = n
		}
	}
	checkFailover(t, e, clients[0], clients[1], clients[2], victim.Kill)
	cc = cluster.Client(t) // a client that reads the slot map afresh
	if now := owner(clients[0]); now == doomed {
		t.Errorf("the killed master %s still owns the clients' slots", doomed)
	}
}
