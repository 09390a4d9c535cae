package enforcer_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"golang.org/x/net/http2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// A panic in any request path is answered 500 (gRPC INTERNAL), counted, and the server serves the
// next request: one request cannot stop the enforcer.
func TestEnforcerWhenARequestPanicsThenItIs500AndEveryServerServesOn(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("panics", `    - name: any
      fixedWindow: {limit: 1000, window: 1h}
`), up, nil, withRLS)
	c, _ := rlsClient(t, e)
	forward := []string{"X-Forwarded-Method", "GET", "X-Forwarded-Uri", "/"}
	for _, server := range []string{"proxy", "check", "admin", "rls"} {
		undo := enforcer.InjectPanic(server)
		switch server {
		case "proxy":
			if s := get(t, e.proxy+"/").StatusCode; s != http.StatusInternalServerError {
				t.Errorf("proxy over HTTP/1.1: %d, want 500", s)
			}
			if s := h2cStatus(t, e.ProxyAddr, "/"); s != http.StatusInternalServerError {
				t.Errorf("proxy over h2c: %d, want 500", s)
			}
		case "check":
			if s := get(t, e.check+enforcer.ForwardAuthPath, forward...).StatusCode; s != http.StatusInternalServerError {
				t.Errorf("check API: %d, want 500", s)
			}
		case "admin":
			if s := get(t, e.admin+"/readyz").StatusCode; s != http.StatusInternalServerError {
				t.Errorf("admin: %d, want 500", s)
			}
		case "rls":
			_, err := c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "test/panics", Descriptors: nil})
			if status.Code(err) != codes.Internal {
				t.Errorf("RLS: %v, want INTERNAL", err)
			}
		}
		undo()
	}
	if s := get(t, e.proxy+"/").StatusCode; s != http.StatusOK {
		t.Errorf("proxy after the panics: %d", s)
	}
	if s := get(t, e.check+enforcer.ForwardAuthPath, forward...).StatusCode; s != http.StatusOK {
		t.Errorf("check API after the panics: %d", s)
	}
	if _, err := c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "test/panics"}); err != nil {
		t.Errorf("RLS after the panics: %v", err)
	}
	for server, want := range map[string]float64{"proxy": 2, "check": 1, "admin": 1, "rls": 1} {
		if n := metric(t, e.admin, fmt.Sprintf(`sluice_panics_total{server=%q}`, server)); n != want {
			t.Errorf("sluice_panics_total{server=%q} = %v, want %v", server, n, want)
		}
	}
}

// A repeated key header is refused with 400 by every front end and charges nothing: the upstream
// reads one of the values, so the join of them must not be a fresh identity.
func TestProxyWhenAKeyHeaderIsRepeatedThen400AndNothingIsCharged(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("repeat", `    - name: per-key
      key: [{type: Header, name: X-Api-Key}]
      fixedWindow: {limit: 1, window: 1h}
`), up, nil, withRLS)
	twice := "GET / HTTP/1.1\r\nHost: x\r\nX-Api-Key: alice\r\nX-Api-Key: new-%d\r\nConnection: close\r\n\r\n"
	if s := rawStatus(t, e.ProxyAddr, fmt.Sprintf(twice, 1)); s != http.StatusBadRequest {
		t.Errorf("proxy: %d, want 400", s)
	}
	if s := h2cStatus(t, e.ProxyAddr, "/", "x-api-key", "alice", "x-api-key", "new-2"); s != http.StatusBadRequest {
		t.Errorf("proxy over h2c: %d, want 400", s)
	}
	chk := "GET /forward-auth HTTP/1.1\r\nHost: c\r\nX-Forwarded-Method: GET\r\nX-Forwarded-Uri: /\r\nX-Api-Key: alice\r\nX-Api-Key: new\r\nConnection: close\r\n\r\n"
	if s := rawStatus(t, e.CheckAddr, chk); s != http.StatusBadRequest {
		t.Errorf("check API: %d, want 400", s)
	}
	c, _ := rlsClient(t, e)
	if _, err := enforcer.RefusedMalformed(c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "test/repeat",
		Descriptors: []*rlv3.RateLimitDescriptor{descriptor("x-api-key", "alice", "x-api-key", "new")}})); err != nil {
		t.Errorf("RLS: %v", err)
	}
	// alice's one request is still hers: nothing above was charged.
	for i, want := range []int{200, 429} {
		if s := get(t, e.proxy+"/", "X-Api-Key", "alice").StatusCode; s != want {
			t.Errorf("alice's request %d: %d, want %d", i, s, want)
		}
	}
	if up.hits.Load() != 1 {
		t.Errorf("the upstream saw %d requests, want 1", up.hits.Load())
	}
}

// Connections over the bounds are answered as they are accepted (429 for one address's bound, 503
// for the total of the traffic listeners) and closed, while other clients are served; a client that stops
// reading its response is cut once its writes make no progress for the write timeout.
func TestEnforcerWhenConnectionsPassTheirBoundsThenTheExtraOnesAreRefused(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("conns", `    - name: any
      fixedWindow: {limit: 100000, window: 1h}
`), up, nil, func(c *enforcer.Config) { c.MaxConnsPerClient, c.MaxConns = 3, 5 })
	dial := func(local string) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
		c, err := d.Dial("tcp", e.ProxyAddr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	served := func(c net.Conn) int {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		return readStatus(c)
	}
	for i := range 3 {
		if s := served(dial("127.0.0.1")); s != http.StatusOK {
			t.Fatalf("connection %d of 127.0.0.1: %d", i, s)
		}
	}
	if s := served(dial("127.0.0.1")); s != http.StatusTooManyRequests {
		t.Errorf("the fourth connection of 127.0.0.1: %d, want 429", s)
	}
	for i := range 2 {
		if s := served(dial("127.0.0.2")); s != http.StatusOK {
			t.Errorf("connection %d of 127.0.0.2 while 127.0.0.1 is at its bound: %d, want 200", i, s)
		}
	}
	if s := served(dial("127.0.0.3")); s != http.StatusServiceUnavailable {
		t.Errorf("the sixth connection in all: %d, want 503", s)
	}
	// The bound is the traffic listeners' together: the check API is full too, while the admin
	// port, with bounds of its own, still answers (metric below reads it).
	c, err := net.Dial("tcp", e.CheckAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_, _ = io.WriteString(c, "GET /forward-auth HTTP/1.1\r\nHost: x\r\nX-Forwarded-Method: GET\r\nX-Forwarded-Uri: /\r\n\r\n")
	if s := readStatus(c); s != http.StatusServiceUnavailable {
		t.Errorf("a check API connection while the proxy holds the total: %d, want 503", s)
	}
	if n := metric(t, e.admin, `sluice_connections_refused_total{reason="client",server="proxy"}`); n != 1 {
		t.Errorf("refused for the client bound: %v, want 1", n)
	}
}

func TestProxyWhenAClientStopsReadingThenItsConnectionIsCutAfterTheWriteTimeout(t *testing.T) {
	chunk := []byte(strings.Repeat("x", 64<<10))
	big := &upstream{Server: httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		for range 4096 { // 256 MiB, far past every socket buffer
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}))}
	t.Cleanup(big.Close)
	e := start(t, policyDoc("slow-reader", `    - name: any
      fixedWindow: {limit: 100000, window: 1h}
`), big, nil, func(c *enforcer.Config) { c.WriteTimeout = time.Second })
	for _, proto := range []string{"HTTP/1.1", "h2c"} {
		c, err := net.Dial("tcp", e.ProxyAddr)
		if err != nil {
			t.Fatal(err)
		}
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetReadBuffer(4 << 10)
		}
		if proto == "h2c" {
			_ = c.Close()
			h := dialH2C(t, e.ProxyAddr)
			h.send("/big")
		} else {
			defer func() { _ = c.Close() }()
			_, _ = io.WriteString(c, "GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
		}
		// Read nothing.
		waitUntil(t, proto+": the proxy cuts the connection of the client that does not read", func() bool {
			return metric(t, e.admin, `sluice_connections_open{server="proxy"}`) == 0
		})
	}
}

// readStatus reads one response from a connection: its status, or -1.
func readStatus(c net.Conn) int {
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return -1
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// A call whose hits make a cost no limit can hold is OVER_LIMIT without a Retry-After, which
// would promise a time at which it passes; one at the limit passes.
func TestRLSWhenHitsExceedTheLimitThenOverLimitWithoutRetryAfter(t *testing.T) {
	e := start(t, policyDoc("never", `    - name: per-user
      key: [{type: Header, name: X-User}]
      slidingLog: {limit: 5, window: 1h}
`), nil, nil, withRLS)
	c, _ := rlsClient(t, e)
	for hits, want := range map[uint64]rlsv3.RateLimitResponse_Code{6: rlsv3.RateLimitResponse_OVER_LIMIT, 1 << 40: rlsv3.RateLimitResponse_OVER_LIMIT,
		1 << 63: rlsv3.RateLimitResponse_OVER_LIMIT, math.MaxUint64: rlsv3.RateLimitResponse_OVER_LIMIT} {
		d := descriptor("x-user", fmt.Sprint("u", hits))
		d.HitsAddend = wrapperspb.UInt64(hits)
		r := shouldRateLimit(t, c, "test/never", d)
		if r.GetOverallCode() != want || header(r, "Retry-After") != "" || header(r, "RateLimit") == "" {
			t.Errorf("hits %d: %v, Retry-After %q, RateLimit %q; want OVER_LIMIT with the fields and no Retry-After", hits, r.GetOverallCode(), header(r, "Retry-After"), header(r, "RateLimit"))
		}
	}
	d := descriptor("x-user", "at-the-limit")
	d.HitsAddend = wrapperspb.UInt64(5)
	if r := shouldRateLimit(t, c, "test/never", d); r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Errorf("hits at the limit: %v, want OK", r.GetOverallCode())
	}
}

// One call decides at most limiter.MaxChecks rules: descriptors that match more are refused
// before anything is charged, so no call is an unbounded store script.
func TestRLSWhenDescriptorsMatchMoreRulesThanTheBoundThenRefused(t *testing.T) {
	var rules strings.Builder
	for i := range 32 {
		fmt.Fprintf(&rules, "    - name: r%d\n      key: [{type: Header, name: X-User}]\n      fixedWindow: {limit: 100, window: 1h}\n", i)
	}
	e := start(t, policyDoc("many", rules.String()), nil, nil, withRLS)
	c, _ := rlsClient(t, e)
	call := func(n int) (*rlsv3.RateLimitResponse, error) {
		ds := make([]*rlv3.RateLimitDescriptor, n)
		for i := range ds {
			ds[i] = descriptor("x-user", fmt.Sprint("u", i))
		}
		return c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "test/many", Descriptors: ds})
	}
	if r, err := call(2); err != nil || r.GetOverallCode() != rlsv3.RateLimitResponse_OK { // 64 rules: at the bound
		t.Errorf("2 descriptors of 32 rules each: %v, %v, want OK", r.GetOverallCode(), err)
	}
	if detail, err := enforcer.RefusedMalformed(call(3)); err != nil || !strings.Contains(detail, "64 rules") {
		t.Errorf("3 descriptors of 32 rules each: %q, %v; want the bound named", detail, err)
	}
}

// A request that matches more than limiter.MaxChecks rules, over all the policies of a file, is
// 400 on the proxy and the check API and charges nothing; one at the bound is decided.
func TestProxyWhenARequestMatchesMoreRulesThanTheBoundThen400AndNothingIsCharged(t *testing.T) {
	rules := func(n int, path string) string {
		var b strings.Builder
		for i := range n {
			fmt.Fprintf(&b, "    - name: r%d\n      match: {path: {value: %s}}\n      fixedWindow: {limit: 100, window: 1h}\n", i, path)
		}
		return b.String()
	}
	// 64 rules match every path, one more only /over.
	file := policyDoc("a", rules(32, "/")) + "---\n" + policyDoc("b", rules(32, "/")) + "---\n" + policyDoc("c", rules(1, "/over"))
	up := newUpstream(t)
	e := start(t, file, up, nil)
	remaining := func(r reply) string {
		_, after, _ := strings.Cut(r.Header.Get("RateLimit"), ";r=")
		before, _, _ := strings.Cut(after, ";")
		return before
	}
	if r := get(t, e.proxy+"/ok"); r.StatusCode != http.StatusOK || remaining(r) != "99" {
		t.Fatalf("64 rules: %d, RateLimit %q; want 200 with 99 remaining", r.StatusCode, r.Header.Get("RateLimit"))
	}
	for _, u := range []string{e.proxy + "/over", e.check + enforcer.ForwardAuthPath} {
		var header []string
		if strings.HasPrefix(u, e.check) {
			header = []string{"X-Forwarded-Method", "GET", "X-Forwarded-Uri", "/over"}
		}
		if r := get(t, u, header...); r.StatusCode != http.StatusBadRequest {
			t.Errorf("65 rules through %s: %d, want 400", u, r.StatusCode)
		}
	}
	if r := get(t, e.proxy+"/ok"); r.StatusCode != http.StatusOK || remaining(r) != "98" {
		t.Errorf("after the refusals: %d, RateLimit %q; want 98 remaining, nothing charged by them", r.StatusCode, r.Header.Get("RateLimit"))
	}
	if n := up.hits.Load(); n != 2 {
		t.Errorf("the upstream saw %d requests, want the 2 decided ones", n)
	}
}

// Descriptors that repeat each other in one call are charged each: 32 copies of one client's
// request against a limit of 3 are refused, not charged once; a request's method, path or
// address given twice is refused.
func TestRLSWhenADescriptorIsRepeatedThenEachCopyIsCharged(t *testing.T) {
	e := start(t, policyDoc("dups", `    - name: per-key
      key: [{type: Header, name: X-Api-Key}]
      fixedWindow: {limit: 3, window: 1h}
`), nil, nil, withRLS)
	c, _ := rlsClient(t, e)
	copies := func(key string, n int) []*rlv3.RateLimitDescriptor {
		ds := make([]*rlv3.RateLimitDescriptor, n)
		for i := range ds {
			ds[i] = descriptor("x-api-key", key)
		}
		return ds
	}
	if r := shouldRateLimit(t, c, "test/dups", copies("a", 32)...); r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Errorf("32 copies against a limit of 3: %v, want OVER_LIMIT", r.GetOverallCode())
	}
	if r := shouldRateLimit(t, c, "test/dups", copies("b", 3)...); r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Errorf("3 copies against a limit of 3: %v, want OK", r.GetOverallCode())
	}
	if r := shouldRateLimit(t, c, "test/dups", copies("b", 1)...); r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Errorf("a fourth request after 3 copies: %v, want OVER_LIMIT (the copies were charged 3)", r.GetOverallCode())
	}
	_, err := c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "test/dups",
		Descriptors: []*rlv3.RateLimitDescriptor{descriptor("path", "/a", "path", "/b", "x-api-key", "c")}})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("a descriptor with two paths: %v, want INVALID_ARGUMENT", err)
	}
}

// An idempotency key makes a repeat free only of the request it was first sent with: sent with
// another route under the same client key it is charged. A key the client names in Connection
// never reaches the upstream, so it is no key to the decision either.
func TestProxyWhenAnIdempotencyKeyIsReusedElsewhereThenItIsCharged(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("idem-routes", `    - name: admin
      match: {path: {type: Prefix, value: /admin}}
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 1, window: 1h}
    - name: login
      match: {path: {type: Prefix, value: /login}}
      key: [{type: RemoteAddress}]
      fixedWindow: {limit: 5, window: 1h}
`, "  retries:\n    idempotencyKey: {maxRepeats: 3}\n"), up, nil)
	if s := get(t, e.proxy+"/admin", "Idempotency-Key", "a").StatusCode; s != http.StatusOK {
		t.Fatalf("the one /admin request: %d", s)
	}
	if s := get(t, e.proxy+"/login", "Idempotency-Key", "k").StatusCode; s != http.StatusOK {
		t.Fatalf("a login with a key: %d", s)
	}
	if s := get(t, e.proxy+"/admin", "Idempotency-Key", "k").StatusCode; s != http.StatusTooManyRequests {
		t.Errorf("/admin with the login's key: %d, want 429", s)
	}
	if s := get(t, e.proxy+"/login", "Idempotency-Key", "k").StatusCode; s != http.StatusOK {
		t.Errorf("the login's own repeat: %d, want 200", s)
	}
	if s := get(t, e.proxy+"/admin", "Idempotency-Key", "a").StatusCode; s != http.StatusOK {
		t.Errorf("the /admin request's own repeat: %d, want 200", s)
	}
	hidden := "GET /admin HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\r\nConnection: Idempotency-Key, close\r\n\r\n"
	if s := rawStatus(t, e.ProxyAddr, hidden); s != http.StatusTooManyRequests {
		t.Errorf("a key named in Connection: %d, want 429 (no key reaches the upstream, so none is decided)", s)
	}
}

// A client that leaves while its request is decided (an h2c stream reset while Redis has not
// answered) or held in a leaky bucket's queue (h2c, and HTTP/1.1 by a closed connection) is
// counted apart: the decision completes and is charged as usual, and neither the store errors
// nor the breaker see it. Redis is stopped while the reset arrives, so the decision is in flight
// whatever the machine's speed; a PING answered after the reset says the server has read it.
func TestEnforcerWhenClientsLeaveWhileDecidedOrHeldThenTheyAreCountedApart(t *testing.T) {
	srv := redistest.NewServer(t)
	e := start(t, policyDoc("left", `    - name: queue
      match: {path: {type: Prefix, value: /queue}}
      leakyBucket: {capacity: 5, drain: {requests: 1, period: 1h}}
    - name: any
      match: {path: {type: Prefix, value: /any}}
      fixedWindow: {limit: 1000, window: 1h}
`), newUpstream(t), &store.RedisOptions{Addrs: []string{srv.Addr()}, Timeout: 10 * time.Second})
	left := func() float64 { return metric(t, e.admin, "sluice_decisions_cancelled_total") }

	srv.Pause()
	c := dialH2C(t, e.ProxyAddr)
	id := c.send("/any")
	_ = c.fr.WriteRSTStream(id, http2.ErrCodeCancel)
	_ = c.fr.WritePing(false, [8]byte{'l', 'e', 'f', 't'})
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			srv.Resume()
			t.Fatal(err)
		}
		if p, ok := f.(*http2.PingFrame); ok && p.IsAck() {
			break
		}
	}
	srv.Resume()
	waitUntil(t, "the reset during the decision is counted", func() bool { return left() == 1 })
	if n := metric(t, e.admin, `sluice_decisions_total{namespace="test",policy="left",result="allowed",rule="any"}`); n != 1 {
		t.Errorf("the decision of the reset request: %v allowed, want 1: decided and charged", n)
	}

	c = dialH2C(t, e.ProxyAddr)
	if s := c.status(c.send("/queue")); s != http.StatusOK {
		t.Fatalf("the first queued request: %d", s)
	}
	_ = c.fr.WriteRSTStream(c.send("/queue"), http2.ErrCodeCancel) // held for an hour
	waitUntil(t, "the reset of a held h2c request is counted", func() bool { return left() == 2 })

	conn, err := net.Dial("tcp", e.ProxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(conn, "GET /queue HTTP/1.1\r\nHost: x\r\n\r\n") // held for two hours
	_ = conn.Close()
	waitUntil(t, "the close of a held HTTP/1.1 request is counted", func() bool { return left() == 3 })

	if n := metric(t, e.admin, `sluice_store_errors_total{cause="unavailable"}`); n != 0 {
		t.Errorf("%v store errors for clients that left", n)
	}
	if metric(t, e.admin, "sluice_store_breaker_open") != 0 {
		t.Error("the breaker opened")
	}
}
