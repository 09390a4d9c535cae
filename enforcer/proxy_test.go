package enforcer_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluice-dev/sluice/enforcer"
)

const anyRule = `    - name: any
      fixedWindow: {limit: 1000, window: 1h}
`

// The upstream receives what httputil.ReverseProxy would send it: the hop-by-hop fields and
// those the client's Connection field names are removed, the Host is the client's, and
// X-Forwarded-Host and -Proto say what the client asked for. The client in turn sees none of
// the upstream's hop-by-hop fields, and the RateLimit fields beside the upstream's own.
func TestProxyWhenHeadersAreHopByHopThenTheyStopAtTheProxy(t *testing.T) {
	seen := make(chan http.Header, 1)
	hosts := make(chan string, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
		hosts <- r.Host
		w.Header().Set("Connection", "X-Upstream-Hop")
		w.Header().Set("X-Upstream-Hop", "secret")
		w.Header().Set("Keep-Alive", "timeout=5")
		w.Header().Set("X-Upstream-End", "kept")
		_, _ = w.Write([]byte("ok"))
	}))
	defer up.Close()
	e := start(t, policyDoc("hop", anyRule), &upstream{Server: up}, nil)

	conn, err := net.Dial("tcp", e.ProxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_, _ = io.WriteString(conn, "GET /hop?q=1 HTTP/1.1\r\nHost: api.example\r\nConnection: keep-alive, X-Client-Hop\r\n"+
		"X-Client-Hop: secret\r\nKeep-Alive: timeout=5\r\nProxy-Authorization: Basic c2VjcmV0\r\nTe: trailers\r\nX-Client-End: kept\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	got := <-seen
	for _, name := range []string{"X-Client-Hop", "Keep-Alive", "Proxy-Authorization", "Te"} {
		if v := got.Get(name); v != "" {
			t.Errorf("the upstream received %s: %q", name, v)
		}
	}
	if got.Get("X-Client-End") != "kept" || got.Get("X-Forwarded-Host") != "api.example" || got.Get("X-Forwarded-Proto") != "http" ||
		got.Get("X-Forwarded-For") != "127.0.0.1" {
		t.Errorf("the upstream received %v", got)
	}
	if h := <-hosts; h != "api.example" {
		t.Errorf("the upstream saw Host %q, want the client's", h)
	}
	for _, name := range []string{"X-Upstream-Hop", "Keep-Alive"} {
		if v := resp.Header.Get(name); v != "" {
			t.Errorf("the client received %s: %q", name, v)
		}
	}
	if resp.Header.Get("X-Upstream-End") != "kept" || resp.Header.Get("RateLimit") == "" || resp.Header.Get("RateLimit-Policy") == "" {
		t.Errorf("the client received %v", resp.Header)
	}
}

// Request and response bodies of any size stream through, with a known length or chunked.
func TestProxyWhenBodiesAreLargeThenTheyPassWhole(t *testing.T) {
	// The upstream reads the whole body, then answers with its digest and the body again.
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		sum := sha256.Sum256(body)
		w.Header().Set("X-Digest", hex.EncodeToString(sum[:]))
		_, _ = w.Write(body)
	}))
	defer up.Close()
	e := start(t, policyDoc("upload", anyRule), &upstream{Server: up}, nil)
	body := make([]byte, 5<<20)
	_, _ = rand.Read(body)
	want := sha256.Sum256(body)
	for name, reader := range map[string]io.Reader{
		"known length": bytes.NewReader(body),
		"chunked":      io.MultiReader(bytes.NewReader(body[:1<<20]), bytes.NewReader(body[1<<20:])),
	} {
		resp, err := client.Post(e.proxy+"/upload", "application/octet-stream", reader)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		echoed, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || resp.Header.Get("X-Digest") != hex.EncodeToString(want[:]) || sha256.Sum256(echoed) != want {
			t.Errorf("%s: status %d, upstream digest %s, %d bytes back (%v), want the 5 MiB body both ways", name, resp.StatusCode, resp.Header.Get("X-Digest"), len(echoed), err)
		}
	}
}

// An upstream that cannot be reached is a 502 that still carries the decision's fields.
func TestProxyWhenTheUpstreamIsDownThen502WithRateLimitFields(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	e := start(t, policyDoc("down", anyRule), &upstream{Server: dead}, nil)
	r := get(t, e.proxy+"/")
	if r.StatusCode != http.StatusBadGateway || r.Header.Get("RateLimit") == "" {
		t.Errorf("status %d, RateLimit %q; want 502 with the fields", r.StatusCode, r.Header.Get("RateLimit"))
	}
}

// A client that does not finish its header block within the read timeout gets 408, on the proxy
// and the check API.
func TestEnforcerWhenAHeaderBlockIsTooSlowThen408(t *testing.T) {
	e := start(t, policyDoc("slow", anyRule), newUpstream(t), nil, func(c *enforcer.Config) { c.ReadTimeout = 300 * time.Millisecond })
	for name, addr := range map[string]string{"proxy": e.ProxyAddr, "check API": e.CheckAddr} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
		start := time.Now()
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		_ = conn.Close()
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusRequestTimeout || time.Since(start) > 3*time.Second {
			t.Errorf("%s: %d after %v, want 408 after the 300ms read timeout", name, resp.StatusCode, time.Since(start))
		}
	}
}

// Request paths are decided as the upstream resolves them, the same way by every front end:
// dot segments, repeated slashes and escapes cannot slip a request past a rule that matches its
// resolved path, over HTTP/1.1, h2c or either check endpoint.
func TestProxyWhenThePathHasDotSegmentsThenTheRuleOfTheResolvedPathApplies(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("dots", `    - name: admin
      match: {path: {type: Prefix, value: /admin}}
      fixedWindow: {limit: 1, window: 1h}
`), up, nil)
	if s := rawStatus(t, e.ProxyAddr, "GET /admin/users HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); s != http.StatusOK {
		t.Fatalf("first: %d", s)
	}
	for _, path := range []string{"/x#/../admin", "/public#/../../admin"} {
		if s := rawStatus(t, e.ProxyAddr, "GET "+path+" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); s != http.StatusBadRequest {
			t.Errorf("proxy, %s: %d, want 400: a target has no fragment, and the upstream may read it as /admin", path, s)
		}
		if s := h2cStatus(t, e.ProxyAddr, path); s != http.StatusBadRequest {
			t.Errorf("proxy over h2c, %s: %d, want 400", path, s)
		}
	}
	for _, path := range []string{"/public/../admin/users", "/admin/./users", "//admin/users", "/%61dmin/users", "/public/%2e%2e/admin"} {
		if s := rawStatus(t, e.ProxyAddr, "GET "+path+" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); s != http.StatusTooManyRequests {
			t.Errorf("proxy, %s: %d, want 429: it is /admin/users to the upstream", path, s)
		}
		if s := h2cStatus(t, e.ProxyAddr, path); s != http.StatusTooManyRequests {
			t.Errorf("proxy over h2c, %s: %d, want 429", path, s)
		}
		// The check API decides the original URI an ingress describes the same way.
		if r := get(t, e.check+enforcer.AuthRequestPath, "X-Original-Method", "GET", "X-Original-URL", "http://x"+path+"?q=1"); r.StatusCode != http.StatusForbidden {
			t.Errorf("check API for nginx, %s: %d, want 403", path, r.StatusCode)
		}
		if r := get(t, e.check+enforcer.ForwardAuthPath, "X-Forwarded-Method", "GET", "X-Forwarded-Uri", path+"?q=1"); r.StatusCode != http.StatusTooManyRequests {
			t.Errorf("check API for Traefik, %s: %d, want 429", path, r.StatusCode)
		}
	}
	if n := up.hits.Load(); n != 1 {
		t.Errorf("the upstream saw %d requests, want the first only", n)
	}
}

// An ingress that gives up on a held check-API answer frees it at once.
func TestCheckAPIWhenTheIngressLeavesWhileQueuedThenTheAnswerIsReleased(t *testing.T) {
	e := start(t, policyDoc("leave-check", `    - name: queue
      leakyBucket: {capacity: 5, drain: {requests: 1, period: 2s}}
`), nil, nil)
	describe := []string{"X-Original-Method", "GET", "X-Original-URL", "/"}
	get(t, e.check+enforcer.AuthRequestPath, describe...) // departs at once; the next waits 2s
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.check+enforcer.AuthRequestPath, nil)
	req.Header.Set(describe[0], describe[1])
	req.Header.Set(describe[2], describe[3])
	if resp, err := client.Do(req); err == nil {
		_ = resp.Body.Close()
		t.Fatalf("held answer sent before its wait: %d", resp.StatusCode)
	}
	assertNothingHeld(t, e)
}

// assertNothingHeld stops the enforcer and checks that the drain, which waits for every request
// in flight, ends at once: no answer is held for a client that left.
func assertNothingHeld(t *testing.T, e *running) {
	t.Helper()
	// Had the close not reached the socket yet, the drain waits for it, a moment: a request held
	// for its whole wait still shows.
	began := time.Now()
	e.stop()
	if err := e.Wait(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(began); d > time.Second {
		t.Errorf("the drain took %v: a request whose client left was still held", d)
	}
}

// An operator finds a client's keys, and every key of a rule, from the admin port: the key names
// are hashes, and /keys computes them.
func TestAdminWhenAskedForAClientsKeysThenTheyAreTheKeysItsRequestsWrote(t *testing.T) {
	opts := standalone(t)
	e := start(t, policyDoc("keys", `    - name: per-client
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: 10, window: 1h}
    - name: uploads
      match: {path: {type: Prefix, value: /upload}}
      tokenBucket: {capacity: 5, refill: {tokens: 1, period: 1s}}
`), newUpstream(t), opts)
	if r := get(t, e.proxy+"/api", "X-Client", "alice"); r.StatusCode != http.StatusOK {
		t.Fatal(r.StatusCode)
	}
	var reply struct {
		Rules []struct{ Rule, ID, Pattern, Key string }
	}
	resp, err := client.Get(e.admin + "/keys?policy=test/keys&addr=127.0.0.1&path=/api&header=X-Client:alice")
	if err != nil {
		t.Fatal(err)
	}
	err = json.NewDecoder(resp.Body).Decode(&reply)
	_ = resp.Body.Close()
	if err != nil || len(reply.Rules) != 2 {
		t.Fatalf("/keys: %+v, %v", reply, err)
	}
	perClient, uploads := reply.Rules[0], reply.Rules[1]
	if uploads.Key != "" || uploads.Pattern != "sl{*}"+uploads.ID || perClient.Key == "" {
		t.Errorf("/keys: %+v; want a key for the matching rule only, and every rule's pattern", reply.Rules)
	}
	rdb := redis.NewClient(&redis.Options{Addr: opts.Addrs[0]})
	defer func() { _ = rdb.Close() }()
	ctx := context.Background()
	if ttl, err := rdb.PTTL(ctx, perClient.Key).Result(); err != nil || ttl <= 0 {
		t.Errorf("key %q of alice's request: TTL %v, %v; want the key the request wrote", perClient.Key, ttl, err)
	}
	if keys, err := rdb.Keys(ctx, perClient.Pattern).Result(); err != nil || len(keys) != 1 || keys[0] != perClient.Key {
		t.Errorf("pattern %q finds %v (%v), want alice's key alone", perClient.Pattern, keys, err)
	}
	if len(perClient.Key) > 30 || strings.Contains(perClient.Key, "alice") {
		t.Errorf("key %q: over the 30 bytes Redis keeps in one allocation, or holds the raw client key", perClient.Key)
	}
	if r := get(t, e.admin+"/keys?policy=test/other"); r.StatusCode != http.StatusNotFound {
		t.Errorf("an unknown policy: %d, want 404", r.StatusCode)
	}
}

// An HTTP/1.0 client that sends no Host still reaches the upstream, under the upstream's name.
func TestProxyWhenAnHTTP10ClientSendsNoHostThenTheRequestPasses(t *testing.T) {
	e := start(t, policyDoc("http10", anyRule), newUpstream(t), nil)
	conn, err := net.Dial("tcp", e.ProxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_, _ = io.WriteString(conn, "GET / HTTP/1.0\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("HTTP/1.0 without Host: %d, want 200", resp.StatusCode)
	}
}

// A request that asks to upgrade to anything but WebSocket is refused with 400 and its connection
// closed, and never reaches the upstream, even one that would switch protocols: once spliced,
// every request inside the tunnel (HTTP/2 after "Upgrade: h2c") would pass undecided. Both
// proxies: fasthttp's in front of an http:// upstream, net/http's, which serves HTTP/1.1 clients
// too, in front of an h2c:// one.
func TestProxyWhenAnUpgradeIsNotWebSocketThenItIsRefusedAndNothingIsSpliced(t *testing.T) {
	var hits atomic.Int64
	switching := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if r.ProtoMajor == 1 && r.Header.Get("Upgrade") != "" {
			c, brw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				return
			}
			defer func() { _ = c.Close() }()
			_, _ = brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + r.Header.Get("Upgrade") + "\r\n\r\n")
			_ = brw.Flush()
			_, _ = io.Copy(io.Discard, brw) // the tunnel, until the proxy closes it
		}
	}))
	switching.Config.Protocols = new(http.Protocols)
	switching.Config.Protocols.SetHTTP1(true)
	switching.Config.Protocols.SetUnencryptedHTTP2(true)
	switching.Start()
	t.Cleanup(switching.Close)
	for _, scheme := range []string{"http", "h2c"} {
		e := start(t, policyDoc("no-upgrade", `    - name: any
      fixedWindow: {limit: 100, window: 1h}
`), nil, nil, func(c *enforcer.Config) {
			c.Upstream, _ = url.Parse(scheme + "://" + switching.Listener.Addr().String())
		})
		for _, protocol := range []string{"h2c", "tunnel", "TLS/1.2"} {
			conn, err := net.Dial("tcp", e.ProxyAddr)
			if err != nil {
				t.Fatal(err)
			}
			_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
			br := bufio.NewReader(conn)
			_, _ = io.WriteString(conn, "GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: "+protocol+"\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest || !resp.Close {
				t.Errorf("%s upstream, Upgrade: %s: %d (close %v), want 400 and the connection closed", scheme, protocol, resp.StatusCode, resp.Close)
			}
			// Nothing more is read from the connection: the next bytes would be a tunnel's.
			_, _ = io.WriteString(conn, "GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
			if resp, err := http.ReadResponse(br, nil); err == nil {
				_ = resp.Body.Close()
				t.Errorf("%s upstream, Upgrade: %s: a second request on the connection got %d", scheme, protocol, resp.StatusCode)
			}
			_ = conn.Close()
		}
		if scheme == "http" {
			if s := rawStatus(t, e.ProxyAddr, "GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"); s != http.StatusSwitchingProtocols {
				t.Errorf("%s upstream, Upgrade: websocket: %d, want 101: WebSocket is spliced", scheme, s)
			}
		}
	}
	if n := hits.Load(); n != 1 {
		t.Errorf("the upstream saw %d requests, want the WebSocket upgrade only", n)
	}
}
