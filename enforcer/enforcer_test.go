package enforcer_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"
	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/settings"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// upstream is a real HTTP server that records what reaches it.
type upstream struct {
	*httptest.Server
	hits     atomic.Int64
	mu       sync.Mutex
	arrivals []time.Time
	// held closes to answer the requests to /slow, which wait for it: a request in flight for
	// as long as the test needs, not for a guess at how long that is.
	held    chan struct{}
	release func()
}

func newUpstream(t *testing.T) *upstream {
	t.Helper()
	u := &upstream{held: make(chan struct{})}
	u.release = sync.OnceFunc(func() { close(u.held) })
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.hits.Add(1)
		u.mu.Lock()
		u.arrivals = append(u.arrivals, time.Now())
		u.mu.Unlock()
		if strings.HasPrefix(r.URL.Path, "/slow") {
			<-u.held
		}
		w.Header().Set("X-Seen-Forwarded-For", r.Header.Get("X-Forwarded-For"))
		_, _ = io.Copy(w, r.Body)
	}))
	t.Cleanup(u.Close)
	t.Cleanup(u.release) // first: Close waits for the handlers
	return u
}

// onClock makes clk the enforcer's one clock: the memory store's, the refusal cache's and, in
// place of Redis TIME, the Redis scripts'. A test moves it on instead of sleeping.
func onClock(clk *clocktesting.FakeClock) func(*enforcer.Config) {
	return func(c *enforcer.Config) {
		c.Now = clk.Now
		if c.Redis != nil {
			r := *c.Redis
			r.Now = clk.Now
			c.Redis = &r
		}
	}
}

type running struct {
	*enforcer.Enforcer
	proxy, check, admin string
	file                string
	stop                context.CancelFunc
}

// start runs an enforcer on loopback ports with the given policy documents.
func start(t *testing.T, policy string, up *upstream, redisOpts *store.RedisOptions, tweak ...func(*enforcer.Config)) *running {
	t.Helper()
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(policy), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := enforcer.Config{
		PolicyFile: file, Listen: "127.0.0.1:0", CheckListen: "127.0.0.1:0", AdminListen: "127.0.0.1:0",
		Redis: redisOpts, Log: logr.Discard(),
		Enforcer: settings.Enforcer{ReloadInterval: 100 * time.Millisecond, ShutdownTimeout: 5 * time.Second},
	}
	if up != nil {
		cfg.Upstream, _ = url.Parse(up.URL)
	}
	for _, f := range tweak {
		f(&cfg)
	}
	ctx, cancel := context.WithCancel(context.Background())
	e, err := enforcer.Start(ctx, cfg)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = e.Wait()
	})
	return &running{Enforcer: e, proxy: "http://" + e.ProxyAddr, check: "http://" + e.CheckAddr, admin: "http://" + e.AdminAddr, file: file, stop: cancel}
}

func policyDoc(name, rules string, extra ...string) string {
	return fmt.Sprintf(`apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: %s, namespace: test}
spec:
  targetRef: {name: api, port: 80}
%s  rules:
%s`, name, strings.Join(extra, ""), rules)
}

var client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}, Timeout: 10 * time.Second}

// reply is what tests read of a response; get has already drained and closed its body.
type reply struct {
	StatusCode int
	Header     http.Header
}

// get sends a GET with header name/value pairs.
func get(t *testing.T, u string, header ...string) reply {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Error(err) // not Fatal: get runs in goroutines too
		return reply{Header: http.Header{}}
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return reply{resp.StatusCode, resp.Header}
}

// rateLimit parses the RateLimit-Policy and RateLimit fields as structured-field lists and
// returns q, w, r and t of their one item.
func rateLimit(t *testing.T, h http.Header) (q, w, r, tt int64) {
	t.Helper()
	pol, err := httpsfv.UnmarshalList(h.Values("RateLimit-Policy"))
	if err != nil || len(pol) != 1 {
		t.Fatalf("RateLimit-Policy %q: %v", h.Values("RateLimit-Policy"), err)
	}
	lim, err := httpsfv.UnmarshalList(h.Values("RateLimit"))
	if err != nil || len(lim) != 1 {
		t.Fatalf("RateLimit %q: %v", h.Values("RateLimit"), err)
	}
	param := func(m httpsfv.Member, k string) int64 {
		v, ok := m.(httpsfv.Item).Params.Get(k)
		if !ok {
			t.Fatalf("parameter %s missing", k)
		}
		return v.(int64)
	}
	return param(pol[0], "q"), param(pol[0], "w"), param(lim[0], "r"), param(lim[0], "t")
}

var (
	sharedRedis *redistest.Server
	redisOnce   sync.Once
)

func standalone(t *testing.T) *store.RedisOptions {
	t.Helper()
	tier.Needs(t, "redis-server")
	redisOnce.Do(func() {
		var err error
		if sharedRedis, err = redistest.StartServer(); err != nil {
			t.Fatal(err)
		}
	})
	return &store.RedisOptions{Addrs: []string{sharedRedis.Addr()}, Timeout: 2 * time.Second}
}

// waitUntil polls cond, for at most 10s, instead of guessing how long something takes.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	poll.WaitFor(t, 10*time.Second, poll.True(what, cond))
}

func TestMain(m *testing.M) {
	code := m.Run()
	if sharedRedis != nil {
		sharedRedis.Stop()
	}
	os.Exit(code)
}

// stores are the stores to run a test on: memory, and Redis but in the fast tier.
func stores(t *testing.T) map[string]*store.RedisOptions {
	t.Helper()
	if tier.Fast() {
		return map[string]*store.RedisOptions{"memory": nil}
	}
	return map[string]*store.RedisOptions{"memory": nil, "redis": standalone(t)}
}

func TestProxyWhenManyConcurrentRequestsThenExactlyTheLimitPassesWithHeaders(t *testing.T) {
	for name, opts := range stores(t) {
		t.Run(name, func(t *testing.T) {
			up := newUpstream(t)
			e := start(t, policyDoc(name+"-exact", `    - name: per-key
      tokenBucket: {capacity: 20, refill: {tokens: 1, period: 720h}}
      key: [{type: Header, name: X-Api-Key}]
`), up, opts)
			var wg sync.WaitGroup
			var ok, limited atomic.Int64
			key := fmt.Sprint("k-", time.Now().UnixNano()) // a fresh bucket in the shared Redis
			for range 200 {
				wg.Go(func() {
					resp := get(t, e.proxy+"/orders", "X-Api-Key", key)
					switch resp.StatusCode {
					case http.StatusOK:
						ok.Add(1)
					case http.StatusTooManyRequests:
						limited.Add(1)
						if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 1 {
							t.Errorf("Retry-After %q on a 429", resp.Header.Get("Retry-After"))
						}
						if q, w, r, _ := rateLimit(t, resp.Header); q != 20 || r != 0 || w != 720*3600*20 {
							t.Errorf("429 headers q=%d w=%d r=%d", q, w, r)
						}
					}
				})
			}
			wg.Wait()
			if ok.Load() != 20 || limited.Load() != 180 || up.hits.Load() != 20 {
				t.Errorf("%d passed, %d limited, upstream saw %d; want 20, 180, 20", ok.Load(), limited.Load(), up.hits.Load())
			}
		})
	}
}

func TestProxyWhenRetryAfterHasPassedThenTheSameRequestPasses(t *testing.T) {
	for name, opts := range stores(t) {
		t.Run(name, func(t *testing.T) {
			clk := clocktesting.NewFakeClock(time.Now())
			e := start(t, policyDoc(name+"-retry", `    - name: slow
      slidingLog: {limit: 2, window: 1500ms}
`), newUpstream(t), opts, onClock(clk))
			get(t, e.proxy+"/")
			get(t, e.proxy+"/")
			resp := get(t, e.proxy+"/")
			if resp.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("third request: %d, want 429", resp.StatusCode)
			}
			ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
			if ra != 2 {
				t.Errorf("Retry-After %d, want 2 (1.5s rounded up)", ra)
			}
			clk.Step(time.Duration(ra) * time.Second)
			if resp := get(t, e.proxy+"/"); resp.StatusCode != http.StatusOK {
				t.Errorf("after Retry-After: %d, want 200", resp.StatusCode)
			}
		})
	}
}

// The leaky bucket holds requests so that the upstream sees an even flow: never closer than one
// drain interval, never more than capacity waiting; the rest are refused.
func TestProxyWhenLeakyBucketIsFloodedThenUpstreamSeesAnEvenFlow(t *testing.T) {
	up := newUpstream(t)
	// The twelve arrive at one instant of the enforcer's clock, however the machine spreads
	// them: none drains from the queue to make room for another.
	e := start(t, policyDoc("leaky", `    - name: queue
      leakyBucket: {capacity: 5, drain: {requests: 10, period: 1s}}
`), up, nil, onClock(clocktesting.NewFakeClock(time.Now())))
	var wg sync.WaitGroup
	var ok, limited atomic.Int64
	start := time.Now()
	for range 12 {
		wg.Go(func() {
			switch get(t, e.proxy+"/").StatusCode {
			case http.StatusOK:
				ok.Add(1)
			case http.StatusTooManyRequests:
				limited.Add(1)
			}
		})
	}
	wg.Wait()
	if ok.Load() != 5 || limited.Load() != 7 {
		t.Fatalf("%d passed, %d refused; want 5 (the queue) and 7", ok.Load(), limited.Load())
	}
	up.mu.Lock()
	defer up.mu.Unlock()
	slices.SortFunc(up.arrivals, func(a, b time.Time) int { return a.Compare(b) })
	// The queue drains one request per 100ms from the first decision on, so the k-th arrival
	// can come no earlier than k intervals after the flood began. Scheduling may only make it
	// later; a queue that released early would break this whatever the machine's load.
	for k, at := range up.arrivals {
		if early := time.Duration(k)*100*time.Millisecond - at.Sub(start); early > time.Millisecond {
			t.Errorf("arrival %d came %v after the flood began, %v before its drain slot", k, at.Sub(start), early)
		}
	}
}

// Each rule fails on its own: while Redis is down (killed, or frozen with SIGSTOP), fail-open
// rules pass and fail-closed rules refuse with 503, promptly once the breaker is open; when Redis
// returns, decisions go back to it within 5 seconds.
func TestProxyWhenRedisFailsThenEachRuleAppliesItsFailureMode(t *testing.T) {
	for _, how := range []string{"killed", "paused"} {
		t.Run(how, func(t *testing.T) {
			srv := redistest.NewServer(t)
			const deadline = 50 * time.Millisecond
			e := start(t, policyDoc("failure-"+how, `    - name: catalogue
      match: {path: {type: Prefix, value: /catalogue}}
      fixedWindow: {limit: 1000, window: 1h}
      failureMode: Open
    - name: payments
      match: {path: {type: Prefix, value: /payments}}
      fixedWindow: {limit: 1000, window: 1h}
      failureMode: Closed
`), newUpstream(t), &store.RedisOptions{Addrs: []string{srv.Addr()}, Timeout: deadline})
			if get(t, e.proxy+"/payments").StatusCode != http.StatusOK {
				t.Fatal("payments refused while Redis is up")
			}
			if how == "killed" {
				srv.Kill()
			} else {
				srv.Pause()
			}
			for range 5 { // trip the breaker
				get(t, e.proxy+"/catalogue")
			}
			// With the breaker open, decisions do not wait for Redis: only its one probe a second
			// reaches the store, whatever the machine's load makes of the latencies.
			errorsBefore, opened := metric(t, e.admin, `sluice_store_errors_total{cause="unavailable"}`), time.Now()
			for i := range 100 {
				path := "/catalogue"
				want := http.StatusOK
				if i%2 == 1 {
					path, want = "/payments", http.StatusServiceUnavailable
				}
				resp := get(t, e.proxy+path)
				if resp.StatusCode != want {
					t.Fatalf("%s with Redis %s: %d, want %d", path, how, resp.StatusCode, want)
				}
				if want == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") == "" {
					t.Fatal("503 without Retry-After")
				}
			}
			// Nothing piles up while Redis is down.
			goroutines := runtime.NumGoroutine()
			for range 300 {
				get(t, e.proxy+"/catalogue")
			}
			if grown := runtime.NumGoroutine() - goroutines; grown > 20 {
				t.Errorf("%d more goroutines after 300 requests with Redis %s", grown, how)
			}
			probes := metric(t, e.admin, `sluice_store_errors_total{cause="unavailable"}`) - errorsBefore
			if limit := 2 + time.Since(opened).Seconds(); probes > limit {
				t.Errorf("%v of 400 decisions went to the dead Redis (%s) in %v, want at most one probe a second (%.0f)", probes, how, time.Since(opened), limit)
			}
			if how == "killed" {
				if err := srv.Start(); err != nil { // an empty Redis: scripts must be loaded again
					t.Fatal(err)
				}
			} else {
				srv.Resume()
			}
			back := time.Now()
			poll.WaitFor(t, 5*time.Second, poll.True("decisions back on Redis", func() bool {
				return get(t, e.proxy+"/payments").StatusCode == http.StatusOK
			}))
			t.Logf("back on Redis after %v", time.Since(back))
		})
	}
}

// A spoofed X-Forwarded-For from a peer outside trustedProxies changes nothing; from a trusted
// proxy, the right-most untrusted hop is the client.
func TestProxyWhenXForwardedForIsSpoofedThenTheLimitHolds(t *testing.T) {
	rules := `    - name: per-address
      fixedWindow: {limit: 3, window: 1h}
      key: [{type: RemoteAddress}]
`
	up := newUpstream(t)
	untrusted := start(t, policyDoc("spoof", rules), up, nil)
	passed := 0
	for i := range 20 {
		if get(t, untrusted.proxy+"/", "X-Forwarded-For", fmt.Sprintf("198.51.100.%d", i)).StatusCode == http.StatusOK {
			passed++
		}
	}
	if passed != 3 {
		t.Errorf("untrusted peer with 20 spoofed addresses: %d passed, want 3", passed)
	}
	trusted := start(t, policyDoc("behind-proxy", rules, "  trustedProxies: [\"127.0.0.0/8\"]\n"), up, nil)
	passed = 0
	for i := range 20 {
		// The client forges the left hop; the trusted proxy appended the real address.
		xff := fmt.Sprintf("198.51.100.%d, 203.0.113.7", i)
		if get(t, trusted.proxy+"/", "X-Forwarded-For", xff).StatusCode == http.StatusOK {
			passed++
		}
	}
	if passed != 3 {
		t.Errorf("one real client behind a trusted proxy: %d passed, want 3", passed)
	}
	if resp := get(t, trusted.proxy+"/", "X-Forwarded-For", "203.0.113.8"); resp.StatusCode != http.StatusOK {
		t.Errorf("another client behind the proxy: %d, want 200", resp.StatusCode)
	}
}

// A request without the key's header is limited by its client address, not pooled with every
// other request that lacks the header.
func TestProxyWhenKeyHeaderIsMissingThenClientsAreKeyedByAddress(t *testing.T) {
	e := start(t, policyDoc("missing-key", `    - name: per-api-key
      fixedWindow: {limit: 1, window: 1h}
      key: [{type: Header, name: X-Api-Key}]
`, "  trustedProxies: [\"127.0.0.0/8\"]\n"), newUpstream(t), nil)
	statuses := []int{
		get(t, e.proxy+"/", "X-Forwarded-For", "203.0.113.1").StatusCode,
		get(t, e.proxy+"/", "X-Forwarded-For", "203.0.113.1").StatusCode,
		get(t, e.proxy+"/", "X-Forwarded-For", "203.0.113.2").StatusCode,
		get(t, e.proxy+"/", "X-Forwarded-For", "203.0.113.2", "X-Api-Key", "k").StatusCode,
	}
	if want := []int{200, 429, 200, 200}; !slices.Equal(statuses, want) {
		t.Errorf("statuses %v, want %v", statuses, want)
	}
}

func metric(t *testing.T, admin, name string) float64 {
	t.Helper()
	resp, err := client.Get(admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	total := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name) {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			total += v
		}
	}
	return total
}

func TestProxyWhenRuleIsShadowThenNothingIsRefusedButWouldLimitIsCounted(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("shadow", `    - name: trial
      mode: Shadow
      fixedWindow: {limit: 2, window: 1h}
`), up, nil)
	for range 10 {
		if s := get(t, e.proxy+"/").StatusCode; s != http.StatusOK {
			t.Fatalf("shadow rule refused: %d", s)
		}
	}
	if n := metric(t, e.admin, `sluice_decisions_total{namespace="test",policy="shadow",result="shadow_limited"`); n != 8 {
		t.Errorf("shadow_limited = %v, want 8", n)
	}
}

func TestCheckAPIWhenOriginalRequestIsDescribedThenItIsDecidedAndNothingForwarded(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("check", `    - name: writes
      match: {methods: [POST], path: {type: Exact, value: /orders}}
      fixedWindow: {limit: 2, window: 1h}
`, "  trustedProxies: [\"127.0.0.0/8\"]\n"), up, nil)
	nginx := []string{"X-Original-Method", "POST", "X-Original-URL", "https://shop.example/orders?id=1"}
	traefik := []string{"X-Forwarded-Method", "POST", "X-Forwarded-Uri", "/orders"}
	auth, forward := e.check+enforcer.AuthRequestPath, e.check+enforcer.ForwardAuthPath
	got := []int{get(t, auth, nginx...).StatusCode, get(t, forward, traefik...).StatusCode, get(t, auth, nginx...).StatusCode,
		get(t, forward, traefik...).StatusCode, get(t, auth, "X-Original-Method", "GET", "X-Original-URL", "/orders").StatusCode,
		get(t, auth).StatusCode, get(t, forward).StatusCode, get(t, e.check+"/", traefik...).StatusCode}
	if want := []int{200, 200, 403, 429, 200, 400, 400, 404}; !slices.Equal(got, want) {
		t.Errorf("statuses %v, want %v (two writes, a refusal at each endpoint, an unmatched read, two requests without the original, the root)", got, want)
	}
	if up.hits.Load() != 0 {
		t.Errorf("the check API forwarded %d requests", up.hits.Load())
	}
}

// Each endpoint reads the original request from the one source its caller sets, since both
// callers pass the client's own headers on: a client's X-Original-* cannot steer a Traefik
// decision, nor its X-Forwarded-* an nginx one; a repeated or unparseable original is 400.
func TestCheckAPIWhenTheClientSendsTheOtherCallersHeadersThenTheyAreIgnored(t *testing.T) {
	e := start(t, policyDoc("check-sources", `    - name: admin
      match: {path: {type: Prefix, value: /admin}}
      fixedWindow: {limit: 1, window: 1h}
`), nil, nil)
	forward, auth := e.check+enforcer.ForwardAuthPath, e.check+enforcer.AuthRequestPath
	// Traefik sets X-Forwarded-*; the client adds X-Original-* pointing elsewhere.
	spoofT := []string{"X-Forwarded-Method", "GET", "X-Forwarded-Uri", "/admin", "X-Original-Method", "GET", "X-Original-Url", "/public"}
	if got := []int{get(t, forward, spoofT...).StatusCode, get(t, forward, spoofT...).StatusCode}; !slices.Equal(got, []int{200, 429}) {
		t.Errorf("Traefik endpoint with the client's X-Original-*: %v, want [200 429]", got)
	}
	spoofN := []string{"X-Original-Method", "GET", "X-Original-Url", "http://h/admin", "X-Forwarded-Method", "GET", "X-Forwarded-Uri", "/public"}
	if s := get(t, auth, spoofN...).StatusCode; s != http.StatusForbidden {
		t.Errorf("nginx endpoint with the client's X-Forwarded-*: %d, want 403 (the /admin limit is spent)", s)
	}
	// nginx builds X-Original-URL from the client's Host: one whose port does not parse must not
	// make the URI unreadable and the decision one on no path.
	if s := get(t, auth, "X-Original-Method", "GET", "X-Original-Url", "http://shop.example:notaport/admin/x").StatusCode; s != http.StatusForbidden {
		t.Errorf("nginx endpoint, a Host with an unparseable port: %d, want 403 (the /admin limit is spent)", s)
	}
	for name, raw := range map[string]string{
		"repeated uri":        "X-Forwarded-Method: GET\r\nX-Forwarded-Uri: /public\r\nX-Forwarded-Uri: /admin\r\n",
		"not a path":          "X-Forwarded-Method: GET\r\nX-Forwarded-Uri: admin\r\n",
		"target over 8 KiB":   "X-Forwarded-Method: GET\r\nX-Forwarded-Uri: /" + strings.Repeat("a", enforcer.MaxTargetBytes) + "\r\n",
		"repeated method":     "X-Forwarded-Method: GET\r\nX-Forwarded-Method: POST\r\nX-Forwarded-Uri: /public\r\n",
		"nginx without a URI": "X-Original-Method: GET\r\n",
	} {
		path := enforcer.ForwardAuthPath
		if strings.HasPrefix(raw, "X-Original") {
			path = enforcer.AuthRequestPath
		}
		want := http.StatusBadRequest
		if name == "target over 8 KiB" {
			want = http.StatusRequestURITooLong
		}
		if got := rawStatus(t, e.CheckAddr, "GET "+path+" HTTP/1.1\r\nHost: check\r\n"+raw+"Connection: close\r\n\r\n"); got != want {
			t.Errorf("%s: %d, want %d", name, got, want)
		}
	}
	// At the edge: a target of exactly MaxTargetBytes is decided.
	edge := "/p" + strings.Repeat("a", enforcer.MaxTargetBytes-2)
	if s := get(t, forward, "X-Forwarded-Method", "GET", "X-Forwarded-Uri", edge).StatusCode; s != http.StatusOK {
		t.Errorf("a target of %d bytes: %d, want 200", len(edge), s)
	}
}

// A changed file takes effect within 2 seconds without dropping in-flight requests or resetting
// counters; an invalid file is refused and the last good policy stays.
func TestEnforcerWhenPolicyFileChangesThenReloadsWithoutLosingState(t *testing.T) {
	up := newUpstream(t)
	doc := func(limit int) string {
		return policyDoc("reload", fmt.Sprintf(`    - name: hourly
      fixedWindow: {limit: %d, window: 1h}
`, limit))
	}
	e := start(t, doc(3), up, nil)
	get(t, e.proxy+"/")
	get(t, e.proxy+"/")
	inflight := make(chan int)
	go func() { inflight <- get(t, e.proxy+"/slow").StatusCode }() // the third: admitted, in flight
	waitUntil(t, "the third request at the upstream", func() bool { return up.hits.Load() == 3 })
	if s := get(t, e.proxy+"/").StatusCode; s != http.StatusTooManyRequests {
		t.Fatalf("fourth request: %d, want 429", s)
	}
	if err := os.WriteFile(e.file, []byte(doc(5)), 0o600); err != nil {
		t.Fatal(err)
	}
	// Counters survive: 3 were counted, so the new limit of 5 admits exactly two more.
	poll.WaitFor(t, 2*time.Second, poll.True("the new limit enforced", func() bool {
		return get(t, e.proxy+"/").StatusCode == http.StatusOK
	}))
	if s := get(t, e.proxy+"/").StatusCode; s != http.StatusOK {
		t.Errorf("fifth request after reload: %d, want 200", s)
	}
	if s := get(t, e.proxy+"/").StatusCode; s != http.StatusTooManyRequests {
		t.Errorf("sixth request after reload: %d, want 429 (counters must not reset)", s)
	}
	up.release()
	if s := <-inflight; s != http.StatusOK {
		t.Errorf("in-flight request during reload: %d, want 200", s)
	}
	if err := os.WriteFile(e.file, []byte(strings.Replace(doc(50), "window: 1h", "window: 0s", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the invalid file refused", func() bool {
		return metric(t, e.admin, `sluice_config_reloads_total{result="refused"}`) == 1
	})
	if s := get(t, e.proxy+"/").StatusCode; s != http.StatusTooManyRequests {
		t.Errorf("after an invalid file: %d, want 429 from the last good policy", s)
	}
}

func TestEnforcerWhenStoppedThenInFlightRequestsDrain(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("drain", `    - name: any
      fixedWindow: {limit: 100, window: 1h}
`), up, nil)
	done := make(chan int)
	go func() { done <- get(t, e.proxy+"/slow").StatusCode }()
	waitUntil(t, "the request at the upstream", func() bool { return up.hits.Load() == 1 })
	e.stop()
	waitUntil(t, "the stop begun: /readyz fails", func() bool { return get(t, e.admin+"/readyz").StatusCode != http.StatusOK })
	up.release() // the upstream answers only now, while the enforcer stops
	if s := <-done; s != http.StatusOK {
		t.Errorf("in-flight request at shutdown: %d, want 200", s)
	}
	if _, err := net.DialTimeout("tcp", e.ProxyAddr, time.Second); err == nil {
		t.Error("the proxy still accepts connections after shutdown")
	}
}

// Under a flood far over the limit, the refusal cache answers locally: Redis runs at most 0.1
// scripts per request.
func TestProxyWhenFloodedThenRefusalCacheSparesRedis(t *testing.T) {
	opts := standalone(t)
	admin := redis.NewClient(&redis.Options{Addr: opts.Addrs[0]})
	defer func() { _ = admin.Close() }()
	e := start(t, policyDoc("flood", `    - name: per-key
      tokenBucket: {capacity: 10, refill: {tokens: 10, period: 1h}}
      key: [{type: Header, name: X-Api-Key}]
`), newUpstream(t), opts)
	get(t, e.proxy+"/", "X-Api-Key", "warm-up") // loads the script: NOSCRIPT and EVAL count as calls
	before := redistest.ScriptCalls(t, admin)
	key := fmt.Sprint("flood-", time.Now().UnixNano()) // a fresh bucket in the shared Redis
	passed := 0
	for range 100 { // 10x the limit
		if get(t, e.proxy+"/", "X-Api-Key", key).StatusCode == http.StatusOK {
			passed++
		}
	}
	ran := redistest.ScriptCalls(t, admin) - before
	if passed != 10 || float64(ran)/100 > 0.11 {
		t.Errorf("%d passed, Redis ran %d scripts for 100 requests; want 10 and at most 11", passed, ran)
	}
}

// 200,000 distinct client keys against the memory store: the key count stays at its bound and the
// heap does not grow with the flood.
func TestEnforcerWhenMemoryStoreSees200kClientsThenMemoryStaysBounded(t *testing.T) {
	tier.Needs(t, "time for 200,000 requests (a soak test)")
	e := start(t, policyDoc("many", `    - name: per-key
      tokenBucket: {capacity: 5, refill: {tokens: 1, period: 1h}}
      key: [{type: Header, name: X-Api-Key}]
`), nil, nil, func(c *enforcer.Config) { c.MemoryMaxKeys = 20_000; c.Listen = "" })
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	before := ms.HeapAlloc
	var wg sync.WaitGroup
	var next atomic.Int64
	for range 16 {
		wg.Go(func() {
			for i := next.Add(1); i <= 200_000; i = next.Add(1) {
				req, _ := http.NewRequest(http.MethodGet, e.check, nil)
				req.Header.Set("X-Original-Method", "GET")
				req.Header.Set("X-Original-URL", "/")
				req.Header.Set("X-Api-Key", strconv.FormatInt(i, 10))
				resp, err := client.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
			}
		})
	}
	wg.Wait()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	growth := int64(ms.HeapAlloc) - int64(before)
	t.Logf("heap growth after 200,000 keys: %d KiB", growth/1024)
	if growth > 32<<20 {
		t.Errorf("heap grew by %d MiB, want under 32 MiB for a 20,000-key bound", growth>>20)
	}
}

// WebSocket upgrades and cleartext HTTP/2 pass through the proxy.
func TestProxyWhenClientUpgradesOrSpeaksHTTP2ThenItWorks(t *testing.T) {
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "websocket" {
			_, _ = w.Write([]byte(r.Proto))
			return
		}
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer func() { _ = conn.Close() }()
		_, _ = rw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		_ = rw.Flush()
		line, _ := rw.ReadString('\n')
		_, _ = rw.WriteString("echo " + line)
		_ = rw.Flush()
	}))
	defer echo.Close()
	u := &upstream{Server: echo}
	e := start(t, policyDoc("upgrade", `    - name: any
      fixedWindow: {limit: 100, window: 1h}
`), u, nil)

	conn, err := net.Dial("tcp", e.ProxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_, _ = conn.Write([]byte("GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"))
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close() // a 101 has no body; the connection now carries the protocol
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %s", resp.Status)
	}
	_, _ = conn.Write([]byte("hello\n"))
	if line, _ := br.ReadString('\n'); line != "echo hello\n" {
		t.Errorf("through the upgraded connection: %q", line)
	}

	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	h2 := &http.Client{Transport: &http.Transport{Protocols: &protocols}}
	r2, err := h2.Get(e.proxy + "/")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r2.Body.Close() }()
	if r2.ProtoMajor != 2 || r2.StatusCode != http.StatusOK || r2.Header.Get("RateLimit") == "" {
		t.Errorf("h2c: proto %s status %d RateLimit %q", r2.Proto, r2.StatusCode, r2.Header.Get("RateLimit"))
	}
}

// Bodies stream both ways: the client reads the first chunk while the upstream is still writing,
// and the upstream learns who the client is from X-Forwarded-For.
func TestProxyWhenUpstreamStreamsThenChunksArriveAsWrittenWithForwardedHeaders(t *testing.T) {
	release := make(chan struct{})
	stream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Seen-Forwarded-For", r.Header.Get("X-Forwarded-For"))
		w.Header().Set("X-Seen-Forwarded-Proto", r.Header.Get("X-Forwarded-Proto"))
		_, _ = w.Write([]byte("first\n"))
		_ = http.NewResponseController(w).Flush()
		<-release
		_, _ = w.Write([]byte("second\n"))
	}))
	defer stream.Close()
	defer close(release)
	// The test client is the proxy in front, whose chain is kept (forwarded_test.go).
	e := start(t, policyDoc("stream", `    - name: any
      fixedWindow: {limit: 100, window: 1h}
`, "  trustedProxies: [\"127.0.0.0/8\"]\n"), &upstream{Server: stream}, nil)
	req, _ := http.NewRequest(http.MethodGet, e.proxy+"/", nil)
	req.Header.Set("X-Forwarded-For", "198.51.100.9")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || line != "first\n" {
		t.Fatalf("first chunk %q, %v: it must arrive before the upstream finishes", line, err)
	}
	if got := resp.Header.Get("X-Seen-Forwarded-For"); got != "198.51.100.9, 127.0.0.1" {
		t.Errorf("upstream saw X-Forwarded-For %q, want the chain plus the peer", got)
	}
	if got := resp.Header.Get("X-Seen-Forwarded-Proto"); got != "http" {
		t.Errorf("upstream saw X-Forwarded-Proto %q", got)
	}
}

// A client that leaves while its request waits in a leaky bucket is released at once, and the
// request is never forwarded.
func TestProxyWhenClientLeavesWhileQueuedThenReleasedAndNotForwarded(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("leave", `    - name: queue
      leakyBucket: {capacity: 5, drain: {requests: 1, period: 2s}}
`), up, nil)
	get(t, e.proxy+"/") // departs at once; the next waits 2s
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.proxy+"/", nil)
	if resp, err := client.Do(req); err == nil {
		_ = resp.Body.Close()
		t.Fatalf("queued request answered %d before its wait", resp.StatusCode)
	}
	assertNothingHeld(t, e) // the enforcer has stopped: nothing is forwarded from now on
	if up.hits.Load() != 1 {
		t.Errorf("upstream saw %d requests, want 1: the abandoned one must not be forwarded", up.hits.Load())
	}
}

func TestAdminWhenPprofIsOnThenProfilesAreServedAndOtherwiseNot(t *testing.T) {
	doc := policyDoc("pprof", `    - name: all
      fixedWindow: {limit: 10, window: 1s}
`)
	off := start(t, doc, nil, nil)
	if got := get(t, off.admin+"/debug/pprof/").StatusCode; got != http.StatusNotFound {
		t.Errorf("without --pprof: /debug/pprof/ answers %d, want 404", got)
	}
	on := start(t, doc, nil, nil, func(c *enforcer.Config) { c.Pprof = true })
	if got := get(t, on.admin+"/debug/pprof/").StatusCode; got != http.StatusOK {
		t.Errorf("with --pprof: /debug/pprof/ answers %d, want 200", got)
	}
	if got := get(t, on.check+"/debug/pprof/").StatusCode; got == http.StatusOK {
		t.Error("profiles are served on the check API; want them on the admin address only")
	}
}

// The check API answers a refusal with the proxy's headers and problem body, keys clients by the
// ingress's X-Forwarded-For when the ingress is trusted, refuses an oversized header or body, and
// drains a request that a leaky bucket holds when the enforcer stops.
func TestCheckAPIWhenRefusedThenItAnswersLikeTheProxy(t *testing.T) {
	e := start(t, policyDoc("check-answers", `    - name: per-client
      match: {path: {type: Prefix, value: /a}}
      tokenBucket: {capacity: 1, refill: {tokens: 1, period: 30s}}
      key: [{type: RemoteAddress}]
    - name: queue
      match: {path: {type: Prefix, value: /q}}
      leakyBucket: {capacity: 5, drain: {requests: 1, period: 1s}}
`, "  trustedProxies: [\"127.0.0.0/8\"]\n"), nil, nil)
	from := func(ip, path string) []string {
		return []string{"X-Forwarded-Method", "GET", "X-Forwarded-Uri", path, "X-Forwarded-For", ip}
	}
	check := e.check + enforcer.ForwardAuthPath
	for _, ip := range []string{"203.0.113.1", "203.0.113.2"} {
		if s := get(t, check, from(ip, "/a")...).StatusCode; s != http.StatusOK {
			t.Fatalf("first request of %s: %d, want 200 (each client has its own bucket)", ip, s)
		}
	}
	req, _ := http.NewRequest(http.MethodGet, check, nil)
	for h := from("203.0.113.1", "/a"); len(h) > 0; h = h[2:] {
		req.Header.Set(h[0], h[1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("second request: %d, want 429", resp.StatusCode)
	}
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 1 || ra > 30 {
		t.Errorf("Retry-After %q, want 1..30 seconds", resp.Header.Get("Retry-After"))
	}
	if q, w, r, tt := rateLimit(t, resp.Header); q != 1 || w != 30 || r != 0 || tt < 1 || tt > 30 {
		t.Errorf("q=%d w=%d r=%d t=%d, want q=1 w=30 r=0 t in 1..30", q, w, r, tt)
	}
	var p struct {
		Status int    `json:"status"`
		Rule   string `json:"rule"`
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/problem+json" || json.Unmarshal(body, &p) != nil || p.Status != 429 || p.Rule != "per-client" {
		t.Errorf("body %s (%s), want an application/problem+json naming rule per-client", body, ct)
	}

	// On a raw connection: Go's client returns the broken pipe of its unfinished write when the
	// check API closes after its 431, instead of the answer it has received.
	if s := rawGet(t, e.CheckAddr, enforcer.ForwardAuthPath, 70<<10, "X-Forwarded-Method: GET\r\nX-Forwarded-Uri: /a\r\nX-Forwarded-For: 203.0.113.3\r\n"); s != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("a 70 KiB header: %d, want 431", s)
	}

	// A body is read and ignored up to 64 KiB; a longer one is refused from its Content-Length,
	// before it is sent (a raw connection: a client still writing it would see a reset).
	for size, want := range map[int]int{64 << 10: http.StatusOK, 64<<10 + 1: http.StatusRequestEntityTooLarge} {
		conn, err := net.Dial("tcp", e.CheckAddr)
		if err != nil {
			t.Fatal(err)
		}
		body := ""
		if want == http.StatusOK {
			body = strings.Repeat("b", size)
		}
		_, _ = fmt.Fprintf(conn, "POST /forward-auth HTTP/1.1\r\nHost: check\r\nX-Forwarded-Method: POST\r\nX-Forwarded-Uri: /b\r\nContent-Length: %d\r\n\r\n%s", size, body)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("a %d-byte body: %v", size, err)
		}
		_ = resp.Body.Close()
		_ = conn.Close()
		if resp.StatusCode != want {
			t.Errorf("a %d-byte body: %d, want %d", size, resp.StatusCode, want)
		}
	}

	get(t, check, from("203.0.113.4", "/q")...) // departs at once; the next waits 1s
	held := make(chan int)
	go func() { held <- get(t, check, from("203.0.113.4", "/q")...).StatusCode }()
	waitUntil(t, "the second /q request decided, and so held", func() bool {
		return metric(t, e.admin, `sluice_decisions_total{namespace="test",policy="check-answers",result="allowed",rule="queue"}`) == 2
	})
	e.stop()
	if s := <-held; s != http.StatusOK {
		t.Errorf("request held at shutdown: %d, want 200 once its wait is over", s)
	}
}

// An enforcer stopped right after it started stops: no server is left accepting because its
// shutdown came before it began to serve.
func TestEnforcerWhenStoppedAtOnceThenEveryServerStops(t *testing.T) {
	doc := policyDoc("instant", `    - name: any
      fixedWindow: {limit: 1, window: 1h}
`)
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	for i := range 200 {
		ctx, cancel := context.WithCancel(context.Background())
		e, err := enforcer.Start(ctx, enforcer.Config{PolicyFile: file, Listen: "127.0.0.1:0", CheckListen: "127.0.0.1:0",
			AdminListen: "127.0.0.1:0", Enforcer: settings.Enforcer{ShutdownTimeout: time.Second}, Log: logr.Discard()})
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		cancel()
		done := make(chan error, 1)
		go func() { done <- e.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("start and stop %d: %v", i, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("start and stop %d: still running 10s after its context ended", i)
		}
	}
}
