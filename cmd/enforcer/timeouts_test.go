package main

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

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
		// Real time passes for a real timeout: twice the header timeout, the pause under test.
		time.Sleep(600 * time.Millisecond)
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
