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
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
)

// The two proxy paths a client may take: HTTP/1.1 (fasthttp, in front of an http:// upstream)
// and cleartext HTTP/2 (net/http).
var proxyClients = map[string]func() *http.Client{
	"http1": func() *http.Client { return &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second} },
	"h2c": func() *http.Client {
		var protocols http.Protocols
		protocols.SetUnencryptedHTTP2(true)
		return &http.Client{Transport: &http.Transport{Protocols: &protocols}, Timeout: 10 * time.Second}
	},
}

const slotPolicy = `    - name: slots
      match: {path: {value: /stream}}
      concurrency: {limit: 1, leaseTimeout: 30s}
`

// streamer is an upstream whose /stream responses write a first line, then, while tick is set,
// a line every 20ms, until release closes; it counts the responses in flight.
type streamer struct {
	*httptest.Server
	release  chan struct{}
	tick     atomic.Bool
	inFlight atomic.Int64
}

func newStreamer(t *testing.T) *streamer {
	t.Helper()
	s := &streamer{release: make(chan struct{})}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.inFlight.Add(1)
		defer s.inFlight.Add(-1)
		_, _ = io.WriteString(w, "first\n")
		_ = http.NewResponseController(w).Flush()
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-s.release:
				_, _ = io.WriteString(w, "last\n")
				return
			case <-r.Context().Done():
				return
			case <-t.C:
				if s.tick.Load() {
					if _, err := io.WriteString(w, "tick\n"); err != nil {
						return
					}
					_ = http.NewResponseController(w).Flush()
				}
			}
		}
	}))
	t.Cleanup(s.Close)
	t.Cleanup(func() {
		select {
		case <-s.release:
		default:
			close(s.release)
		}
	})
	return s
}

// A streamed response holds the only slot of a concurrency rule until its last byte, on both
// proxy paths: meanwhile another request is refused with 429, Retry-After: 1 (no time is
// promised), the concurrency-limited problem and RateLimit fields in concurrent requests with
// no reset; once the stream ends, the next request passes.
func TestProxyWhenAStreamedResponseHoldsTheOnlySlotThenItIsFreedAtItsLastByte(t *testing.T) {
	for name, newClient := range proxyClients {
		t.Run(name, func(t *testing.T) {
			up := newStreamer(t)
			e := start(t, policyDoc("slots", slotPolicy), &upstream{Server: up.Server}, nil)
			c := newClient()
			resp, err := c.Get(e.proxy + "/stream")
			if err != nil {
				t.Fatal(err)
			}
			body := bufio.NewReader(resp.Body)
			if line, err := body.ReadString('\n'); line != "first\n" {
				t.Fatalf("first line %q, %v", line, err)
			}
			refused, err := c.Get(e.proxy + "/stream")
			if err != nil {
				t.Fatal(err)
			}
			var problem struct{ Type, Rule string }
			_ = json.NewDecoder(refused.Body).Decode(&problem)
			_ = refused.Body.Close()
			if refused.StatusCode != http.StatusTooManyRequests || refused.Header.Get("Retry-After") != "1" ||
				problem.Type != "https://sluice.dev/problems/concurrency-limited" || problem.Rule != "slots" {
				t.Fatalf("while the stream runs: %d Retry-After %q %+v, want 429, 1, concurrency-limited", refused.StatusCode, refused.Header.Get("Retry-After"), problem)
			}
			pol, _ := httpsfv.UnmarshalList(refused.Header.Values("RateLimit-Policy"))
			lim, _ := httpsfv.UnmarshalList(refused.Header.Values("RateLimit"))
			if len(pol) != 1 || len(lim) != 1 {
				t.Fatalf("fields %q and %q", refused.Header.Values("RateLimit-Policy"), refused.Header.Values("RateLimit"))
			}
			if q, _ := pol[0].(httpsfv.Item).Params.Get("q"); q != int64(1) {
				t.Errorf("q = %v", q)
			}
			if qu, _ := pol[0].(httpsfv.Item).Params.Get("qu"); qu != "concurrent-requests" {
				t.Errorf("qu = %v, want concurrent-requests", qu)
			}
			if r, _ := lim[0].(httpsfv.Item).Params.Get("r"); r != int64(0) {
				t.Errorf("r = %v, want 0", r)
			}
			if _, ok := lim[0].(httpsfv.Item).Params.Get("t"); ok {
				t.Errorf("RateLimit %q names a reset: none is known", refused.Header.Values("RateLimit"))
			}
			close(up.release)
			if rest, err := io.ReadAll(body); err != nil || string(rest) != "last\n" {
				t.Fatalf("the rest %q, %v", rest, err)
			}
			_ = resp.Body.Close()
			// The slot is released in the background once the last byte is written: the next
			// request passes as soon as it has been.
			waitUntil(t, "the slot freed after the last byte", func() bool {
				r, err := c.Get(e.proxy + "/stream")
				if err != nil {
					return false
				}
				_, _ = io.Copy(io.Discard, r.Body)
				_ = r.Body.Close()
				return r.StatusCode == http.StatusOK
			})
		})
	}
}

// A client that leaves in the middle of a streamed response frees its slot: on HTTP/1.1 once
// the next write to it fails (the stream ticks), on h2c at once (its stream reset cancels the
// upstream request).
func TestProxyWhenAClientLeavesAStreamedResponseThenItsSlotIsFreed(t *testing.T) {
	for name, newClient := range proxyClients {
		t.Run(name, func(t *testing.T) {
			up := newStreamer(t)
			up.tick.Store(true)
			e := start(t, policyDoc("slots", slotPolicy), &upstream{Server: up.Server}, nil)
			ctx, cancel := context.WithCancel(context.Background())
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.proxy+"/stream", nil)
			c := newClient()
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			if line, _ := bufio.NewReader(resp.Body).ReadString('\n'); line != "first\n" {
				t.Fatalf("first line %q", line)
			}
			if r := get(t, e.proxy+"/stream"); r.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("while the stream runs: %d, want 429", r.StatusCode)
			}
			cancel() // the client leaves
			_ = resp.Body.Close()
			c.CloseIdleConnections()
			waitUntil(t, "the slot freed after the client left", func() bool {
				r, err := newClient().Get(e.proxy + "/stream?again")
				if err != nil {
					return false
				}
				_ = r.Body.Close() // a stream of its own, which this test does not read
				return r.StatusCode == http.StatusOK
			})
		})
	}
}

// An upgraded connection (WebSocket) holds its slot until it ends.
func TestProxyWhenAnUpgradedConnectionHoldsTheOnlySlotThenItIsFreedWhenItEnds(t *testing.T) {
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "websocket" {
			return
		}
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer func() { _ = conn.Close() }()
		_, _ = rw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		_ = rw.Flush()
		for {
			line, err := rw.ReadString('\n')
			if err != nil {
				return
			}
			_, _ = rw.WriteString("echo " + line)
			_ = rw.Flush()
		}
	}))
	defer echo.Close()
	e := start(t, policyDoc("ws", `    - name: slots
      concurrency: {limit: 1}
`), &upstream{Server: echo}, nil)
	conn, err := net.Dial("tcp", e.ProxyAddr)
	if err != nil {
		t.Fatal(err)
	}
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
		t.Fatalf("through the upgraded connection: %q", line)
	}
	if r := get(t, e.proxy+"/other"); r.StatusCode != http.StatusTooManyRequests {
		t.Errorf("while the upgraded connection lasts: %d, want 429", r.StatusCode)
	}
	_ = conn.Close()
	waitUntil(t, "the slot freed when the upgraded connection ended", func() bool {
		return get(t, e.proxy+"/other").StatusCode == http.StatusOK
	})
}

const chargePolicy = `    - name: failures
      match: {path: {value: /login}}
      fixedWindow: {limit: 3, window: 1h}
      charge: {when: Response, statuses: ["401", "403"]}
    - name: tokens
      match: {path: {value: /chat}}
      fixedWindow: {limit: 1000, window: 1h}
      charge: {when: Response}
      costFrom: {responseHeader: X-Tokens-Used, max: 400}
`

// charger is an upstream that answers /login with the status its query asks for, and /chat
// with the cost its query names, in a header (?header=V, repeated for several values) or, after
// a streamed body, in a trailer (?trailer=V).
func charger(t *testing.T) *httptest.Server {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		if r.URL.Path == "/login" {
			var status int
			_, _ = fmt.Sscan(q.Get("status"), &status)
			w.WriteHeader(status)
			return
		}
		for _, v := range q["header"] {
			w.Header().Add("X-Tokens-Used", v)
		}
		if v := q.Get("trailer"); v != "" {
			w.Header().Set("Trailer", "X-Tokens-Used")
			_, _ = io.WriteString(w, "streamed")
			_ = http.NewResponseController(w).Flush()
			w.Header().Set("X-Tokens-Used", v)
			return
		}
		_, _ = io.WriteString(w, "answer")
	}))
	t.Cleanup(s.Close)
	return s
}

// Rules charged by the response on both proxy paths: logins are charged only for 401 and 403,
// so 20 successes and two failures leave room, and the third failure exhausts the rule; a
// token budget is charged what each response reports in a header or a trailer, a value over
// max is charged max, and one that is not a whole number, repeated or missing the rule's cost;
// every charge is counted by its result.
func TestProxyWhenResponsesAreChargedThenTheirStatusesAndCostsCount(t *testing.T) {
	for name, newClient := range proxyClients {
		t.Run(name, func(t *testing.T) {
			e := start(t, policyDoc("charges", chargePolicy), &upstream{Server: charger(t)}, nil)
			c := newClient()
			send := func(path string) (int, http.Header) {
				t.Helper()
				resp, err := c.Get(e.proxy + path)
				if err != nil {
					t.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				return resp.StatusCode, resp.Header
			}
			charged := func(rule string, want float64) {
				t.Helper()
				waitUntil(t, fmt.Sprintf("%s charged %v times", rule, want), func() bool {
					n := 0.0
					for _, result := range []string{"charged", "clamped", "default_cost"} {
						n += metric(t, e.admin, `sluice_response_charges_total{namespace="test",policy="charges",result="`+result+`",rule="`+rule+`"}`)
					}
					return n == want
				})
			}
			for i := range 20 {
				if status, _ := send("/login?status=200"); status != http.StatusOK {
					t.Fatalf("success %d: %d", i, status)
				}
			}
			for i, status := range []int{401, 403} {
				if got, _ := send(fmt.Sprintf("/login?status=%d", status)); got != status {
					t.Fatalf("failure %d: %d", i, got)
				}
				charged("failures", float64(i+1))
			}
			if got, _ := send("/login?status=401"); got != http.StatusUnauthorized {
				t.Fatalf("the third failure: %d, want it forwarded", got)
			}
			charged("failures", 3)
			if got, h := send("/login?status=200"); got != http.StatusTooManyRequests || h.Get("Retry-After") == "" {
				t.Errorf("after three failures: %d (Retry-After %q), want 429", got, h.Get("Retry-After"))
			}

			// 1000: 300 (header) + 400 (trailer 401, clamped to max) + 1 (not a number)
			// + 1 (repeated) + 1 (missing) = 703, 297 left; then 297 (a 300-digit number,
			// clamped to max: what is left) exhausts it.
			for _, path := range []string{"/chat?header=300", "/chat?trailer=401", "/chat?header=-5", "/chat?header=1&header=2", "/chat"} {
				if status, _ := send(path); status != http.StatusOK {
					t.Fatalf("%s: %d", path, status)
				}
			}
			charged("tokens", 5)
			if _, h := send("/chat?header=0"); !strings.Contains(h.Get("RateLimit"), "r=297") {
				t.Errorf("RateLimit %q, want r=297 left of 1000", h.Get("RateLimit"))
			}
			if status, _ := send("/chat?header=" + strings.Repeat("9", 300)); status != http.StatusOK {
				t.Fatalf("a huge cost: %d, want it forwarded", status)
			}
			charged("tokens", 7)
			if status, _ := send("/chat?header=0"); status != http.StatusTooManyRequests {
				t.Errorf("after a huge cost: %d, want 429: it charged what was left", status)
			}
			for result, want := range map[string]float64{"charged": 2, "clamped": 2, "default_cost": 3} {
				if got := metric(t, e.admin, `sluice_response_charges_total{namespace="test",policy="charges",result="`+result+`",rule="tokens"}`); got != want {
					t.Errorf("tokens %s: %v, want %v", result, got, want)
				}
			}
		})
	}
}

// The check API cannot see a response: it skips concurrency rules and rules charged by the
// response, never refuses for them, and counts them skipped.
func TestCheckAPIWhenRulesNeedTheResponseThenTheyAreSkippedAndCounted(t *testing.T) {
	e := start(t, policyDoc("skips", slotPolicy+chargePolicy), nil, nil)
	for _, path := range []string{"/stream", "/login", "/chat"} {
		for range 5 {
			req, _ := http.NewRequest(http.MethodGet, e.check+"/forward-auth", nil)
			req.Header.Set("X-Forwarded-Method", "GET")
			req.Header.Set("X-Forwarded-Uri", path)
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: %d, want 200", path, resp.StatusCode)
			}
		}
	}
	for _, rule := range []string{"slots", "failures", "tokens"} {
		if got := metric(t, e.admin, `sluice_decisions_total{namespace="test",policy="skips",result="skipped",rule="`+rule+`"}`); got != 5 {
			t.Errorf("%s skipped %v times, want 5", rule, got)
		}
	}
}

// A client that leaves while the upstream has not yet begun its response frees its slot at
// once on both proxy paths, and the upstream request ends with it: HTTP/1.1 requests that hold
// a slot go to the upstream on a connection of their own, which the proxy closes as the client
// leaves; h2c cancels the upstream request.
func TestProxyWhenAClientLeavesBeforeTheResponseBeginsThenItsSlotAndUpstreamRequestEnd(t *testing.T) {
	for name, newClient := range proxyClients {
		t.Run(name, func(t *testing.T) {
			var inFlight atomic.Int64
			arrived := make(chan struct{}, 1)
			up := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/stream" {
					return
				}
				inFlight.Add(1)
				defer inFlight.Add(-1)
				arrived <- struct{}{}
				<-r.Context().Done() // answers nothing until its request ends
			}))
			defer up.Close()
			e := start(t, policyDoc("slots", slotPolicy), &upstream{Server: up}, nil)
			ctx, cancel := context.WithCancel(context.Background())
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.proxy+"/stream", nil)
			left := make(chan struct{})
			go func() {
				defer close(left)
				if resp, err := newClient().Do(req); err == nil {
					_ = resp.Body.Close()
				}
			}()
			<-arrived
			if r := get(t, e.proxy+"/stream"); r.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("while the request waits: %d, want 429", r.StatusCode)
			}
			cancel()
			<-left
			waitUntil(t, "the upstream request ended", func() bool { return inFlight.Load() == 0 })
			waitUntil(t, "the slot freed", func() bool {
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				defer cancel()
				r, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.proxy+"/stream", nil)
				resp, err := newClient().Do(r)
				if err != nil {
					return true // admitted: the upstream holds it, and the timeout ends it
				}
				_ = resp.Body.Close()
				return resp.StatusCode != http.StatusTooManyRequests
			})
		})
	}
}

// Envoy's rate limit service cannot see a response either: over RLS, concurrency rules and
// rules charged by the response are skipped and counted, and never refuse.
func TestRLSWhenRulesNeedTheResponseThenTheyAreSkippedAndCounted(t *testing.T) {
	e := start(t, policyDoc("skips", slotPolicy+chargePolicy), nil, nil, withRLS)
	c, _ := rlsClient(t, e)
	for range 5 {
		resp := shouldRateLimit(t, c, "test/skips", descriptor("path", "/stream"), descriptor("path", "/login"), descriptor("path", "/chat"))
		if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
			t.Fatalf("%v, want OK", resp.GetOverallCode())
		}
	}
	for _, rule := range []string{"slots", "failures", "tokens"} {
		if got := metric(t, e.admin, `sluice_decisions_total{namespace="test",policy="skips",result="skipped",rule="`+rule+`"}`); got != 5 {
			t.Errorf("%s skipped %v times, want 5", rule, got)
		}
	}
}

// A request that holds a slot goes upstream on a connection of its own, closed after it; the
// client's connection is kept alive all the same.
func TestProxyWhenRequestsHoldSlotsThenTheClientsConnectionIsKeptAlive(t *testing.T) {
	up := newStreamer(t)
	e := start(t, policyDoc("slots", slotPolicy), &upstream{Server: up.Server}, nil)
	conn, err := net.Dial("tcp", e.ProxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	br := bufio.NewReader(conn)
	close(up.release)
	// Three requests admitted on the one connection; one sent before the previous slot's
	// release has landed is refused, on the same connection, and sent again.
	for admitted, sent := 0, 0; admitted < 3; sent++ {
		if sent == 100 {
			t.Fatalf("%d of 100 requests admitted", admitted)
		}
		_, _ = io.WriteString(conn, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("request %d on one connection: %v", sent+1, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.Close {
			t.Fatalf("request %d (%d) closes the connection: it must be kept alive", sent+1, resp.StatusCode)
		}
		if resp.StatusCode == http.StatusOK {
			admitted++
		}
	}
}
