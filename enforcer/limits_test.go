package enforcer_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"golang.org/x/net/http2"

	"github.com/sluice-dev/sluice/enforcer"
)

// rawGet sends a GET whose request line and header block, up to and including the blank line,
// is exactly size bytes, and returns the status.
func rawGet(t *testing.T, addr, path string, size int, extra string) int {
	t.Helper()
	head := "GET " + path + " HTTP/1.1\r\nHost: enforcer\r\n" + extra + "Connection: close\r\nX-Padding: "
	pad := size - len(head) - len("\r\n\r\n")
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintf(conn, "%s%s\r\n\r\n", head, strings.Repeat("x", pad)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("a %d-byte header block: %v", size, err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// A header block of up to 64 KiB is served, and one byte more is refused with 431 before it is
// decided, on every listener.
func TestEnforcerWhenTheHeaderBlockIsOver64KiBThenEveryListenerAnswers431(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("limits", `    - name: any
      fixedWindow: {limit: 1000, window: 1h}
`), up, nil)
	listeners := []struct {
		name, addr, path, extra string
	}{
		{"proxy", e.ProxyAddr, "/limits", ""},
		{"check API", e.CheckAddr, "/forward-auth", "X-Forwarded-Method: GET\r\nX-Forwarded-Uri: /limits\r\n"},
		{"admin", e.AdminAddr, "/limits", ""},
	}
	for _, l := range listeners {
		if s := rawGet(t, l.addr, l.path, 64<<10, l.extra); s == http.StatusRequestHeaderFieldsTooLarge || s >= 500 {
			t.Errorf("%s: a 64 KiB header block got %d", l.name, s)
		}
		if s := rawGet(t, l.addr, l.path, 64<<10+1, l.extra); s != http.StatusRequestHeaderFieldsTooLarge {
			t.Errorf("%s: a header block of 64 KiB and one byte got %d, want 431", l.name, s)
		}
	}
	if n := metric(t, e.admin, `sluice_decisions_total{namespace="test",policy="limits",result="allowed",rule="any"}`); n != 2 {
		t.Errorf("%v requests decided, want the 2 of 64 KiB to the proxy and check API", n)
	}
}

// A request target's path and query of 8 KiB is decided and one byte more is 414 by every front
// end, whatever form carries it: origin or absolute form, HTTP/1.1 or h2c, either check endpoint
// (nginx's absolute URI adds the client's Host, which is not counted), or an RLS path entry.
func TestEnforcerWhenATargetIsOneBytePast8KiBThenEveryFrontEndAnswers414(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("targets", `    - name: any
      fixedWindow: {limit: 1000, window: 1h}
`), up, nil, withRLS)
	c, _ := rlsClient(t, e)
	edge := "/p?" + strings.Repeat("q", enforcer.MaxTargetBytes-3)
	for _, tc := range []struct {
		target string
		want   int
	}{{edge, http.StatusOK}, {edge + "q", http.StatusRequestURITooLong}} {
		n := len(tc.target)
		if s := rawStatus(t, e.ProxyAddr, "GET "+tc.target+" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); s != tc.want {
			t.Errorf("proxy, a target of %d bytes: %d, want %d", n, s, tc.want)
		}
		if s := rawStatus(t, e.ProxyAddr, "GET http://shop.example:8080"+tc.target+" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); s != tc.want {
			t.Errorf("proxy, an absolute URI with a path and query of %d bytes: %d, want %d", n, s, tc.want)
		}
		if s := h2cStatus(t, e.ProxyAddr, tc.target); s != tc.want {
			t.Errorf("proxy over h2c, a :path of %d bytes: %d, want %d", n, s, tc.want)
		}
		if s := get(t, e.check+enforcer.AuthRequestPath, "X-Original-Method", "GET", "X-Original-Url", "http://shop.example:8080"+tc.target).StatusCode; s != tc.want {
			t.Errorf("check API for nginx, a path and query of %d bytes: %d, want %d", n, s, tc.want)
		}
		if s := get(t, e.check+enforcer.ForwardAuthPath, "X-Forwarded-Method", "GET", "X-Forwarded-Uri", tc.target).StatusCode; s != tc.want {
			t.Errorf("check API for Traefik, a target of %d bytes: %d, want %d", n, s, tc.want)
		}
		r, err := c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "test/targets", Descriptors: []*rlv3.RateLimitDescriptor{descriptor("path", tc.target)}})
		if tc.want == http.StatusOK && (err != nil || r.GetOverallCode() != rlsv3.RateLimitResponse_OK) {
			t.Errorf("RLS, a path entry of %d bytes: %v, %v; want OK", n, r.GetOverallCode(), err)
		}
		if _, err := enforcer.RefusedMalformed(r, err); tc.want != http.StatusOK && err != nil {
			t.Errorf("RLS, a path entry of %d bytes: %v", n, err)
		}
	}
	if n := up.hits.Load(); n != 3 {
		t.Errorf("the upstream saw %d requests, want the 3 of 8 KiB through the proxy", n)
	}
}

// The admin port's own budget: 64 connections from one address and 256 in all are served, and
// one more is refused as it is accepted (429, 503), as the traffic listeners' are.
func TestAdminWhenItsConnectionsPassTheirBoundsThenTheExtraOnesAreRefused(t *testing.T) {
	e := start(t, policyDoc("admin-conns", anyRule), nil, nil)
	healthz := func(local string) int {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
		c, err := d.Dial("tcp", e.AdminAddr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
		return readStatus(c) // the connection stays open: it counts
	}
	for i := range 64 {
		if s := healthz("127.0.0.1"); s != http.StatusOK {
			t.Fatalf("admin connection %d of 127.0.0.1: %d", i, s)
		}
	}
	if s := healthz("127.0.0.1"); s != http.StatusTooManyRequests {
		t.Errorf("the 65th admin connection of 127.0.0.1: %d, want 429", s)
	}
	for _, local := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"} {
		for i := range 64 {
			if s := healthz(local); s != http.StatusOK {
				t.Fatalf("admin connection %d of %s: %d", i, local, s)
			}
		}
	}
	if s := healthz("127.0.0.5"); s != http.StatusServiceUnavailable {
		t.Errorf("the 257th admin connection: %d, want 503", s)
	}
	if s := get(t, e.check+enforcer.ForwardAuthPath, "X-Forwarded-Method", "GET", "X-Forwarded-Uri", "/").StatusCode; s != http.StatusOK {
		t.Errorf("the check API while the admin port is full: %d, want 200: the budgets are apart", s)
	}
}

// A connection that carries no request for the idle timeout is closed by every listener, and not
// before: HTTP/1.1 after its last response, HTTP/2 and gRPC (no stream) with a GOAWAY.
func TestEnforcerWhenAConnectionIdlesPastTheIdleTimeoutThenEveryListenerClosesIt(t *testing.T) {
	const idle = 700 * time.Millisecond
	e := start(t, policyDoc("idle", anyRule), newUpstream(t), nil, withRLS, func(c *enforcer.Config) { c.IdleTimeout = idle })
	closedAfter := func(name string, c net.Conn, first string, h2 bool) {
		t.Helper()
		defer func() { _ = c.Close() }()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		var began time.Time
		if h2 {
			_, _ = io.WriteString(c, http2.ClientPreface)
			began = time.Now()
			fr := http2.NewFramer(c, c)
			_ = fr.WriteSettings()
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					break
				}
				if s, ok := f.(*http2.SettingsFrame); ok && !s.IsAck() {
					_ = fr.WriteSettingsAck()
				}
				if _, ok := f.(*http2.GoAwayFrame); ok {
					break
				}
			}
		} else {
			_, _ = io.WriteString(c, first)
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			began = time.Now()
			if n, err := br.ReadByte(); err == nil {
				t.Fatalf("%s: read %q after the response, want the connection closed", name, n)
			}
		}
		if d := time.Since(began); d < idle-50*time.Millisecond || d > idle+3*time.Second {
			t.Errorf("%s: closed %v after it fell idle, want after %v", name, d.Round(time.Millisecond), idle)
		}
	}
	dial := func(addr string) net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	closedAfter("proxy", dial(e.ProxyAddr), "GET / HTTP/1.1\r\nHost: x\r\n\r\n", false)
	closedAfter("proxy over h2c", dial(e.ProxyAddr), "", true)
	closedAfter("check API", dial(e.CheckAddr), "GET /forward-auth HTTP/1.1\r\nHost: x\r\nX-Forwarded-Method: GET\r\nX-Forwarded-Uri: /\r\n\r\n", false)
	closedAfter("admin", dial(e.AdminAddr), "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", false)
	closedAfter("rate limit service", dial(e.RLSAddr), "", true)
}

// An h2c connection holds at most 100 streams at once: the 101st, sent while the first 100 wait
// on the upstream, is reset as it arrives (a client that honours SETTINGS waits instead), and
// the first 100 are answered once the upstream answers.
func TestProxyWhenAnH2CClientOpensMoreStreamsThanTheBoundThenTheExtraOneIsReset(t *testing.T) {
	release := make(chan struct{})
	var arrived atomic.Int64
	up := &upstream{Server: httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		arrived.Add(1)
		<-release
	}))}
	t.Cleanup(up.Close)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	e := start(t, policyDoc("streams", anyRule), up, nil)
	c := dialH2C(t, e.ProxyAddr)
	for range 101 {
		c.send("/held")
	}
	const extra = 2*100 + 1 // the 101st stream's ID
	answered := 0
	for answered < 100 {
		f, err := c.fr.ReadFrame()
		if err != nil {
			t.Fatalf("%d streams answered, then %v", answered, err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = c.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				_ = c.fr.WritePing(true, f.Data)
			}
		case *http2.RSTStreamFrame:
			if f.StreamID != extra {
				t.Fatalf("stream %d reset (%v), want only the 101st, %d", f.StreamID, f.ErrCode, extra)
			}
			if arrived.Load() > 100 {
				t.Errorf("the upstream saw %d requests, want at most the first 100", arrived.Load())
			}
			close(release) // the extra stream is refused: let the first 100 be answered
		case *http2.MetaHeadersFrame:
			if f.StreamID == extra {
				t.Fatalf("the 101st stream was answered %s while 100 were open", f.PseudoValue("status"))
			}
			if s := f.PseudoValue("status"); s != "200" {
				t.Errorf("stream %d: %s, want 200", f.StreamID, s)
			}
			answered++
		}
	}
}

// An upstream's response header block of MaxHeaderBytes passes through both proxies, a body
// behind it, and one byte more is 502 (fasthttp's default had made 4 KiB and one byte a 502:
// an upstream's large cookies). The HTTP/1.1 client reaches the fasthttp path, the h2c client
// net/http's, and /held, under a concurrency rule, the fasthttp path's connection of its own.
// An HTTP/1.1 connection that carried a header block over 8 KiB is closed after it, as after a
// large request header: idle, it would keep the buffers that held it.
func TestProxyWhenAnUpstreamHeaderBlockIsAtTheBoundThenItPassesAndPastItIs502(t *testing.T) {
	body := strings.Repeat("b", 16<<10)
	up := &upstream{Server: httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var size int
		if _, err := fmt.Sscanf(r.URL.Query().Get("size"), "%d", &size); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		// Written raw, so that the header block, status line to blank line, is exactly size.
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		defer func() { _ = conn.Close() }()
		head := fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\nSet-Cookie: ", len(body))
		_, _ = fmt.Fprintf(rw, "%s%s\r\n\r\n%s", head, strings.Repeat("c", size-len(head)-len("\r\n\r\n")), body)
		_ = rw.Flush()
	}))}
	t.Cleanup(up.Close)
	e := start(t, policyDoc("headers", `    - name: any
      fixedWindow: {limit: 1000, window: 1h}
    - name: held
      match: {path: {type: Prefix, value: /held}}
      concurrency: {limit: 4}
`), up, nil)
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	for _, c := range []struct {
		name   string
		client *http.Client
	}{
		{"HTTP/1.1", &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}},
		{"h2c", &http.Client{Transport: &http.Transport{Protocols: &protocols}, Timeout: 10 * time.Second}},
	} {
		for _, path := range []string{"/headers", "/held"} {
			for size, want := range map[int]int{1 << 10: http.StatusOK, 8<<10 + 1: http.StatusOK, enforcer.MaxHeaderBytes: http.StatusOK, enforcer.MaxHeaderBytes + 1: http.StatusBadGateway} {
				resp, err := c.client.Get(fmt.Sprintf("%s%s?size=%d", e.proxy, path, size))
				if err != nil {
					t.Fatalf("%s %s, a header block of %d bytes: %v", c.name, path, size, err)
				}
				got, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != want || want == http.StatusOK && (string(got) != body || len(resp.Header.Get("Set-Cookie")) < size-200) {
					t.Errorf("%s %s, a header block of %d bytes: %d with a body of %d bytes and a cookie of %d, want %d",
						c.name, path, size, resp.StatusCode, len(got), len(resp.Header.Get("Set-Cookie")), want)
				}
				if closed := size > 8<<10; c.name == "HTTP/1.1" && want == http.StatusOK && resp.Close != closed {
					t.Errorf("%s %s, a header block of %d bytes: connection closed after it %v, want %v", c.name, path, size, resp.Close, closed)
				}
			}
		}
	}
}
