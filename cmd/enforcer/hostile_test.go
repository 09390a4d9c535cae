package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// Hostile clients against the real binary: each of these once stopped or starved the process,
// which a test inside the test process could not show.

const hostilePolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: hostile, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: closed
      match: {path: {type: Prefix, value: /closed}}
      fixedWindow: {limit: 1000000, window: 1h}
      failureMode: Closed
    - name: log
      match: {path: {type: Prefix, value: /log}}
      key: [{type: Header, name: X-Client}]
      slidingLog: {limit: 5, window: 1h}
    - name: any
      fixedWindow: {limit: 1000000, window: 1h}
`

// hostile is an enforcer binary with every port open.
type hostile struct {
	p                        *local.Process
	proxy, check, rls, admin string
	log                      *local.Output
}

func startHostile(t *testing.T, flags ...string) *hostile {
	t.Helper()
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(hostilePolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }))
	t.Cleanup(up.Close)
	h := &hostile{log: &local.Output{}}
	for _, a := range []*string{&h.proxy, &h.check, &h.rls, &h.admin} {
		*a, _ = local.FreeAddr()
	}
	p, err := local.Start("enforcer", h.log, binary(t), append([]string{"--policy=" + file, "--upstream=" + up.URL,
		"--listen=" + h.proxy, "--check-listen=" + h.check, "--rls-listen=" + h.rls, "--admin-listen=" + h.admin, "--shutdown-delay=0s"}, flags...)...)
	if err != nil {
		t.Fatal(err)
	}
	h.p = p
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("enforcer log:\n%s", h.log.String())
		}
	})
	if err := local.WaitHTTP(p, "http://"+h.admin+"/readyz", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	return h
}

// alive fails the test if the process has exited, and checks that it still serves.
func (h *hostile) alive(t *testing.T) {
	t.Helper()
	if h.p.Exited() {
		t.Fatalf("the enforcer exited:\n%s", h.log.String())
	}
	resp, err := http.Get("http://" + h.proxy + "/after")
	if err != nil {
		t.Fatalf("the enforcer no longer serves: %v", err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("a plain request after the attack: %d", resp.StatusCode)
	}
}

func (h *hostile) metric(t *testing.T, series string) float64 {
	t.Helper()
	return adminMetric(t, h.admin, series)
}

// adminMetric reads one series from an enforcer's admin address (0 when absent).
func adminMetric(t *testing.T, admin, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			v, _ := strconv.ParseFloat(rest, 64)
			return v
		}
	}
	return 0
}

func raw(t *testing.T, addr, request string) int {
	t.Helper()
	status, err := local.RawStatus(addr, request)
	if err != nil {
		return -1
	}
	return status
}

// A Host of 300 bytes once panicked the proxy (a 256-byte buffer sliced past its end), and every
// replica behind a load balancer died in turn. Hosts of every length up to the header limit pass.
func TestEnforcerBinaryWhenTheHostIsLongThenTheRequestPassesAndTheProcessLives(t *testing.T) {
	h := startHostile(t)
	for _, n := range []int{255, 256, 257, 300, 4096, 60 << 10} {
		host := strings.Repeat("h", n)
		if s := raw(t, h.proxy, "GET / HTTP/1.1\r\nHost: "+host+"\r\nX-Forwarded-For: 192.0.2.1\r\nConnection: close\r\n\r\n"); s != http.StatusOK {
			t.Errorf("Host of %d bytes: %d, want 200", n, s)
		}
	}
	// Connections that send nothing, or half a request, then leave.
	for _, addr := range []string{h.proxy, h.check, h.admin} {
		for _, sent := range []string{"", "GET / HT", "PRI * HTTP/2.0\r\n"} {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.WriteString(c, sent)
			_ = c.(*net.TCPConn).CloseWrite()
			_ = c.Close()
		}
	}
	h.alive(t)
}

// The check API once routed on fasthttp's decoded, normalized path: an encoded slash, an empty
// segment or a dot segment named a policy that the path as sent does not name, and was decided
// against it. Only the literal path of a policy is; every other spelling is a 404.
func TestEnforcerBinaryWhenACheckPathNamesAPolicyOnlyOnceDecodedThenItIsNotFound(t *testing.T) {
	h := startHostile(t)
	ask := func(path string) int {
		return raw(t, h.check, "GET "+path+" HTTP/1.1\r\nHost: check\r\nX-Forwarded-Method: GET\r\nX-Forwarded-Uri: /x\r\n"+
			"X-Forwarded-For: 192.0.2.1\r\nConnection: close\r\n\r\n")
	}
	if s := ask("/policies/test/hostile/forward-auth"); s != http.StatusOK {
		t.Fatalf("the policy's own path: %d, want 200", s)
	}
	for _, path := range []string{
		"/policies/test%2Fhostile/forward-auth",
		"/policies/test/hostile%2Fforward-auth",
		"/policies/test/hostile%2F/forward-auth",
		"/policies/%74est/hostile/forward-auth",
		"/policies/test//hostile/forward-auth",
		"/policies//test/hostile/forward-auth",
		"/policies/test/hostile//forward-auth",
		"//policies/test/hostile/forward-auth",
		"/policies/test/x/../hostile/forward-auth",
		"/policies/../policies/test/hostile/forward-auth",
		"/policies/%2e%2e/policies/test/hostile/forward-auth",
		"/policies/test/hostile/x/%2e%2e/forward-auth",
		"/policies/test/hostile/forward-auth/../forward-auth",
		"/policies/test/hostile/./forward-auth",
	} {
		if s := ask(path); s != http.StatusNotFound {
			t.Errorf("GET %s: %d, want 404", path, s)
		}
	}
	h.alive(t)
}

// An h2c client that resets its streams while their decisions are in flight once counted each
// reset as a Redis failure: three opened the breaker, and every fail-closed rule of every client
// answered 503 while the resets went on. A client that leaves is neither a success nor a failure.
func TestEnforcerBinaryWhenAnH2CClientResetsItsStreamsThenOtherClientsAreStillDecided(t *testing.T) {
	srv := redistest.NewServer(t)
	// A deadline no loaded machine misses: only the resets could fail decisions here.
	h := startHostile(t, "--redis-url=redis://"+srv.Addr()+"/0", "--redis-timeout=2s")
	conn, err := net.Dial("tcp", h.proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	var frames bytes.Buffer
	frames.WriteString(http2.ClientPreface)
	fr := http2.NewFramer(&frames, nil)
	_ = fr.WriteSettings()
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", "x"}, {":path", "/closed"}} {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	// Each stream's request and its reset in one write: the reset arrives while the decision
	// is in flight. Ninety streams, under the connection's stream bound.
	for id := uint32(1); id < 180; id += 2 {
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block.Bytes(), EndStream: true, EndHeaders: true})
		_ = fr.WriteRSTStream(id, http2.ErrCodeCancel)
	}
	if _, err := conn.Write(frames.Bytes()); err != nil {
		t.Fatal(err)
	}
	// Another client, meanwhile and after: decided by Redis, never by the failure mode.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		if s := raw(t, h.proxy, "GET /closed HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); s != http.StatusOK {
			t.Fatalf("another client's request during the resets: %d, want 200", s)
		}
	}
	if n := h.metric(t, `sluice_store_errors_total{cause="unavailable"}`); n != 0 {
		t.Errorf("%v store errors counted for clients that left", n)
	}
	if h.metric(t, "sluice_store_breaker_open") != 0 {
		t.Error("the breaker opened")
	}
	h.alive(t)
}

// RLS calls past the bounds are refused before anything is decided, and one call cannot be an
// unbounded store script; hits_addend at any size never panics and never admits what the limit
// cannot hold.
func TestEnforcerBinaryWhenRLSCallsAreOversizedThenTheyAreRefusedAndTheProcessLives(t *testing.T) {
	h := startHostile(t)
	conn, err := grpc.NewClient(h.rls, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	c := rlsv3.NewRateLimitServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	descriptors := func(n int) []*rlv3.RateLimitDescriptor {
		ds := make([]*rlv3.RateLimitDescriptor, n)
		for i := range ds {
			ds[i] = &rlv3.RateLimitDescriptor{Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "x-client", Value: fmt.Sprint("c", i)}}}
		}
		return ds
	}
	for n, want := range map[int]codes.Code{32: codes.OK, 33: codes.ResourceExhausted, 5000: codes.ResourceExhausted} {
		_, err := c.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "test/hostile", Descriptors: descriptors(n)})
		if got := grpcstatus.Code(err); got != want {
			t.Errorf("%d descriptors: %v (%v), want %v", n, got, err, want)
		}
		// A domain served nowhere is held to the same bound, before its refusal, which answers
		// a status for each descriptor.
		_, err = c.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "nowhere", Descriptors: descriptors(n)})
		if got := grpcstatus.Code(err); n > 32 && got != codes.ResourceExhausted {
			t.Errorf("%d descriptors for a domain served nowhere: %v (%v), want %v", n, got, err, codes.ResourceExhausted)
		}
	}
	entries := make([]*rlv3.RateLimitDescriptor_Entry, 17)
	for i := range entries {
		entries[i] = &rlv3.RateLimitDescriptor_Entry{Key: fmt.Sprint("k", i), Value: "v"}
	}
	if _, err := c.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "test/hostile", Descriptors: []*rlv3.RateLimitDescriptor{{Entries: entries}}}); grpcstatus.Code(err) != codes.ResourceExhausted {
		t.Errorf("17 entries: %v, want ResourceExhausted", err)
	}
	// A message of exactly 64 KiB is decided, one byte more is refused by gRPC.
	sized := func(size int) *rlsv3.RateLimitRequest {
		req := &rlsv3.RateLimitRequest{Domain: "test/hostile", Descriptors: []*rlv3.RateLimitDescriptor{{
			Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "x-client", Value: ""}}}}}
		e := req.Descriptors[0].Entries[0]
		// The value fills what the rest does not take, less the bytes its lengths' varints grow.
		for n := size - proto.Size(req); n > 0; n-- {
			if e.Value = strings.Repeat("v", n); proto.Size(req) <= size {
				break
			}
		}
		if proto.Size(req) != size {
			t.Fatalf("a message of %d bytes, want %d", proto.Size(req), size)
		}
		return req
	}
	for size, want := range map[int]codes.Code{64 << 10: codes.OK, 64<<10 + 1: codes.ResourceExhausted} {
		if _, err := c.ShouldRateLimit(ctx, sized(size)); grpcstatus.Code(err) != want {
			t.Errorf("a message of %d bytes: %v, want %v", size, err, want)
		}
	}
	h.alive(t)
}

// Idle keep-alive connections after one large-header request each once held 670 MB for 3,000
// of them: each kept its request buffers at their largest. A connection that carried a header
// block over 8 KiB is closed after its response now, and idle connections after small requests
// hold little.
func TestEnforcerBinaryWhenManyIdleConnectionsFollowLargeHeadersThenMemoryStaysSmall(t *testing.T) {
	const conns = 3000
	for _, header := range []int{60 << 10, 1 << 10} {
		t.Run(fmt.Sprintf("headers of %d KiB", header>>10), func(t *testing.T) {
			h := startHostile(t, "--max-conns-per-client=4000", "--max-conns=4000")
			pad := strings.Repeat("x", header)
			open := make([]net.Conn, 0, conns)
			defer func() {
				for _, c := range open {
					_ = c.Close()
				}
			}()
			closed := 0
			for range conns {
				c, err := net.Dial("tcp", h.proxy)
				if err != nil {
					t.Fatal(err)
				}
				open = append(open, c)
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nX-Pad: "+pad+"\r\n\r\n"); err != nil {
					t.Fatal(err)
				}
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					t.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				if resp.Close {
					closed++
				}
			}
			if want := map[bool]int{true: conns, false: 0}[header > 8<<10]; closed != want {
				t.Errorf("%d connections closed after their response, want %d", closed, want)
			}
			waitUntil(t, "the open connections settle", func() bool {
				return h.metric(t, `sluice_connections_open{server="proxy"}`) == float64(conns-closed)
			})
			_, peak := h.p.Usage()
			t.Logf("peak RSS with %d idle connections after %d KiB headers: %.0f MiB", conns-closed, header>>10, peak/(1<<20))
			if peak > 320<<20 {
				t.Errorf("peak RSS %.0f MiB, want under 320 MiB (the rendered limit is 512Mi)", peak/(1<<20))
			}
			h.alive(t)
		})
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	poll.WaitFor(t, 10*time.Second, poll.True(what, cond))
}
