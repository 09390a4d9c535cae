package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	grpcstatus "google.golang.org/grpc/status"

	"github.com/sluice-dev/sluice/internal/test/local"
)

// A hung upstream is cut at the response header timeout on both proxies: 504, counted, and the
// upstream sees its request end, so nothing the request held stays held.
func TestEnforcerBinaryWhenTheUpstreamHangsThen504AndTheRequestIsFreed(t *testing.T) {
	freed := make(chan string, 2)
	up := serveH1(t, http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		<-r.Context().Done() // hung until the proxy gives up on it
		freed <- r.URL.Path
	}))
	e := startFronting(t, "http://"+up, "--upstream-response-header-timeout=300ms")
	for _, via := range []string{"HTTP/1.1", "h2c"} {
		start := time.Now()
		resp, err := local.ClientFor(via, 20*time.Second).Get("http://" + e.proxy + "/hang")
		if err != nil {
			t.Fatalf("%s: %v", via, err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusGatewayTimeout || time.Since(start) > 10*time.Second {
			t.Errorf("%s: %d after %v, want 504 after the 300ms timeout", via, resp.StatusCode, time.Since(start))
		}
		select {
		case <-freed:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the upstream's request was never ended", via)
		}
	}
	if n := e.metric(t, `sluice_upstream_failures_total{reason="timeout"}`); n != 2 {
		t.Errorf("sluice_upstream_failures_total{reason=\"timeout\"} = %v, want 2", n)
	}
}

// The response header timeout bounds the wait for a response to begin, not its length: a
// stream whose next chunk comes after the timeout arrives whole, on both proxies.
func TestEnforcerBinaryWhenAStreamPausesPastTheHeaderTimeoutThenItIsNotCut(t *testing.T) {
	up := serveH1(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "first\n")
		_ = http.NewResponseController(w).Flush()
		time.Sleep(600 * time.Millisecond) // real time passes for a real timeout: twice the header timeout
		_, _ = io.WriteString(w, "second\n")
	}))
	e := startFronting(t, "http://"+up, "--upstream-response-header-timeout=300ms")
	for _, via := range []string{"HTTP/1.1", "h2c"} {
		resp, err := local.ClientFor(via, 20*time.Second).Get("http://" + e.proxy + "/stream")
		if err != nil {
			t.Fatalf("%s: %v", via, err)
		}
		body, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(body) != "first\nsecond\n" || err != nil {
			t.Errorf("%s: %d %q %v, want the whole stream", via, resp.StatusCode, body, err)
		}
	}
}

// Behind an upstream with gunicorn's 2 s keep-alive, the proxy closes its idle pooled
// connections first (at 1 s by default), so a request after a pause finds none the upstream is
// closing: 200, never 502.
func TestEnforcerBinaryWhenTheUpstreamKeepsAliveTwoSecondsThenARequestAfterAPauseIs200(t *testing.T) {
	var mu sync.Mutex
	idleAt := map[net.Conn]time.Time{}
	closed := make(chan time.Duration, 8)
	srv := &http.Server{
		Handler:     http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }),
		IdleTimeout: 2 * time.Second, ReadHeaderTimeout: 10 * time.Second,
		ConnState: func(c net.Conn, s http.ConnState) {
			mu.Lock()
			defer mu.Unlock()
			switch s {
			case http.StateIdle:
				idleAt[c] = time.Now()
			case http.StateClosed:
				if at, ok := idleAt[c]; ok {
					closed <- time.Since(at)
				}
			}
		},
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	e := startFronting(t, "http://"+ln.Addr().String())
	for _, via := range []string{"HTTP/1.1", "h2c"} {
		for i := range 2 {
			resp, err := local.ClientFor(via, 20*time.Second).Get("http://" + e.proxy + "/keepalive")
			if err != nil {
				t.Fatalf("%s request %d: %v", via, i, err)
			}
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%s request %d: %d, want 200", via, i, resp.StatusCode)
			}
			if i == 0 {
				// The pause: until the pooled connection is closed, by whichever side.
				select {
				case idle := <-closed:
					if idle >= 2*time.Second {
						t.Errorf("%s: the pooled connection idled %v, closed by the upstream; want the proxy to close it first", via, idle)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("%s: the pooled connection was never closed", via)
				}
			}
		}
	}
}

// An upstream that closes a kept-alive connection without saying so, as one whose keep-alive
// ends as the proxy reuses the connection does: the GET that finds it closed before any byte of
// its response is sent again on a new connection, once, and answered 200.
func TestEnforcerBinaryWhenAPooledConnectionWasClosedThenAnIdempotentRequestIsRetriedOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	gone := make(chan struct{}, 16)
	var mu sync.Mutex
	served := 0
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
					return
				}
				mu.Lock()
				served++
				mu.Unlock()
				// Keep-alive promised, then the connection closed after the response.
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
				_ = c.Close()
				gone <- struct{}{}
			}()
		}
	}()
	e := startFronting(t, "http://"+ln.Addr().String())
	for i := range 3 {
		resp, err := local.ClientFor("HTTP/1.1", 20*time.Second).Get("http://" + e.proxy + "/retry")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || strings.TrimSpace(string(body)) != "ok" {
			t.Fatalf("request %d after its pooled connection was closed: %d %q, want 200", i, resp.StatusCode, body)
		}
		<-gone // the connection is closed before the next request is sent
	}
	if n := e.metric(t, `sluice_upstream_failures_total{reason="error"}`); n != 0 {
		t.Errorf("%v upstream errors counted, want none", n)
	}
}

// serveH1 serves h over HTTP/1.1.
func serveH1(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// unacceptingAddr is an address where a dial never completes: a listener with a backlog of none
// whose accept queue is full, so the kernel drops every further SYN, as a host that is down or
// firewalled does. The queue is known to be full once a dial of the test's own times out.
func unacceptingAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
	for range 16 {
		c, err := net.DialTimeout("tcp", addr, 500*time.Millisecond)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return addr
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
	}
	t.Fatalf("the accept queue of %s never filled", addr)
	return ""
}

// silentAddr accepts connections and never says anything on them: a TLS handshake with it never
// ends.
func silentAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() })
		}
	}()
	return ln.Addr().String()
}

// An upstream that cannot be connected to within --upstream-connect-timeout, or whose TLS
// handshake does not end within it, is answered 504 on both proxies, and a gRPC call
// DEADLINE_EXCEEDED, each counted as a timeout.
func TestEnforcerBinaryWhenTheUpstreamCannotBeConnectedInTimeThen504AndGRPCDeadlineExceeded(t *testing.T) {
	const timeout = 300 * time.Millisecond
	connect := "--upstream-connect-timeout=" + timeout.String()
	httpGet := func(via string) func(t *testing.T, e *binaryEnforcer) {
		return func(t *testing.T, e *binaryEnforcer) {
			t.Helper()
			resp, err := local.ClientFor(via, 20*time.Second).Get("http://" + e.proxy + "/slow-to-connect")
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusGatewayTimeout || resp.Header.Get("RateLimit") == "" {
				t.Errorf("%d with RateLimit %q, want 504 with the decision's fields", resp.StatusCode, resp.Header.Get("RateLimit"))
			}
		}
	}
	grpcCall := func(t *testing.T, e *binaryEnforcer) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_, err := grpcClient(t, e.proxy).UnaryCall(ctx, &testpb.SimpleRequest{})
		if st := grpcstatus.Convert(err); st.Code() != codes.DeadlineExceeded || ctx.Err() != nil {
			t.Errorf("%v, want DEADLINE_EXCEEDED from the proxy, before the call's own deadline", err)
		}
	}
	cases := []struct {
		name     string
		upstream string
		call     func(t *testing.T, e *binaryEnforcer)
	}{
		{"when an HTTP/1.1 client's upstream does not accept then 504 (fasthttp)", "http://" + unacceptingAddr(t), httpGet("HTTP/1.1")},
		{"when an h2c client's upstream does not accept then 504 (net/http)", "http://" + unacceptingAddr(t), httpGet("h2c")},
		{"when a gRPC call's h2c upstream does not accept then DEADLINE_EXCEEDED", "h2c://" + unacceptingAddr(t), grpcCall},
		{"when a TLS upstream accepts but never finishes the handshake then 504", "https://" + silentAddr(t), httpGet("HTTP/1.1")},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := startFronting(t, c.upstream, connect)
			start := time.Now()
			c.call(t, e)
			if took := time.Since(start); took > 10*time.Second {
				t.Errorf("answered after %v, want about the %v connect timeout", took, timeout)
			}
			if n := e.metric(t, `sluice_upstream_failures_total{reason="timeout"}`); n != 1 {
				t.Errorf("sluice_upstream_failures_total{reason=\"timeout\"} = %v, want 1", n)
			}
		})
	}
}

// websocketLate answers a WebSocket upgrade with 101, then says nothing for pause, then sends
// "late" and echoes the line it reads.
func websocketLate(pause time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "websocket" {
			http.Error(w, "want a websocket upgrade", http.StatusBadRequest)
			return
		}
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer func() { _ = conn.Close() }()
		_, _ = rw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		_ = rw.Flush()
		time.Sleep(pause) // real time passes for a real timeout: the silence under test
		_, _ = rw.WriteString("late\n")
		_ = rw.Flush()
		line, _ := rw.ReadString('\n')
		_, _ = rw.WriteString("echo " + line)
		_ = rw.Flush()
	})
}

// upgraded sends the proxy at addr a WebSocket upgrade of /ws, and returns the connection and its
// reader once it has switched protocols (101), each read and write within 20 s.
func upgraded(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	_, _ = io.WriteString(conn, "GET /ws HTTP/1.1\r\nHost: api.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %s, want 101", resp.Status)
	}
	return conn, br
}

// An upgraded connection that has begun is not cut by the response-header timeout, however long
// it stays silent: on the fasthttp path (http://) and on the net/http one (an https upstream
// that speaks HTTP/1.1).
func TestEnforcerBinaryWhenAnUpgradedConnectionIsSilentPastTheHeaderTimeoutThenItIsNotCut(t *testing.T) {
	pki := newTestPKI(t)
	upstreams := map[string][]string{
		"http (fasthttp)":  {"http://" + serveH1(t, websocketLate(600*time.Millisecond))},
		"https (net/http)": {"https://" + serveTLS(t, pki, websocketLate(600*time.Millisecond), []string{"http/1.1"}, false), "--upstream-ca-file=" + pki.caFile},
	}
	for name, args := range upstreams {
		t.Run("when the upstream is "+name, func(t *testing.T) {
			e := startFronting(t, args[0], append(args[1:], "--upstream-response-header-timeout=300ms")...)
			conn, br := upgraded(t, e.proxy)
			if line, err := br.ReadString('\n'); line != "late\n" {
				t.Fatalf("after the silence: %q, %v; want \"late\"", line, err)
			}
			_, _ = io.WriteString(conn, "hello\n")
			if line, err := br.ReadString('\n'); line != "echo hello\n" {
				t.Errorf("through the upgraded connection: %q, %v", line, err)
			}
			if n := e.metric(t, `sluice_upstream_failures_total{reason="timeout"}`); n != 0 {
				t.Errorf("%v timeouts counted, want none", n)
			}
		})
	}
}

// An upstream that reads each request and closes the connection without an answer, as one that
// crashes on it does: the request may have been served, so only an idempotent one (by method, or
// by an Idempotency-Key) is sent again, at most once, and a POST never; each ends in 502, on both
// proxies. The requests carry no body: the fasthttp path sends none again that it streamed.
func TestEnforcerBinaryWhenTheUpstreamDropsARequestThenOnlyAnIdempotentOneIsSentAgainAtMostOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var mu sync.Mutex
	read := map[string]int{} // requests read, by path
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				mu.Lock()
				read[req.URL.Path]++
				mu.Unlock()
			}()
		}
	}()
	e := startFronting(t, "http://"+ln.Addr().String())
	cases := []struct {
		name, method, path, key string
		most                    int // times the upstream may read the request
	}{
		{"when a GET is dropped then it is sent again at most once", http.MethodGet, "/get", "", 2},
		{"when a POST with an Idempotency-Key is dropped then it is sent again at most once", http.MethodPost, "/keyed", "k1", 2},
		{"when a POST without a key is dropped then it is never sent again", http.MethodPost, "/post", "", 1},
	}
	for _, via := range []string{"HTTP/1.1", "h2c"} {
		for _, c := range cases {
			t.Run(c.name+" ("+via+")", func(t *testing.T) {
				path := c.path + "-" + strings.ToLower(strings.ReplaceAll(via, "/", ""))
				var status int
				if via == "HTTP/1.1" {
					// Raw, to send a POST without Content-Length: one the fasthttp path reads
					// as no body at all, so that only the method and the key decide.
					req := c.method + " " + path + " HTTP/1.1\r\nHost: api.test\r\n"
					if c.key != "" {
						req += "Idempotency-Key: " + c.key + "\r\n"
					}
					if status, err = local.RawStatus(e.proxy, req+"\r\n"); err != nil {
						t.Fatal(err)
					}
				} else {
					req, _ := http.NewRequest(c.method, "http://"+e.proxy+path, nil)
					if c.key != "" {
						req.Header.Set("Idempotency-Key", c.key)
					}
					resp, err := local.ClientFor(via, 20*time.Second).Do(req)
					if err != nil {
						t.Fatal(err)
					}
					_ = resp.Body.Close()
					status = resp.StatusCode
				}
				mu.Lock()
				n := read[path]
				mu.Unlock()
				if status != http.StatusBadGateway || n < 1 || n > c.most {
					t.Errorf("%d after the upstream read it %d times; want 502 after 1 to %d", status, n, c.most)
				}
			})
		}
	}
}
