package enforcer

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/fasthttputil"
	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/sluice-dev/sluice/enforcer/internal/front/check"
	"github.com/sluice-dev/sluice/enforcer/internal/front/fastproxy"
	"github.com/sluice-dev/sluice/enforcer/internal/front/netproxy"
	"github.com/sluice-dev/sluice/enforcer/internal/front/rls"
	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/panics"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
	"github.com/sluice-dev/sluice/internal/settings"
)

// Generated hostile input against every front end, served in memory by the real servers. The
// invariants: nothing panics (a recovered panic is counted, and the count must stay 0: the
// recovery would hide what the fuzzer finds), every answer is one the front end documents, and
// no request reaches the upstream past a limit, whatever its path looks like.

// fuzzPolicy limits /admin to one request a day, spent before the first input, and keys a
// second rule on X-Api-Key.
const fuzzPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: fuzz, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: admin
      match: {path: {type: Prefix, value: /admin}}
      fixedWindow: {limit: 1, window: 24h}
    - name: per-key
      key: [{type: Header, name: X-Api-Key}]
      tokenBucket: {capacity: 1000000, refill: {tokens: 1, period: 1s}}
`

// fuzzBed is the proxy and the check API on in-memory listeners, in front of an upstream that
// counts the requests it reads as /admin. proxy is served as in front of an http:// upstream
// (fasthttp, and net/http for h2c); netProxy as in front of an https:// or h2c:// one, where
// net/http serves HTTP/1.x clients too.
type fuzzBed struct {
	proxy, netProxy, check *fasthttputil.InmemoryListener
	panics                 *panics.Panics
	admin                  atomic.Int64
	limiter                *limiter.Limiter
	mu                     sync.Mutex
	seen                   []string // what the upstream read as /admin
}

var (
	bedOnce sync.Once
	bed     *fuzzBed
)

func fuzzServers(_ testing.TB) *fuzzBed {
	bedOnce.Do(func() {
		b := &fuzzBed{proxy: fasthttputil.NewInmemoryListener(), netProxy: fasthttputil.NewInmemoryListener(), check: fasthttputil.NewInmemoryListener()}
		up := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
			// As the upstream resolves the path: decoded by net/http, cleaned as a router does,
			// and matched by whole segments as the rule's Prefix is.
			if clean := path.Clean("/" + r.URL.Path); clean == "/admin" || strings.HasPrefix(clean, "/admin/") {
				b.admin.Add(1)
				b.mu.Lock()
				b.seen = append(b.seen, r.Proto+" "+r.Method+" "+r.RequestURI)
				b.mu.Unlock()
			}
			_, _ = io.Copy(io.Discard, r.Body)
		}))
		policies, _, err := Load([]byte(fuzzPolicy))
		if err != nil {
			panic(err)
		}
		b.limiter = limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{})})
		b.limiter.SetPolicies(policies)
		// The one /admin request of the day is spent before the first input: any input the
		// upstream then reads as /admin passed the limit, on its own, whatever came before.
		if res := b.limiter.Decide(context.Background(), &limiter.Request{Method: "GET", Path: "/admin", Header: http.Header{}}); res.Outcome != limiter.Allowed {
			panic("the first /admin request was refused")
		}
		u, _ := url.Parse(up.URL)
		e := &Enforcer{cfg: Config{Enforcer: settings.Enforcer{ReadTimeout: time.Second, WriteTimeout: time.Second, IdleTimeout: time.Second}, Log: logr.Discard()},
			errs: make(chan error, 3), panics: panics.New(prometheus.NewRegistry(), logr.Discard())}
		um := upstream.NewMetrics(prometheus.NewRegistry())
		fast, err := fastproxy.New(b.limiter, u, fuzzUpstream, um, e.panics, logr.Discard())
		if err != nil {
			panic(err)
		}
		netP := e.panics.HTTP("proxy", netproxy.New(b.limiter, u, http.DefaultTransport, time.Second, um, logr.Discard()))
		e.serveProxy(fast, netP)(b.proxy)
		e.serveHTTP(netP)(b.netProxy)
		e.serveCheck(&check.API{Limiter: b.limiter})(b.check)
		b.panics = e.panics
		bed = b
	})
	return bed
}

// exchange writes raw bytes to a listener and reads what comes back until the server closes
// the connection or stays silent.
func exchange(t *testing.T, ln *fasthttputil.InmemoryListener, data []byte) []byte {
	t.Helper()
	c, err := ln.Dial()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(50 * time.Millisecond))
	// A zero-length write to fasthttputil's pipe is read as zero bytes and no error, which no
	// socket returns and fasthttp's reader refuses to handle (testdata/fuzz/FuzzCheckAPI holds
	// the input that found it): a client that sends nothing sends no write at all.
	if len(data) > 0 {
		go func() { _, _ = c.Write(data) }()
	}
	out, _ := io.ReadAll(c)
	return out
}

// holds asserts the invariants after an input.
func (b *fuzzBed) holds(t *testing.T, server string) {
	t.Helper()
	if n := testutil.ToFloat64(b.panics.Counter(server)); n != 0 {
		t.Fatalf("%s panicked (%v recovered): the input is a crash", server, n)
	}
	if n := b.admin.Load(); n > 0 {
		b.mu.Lock()
		defer b.mu.Unlock()
		t.Fatalf("the upstream read %d requests as /admin, whose limit is spent: %q", n, b.seen)
	}
}

var rawSeeds = []string{
	"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n",
	"GET //admin HTTP/1.1\r\nHost: x\r\n\r\n",
	"GET /public/../admin HTTP/1.1\r\nHost: x\r\n\r\n",
	"GET /%61dmin HTTP/1.1\r\nHost: x\r\n\r\n",
	"GET http://x/admin HTTP/1.1\r\nHost: y\r\n\r\n",
	"GET /admin HTTP/1.0\r\n\r\n",
	"GET / HTTP/1.1\r\nHost: " + strings.Repeat("h", 300) + "\r\n\r\n",
	"GET / HTTP/1.1\r\nHost: x\r\nX-Api-Key: a\r\nX-Api-Key: b\r\n\r\n",
	"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n",
	"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
	"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /admin HTTP/1.1\r\nHost: x\r\n\r\nGET /admin HTTP/1.1\r\nHost: x\r\n\r\n",
	"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}

// FuzzProxyHTTP1 sends raw bytes, HTTP/1.0 and 1.1 requests and whatever else, to the proxy as
// it serves each kind of upstream: fasthttp's HTTP/1.1 and net/http's.
func FuzzProxyHTTP1(f *testing.F) {
	for _, s := range rawSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		b := fuzzServers(t)
		exchange(t, b.proxy, data)
		b.holds(t, "proxy")
		exchange(t, b.netProxy, data)
		b.holds(t, "proxy")
	})
}

// FuzzProxyH2C sends one cleartext HTTP/2 request, pseudo-header fields as generated, to the
// proxy, and resets the stream at once when reset is set.
func FuzzProxyH2C(f *testing.F) {
	f.Add("GET", "/admin", "x-api-key", "a", false)
	f.Add("GET", "//admin", "x-api-key", "a", false)
	f.Add("GET", "/public/../admin", "", "", true)
	f.Add("get", "/%61dmin?x=1", "x-api-key", "b", false)
	f.Add("CONNECT", "", "", "", false)
	f.Add("GET", "*", "upgrade", "h2c", false)
	f.Fuzz(func(t *testing.T, method, target, name, value string, reset bool) {
		b := fuzzServers(t)
		var frames bytes.Buffer
		frames.WriteString(http2.ClientPreface)
		fr := http2.NewFramer(&frames, nil)
		_ = fr.WriteSettings()
		var block bytes.Buffer
		enc := hpack.NewEncoder(&block)
		fields := [][2]string{{":method", method}, {":scheme", "http"}, {":authority", "x"}, {":path", target}}
		if name != "" {
			fields = append(fields, [2]string{strings.ToLower(name), value})
		}
		for _, hf := range fields {
			_ = enc.WriteField(hpack.HeaderField{Name: hf[0], Value: hf[1]})
		}
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndStream: true, EndHeaders: true})
		if reset {
			_ = fr.WriteRSTStream(1, http2.ErrCodeCancel)
			exchange(t, b.proxy, frames.Bytes()) // the whole wait: the request may still go on
		} else {
			answered(t, b.proxy, frames.Bytes())
		}
		b.holds(t, "proxy")
	})
}

// answered writes an HTTP/2 connection's frames and reads until stream 1 is answered in full or
// reset, or the connection ends; within exchange's deadline. The server keeps an HTTP/2
// connection open after its answer, so waiting for its end would spend the deadline on every
// input.
func answered(t *testing.T, ln *fasthttputil.InmemoryListener, data []byte) {
	t.Helper()
	c, err := ln.Dial()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(50 * time.Millisecond))
	go func() { _, _ = c.Write(data) }()
	fr := http2.NewFramer(io.Discard, c)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			return
		case *http2.RSTStreamFrame:
			if f.StreamID == 1 {
				return
			}
		case *http2.HeadersFrame:
			if f.StreamID == 1 && f.StreamEnded() {
				return
			}
		case *http2.DataFrame:
			if f.StreamID == 1 && f.StreamEnded() {
				return
			}
		}
	}
}

// checkStatuses are the answers the check API documents.
var checkStatuses = map[int]bool{200: true, 400: true, 401: true, 403: true, 404: true, 408: true, 413: true, 414: true, 429: true, 431: true, 503: true}

// FuzzCheckAPI sends raw bytes to the check API.
func FuzzCheckAPI(f *testing.F) {
	for _, s := range []string{
		"GET /auth-request HTTP/1.1\r\nHost: c\r\nX-Original-Method: GET\r\nX-Original-Url: http://x:port/admin\r\n\r\n",
		"GET /forward-auth HTTP/1.1\r\nHost: c\r\nX-Forwarded-Method: GET\r\nX-Forwarded-Uri: //admin\r\nX-Original-Url: /public\r\n\r\n",
		"GET /forward-auth HTTP/1.1\r\nHost: c\r\nX-Forwarded-Method: GET\r\nX-Forwarded-Uri: /a\r\nX-Forwarded-Uri: /b\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: c\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		b := fuzzServers(t)
		out := exchange(t, b.check, data)
		b.holds(t, "check")
		br := bufio.NewReader(bytes.NewReader(out))
		for {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if !checkStatuses[resp.StatusCode] {
				t.Fatalf("the check API answered %d", resp.StatusCode)
			}
		}
	})
}

// FuzzRLS sends RateLimitRequest messages as Envoy would encode them: every call is answered or
// refused with a documented code, never a panic.
func FuzzRLS(f *testing.F) {
	add := func(req *rlsv3.RateLimitRequest) {
		data, _ := proto.Marshal(req)
		f.Add(data)
	}
	entry := func(kv ...string) *rlv3.RateLimitDescriptor {
		d := &rlv3.RateLimitDescriptor{}
		for i := 0; i+1 < len(kv); i += 2 {
			d.Entries = append(d.Entries, &rlv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
		}
		return d
	}
	add(&rlsv3.RateLimitRequest{Domain: "test/fuzz", Descriptors: []*rlv3.RateLimitDescriptor{entry("path", "/admin", "method", "GET")}})
	add(&rlsv3.RateLimitRequest{Domain: "test/fuzz", HitsAddend: 1000, Descriptors: []*rlv3.RateLimitDescriptor{entry("x-api-key", "k")}})
	add(&rlsv3.RateLimitRequest{Domain: "test/fuzz", Descriptors: []*rlv3.RateLimitDescriptor{entry("remote_address", "not-an-ip")}})
	add(&rlsv3.RateLimitRequest{Domain: "test/fuzz", Descriptors: []*rlv3.RateLimitDescriptor{entry("x-api-key", "a", "x-api-key", "b")}})
	add(&rlsv3.RateLimitRequest{Domain: "nope"})
	f.Fuzz(func(t *testing.T, data []byte) {
		b := fuzzServers(t)
		var req rlsv3.RateLimitRequest
		if proto.Unmarshal(data, &req) != nil || proto.Size(&req) > MaxRLSMessageBytes {
			return // gRPC refuses what does not decode, or is over the message bound
		}
		s := &rls.Server{Limiter: b.limiter}
		var resp *rlsv3.RateLimitResponse
		var err error
		func() {
			defer func() {
				if v := recover(); v != nil {
					t.Fatalf("ShouldRateLimit panicked: %v", v)
				}
			}()
			resp, err = s.ShouldRateLimit(context.Background(), &req)
		}()
		switch status.Code(err) {
		case codes.OK:
			if len(resp.GetStatuses()) != len(req.GetDescriptors()) {
				t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(req.GetDescriptors()))
			}
		case codes.InvalidArgument, codes.ResourceExhausted, codes.Unavailable:
		default:
			t.Fatalf("ShouldRateLimit: %v", err)
		}
	})
}

// FuzzFrontEndsAgree sends the same request through every front end, each with a limiter of its
// own, twice: every front end reaches the same decisions.
func FuzzFrontEndsAgree(f *testing.F) {
	f.Add("GET", "/admin", "k")
	f.Add("get", "//admin/../admin/x", "k")
	f.Add("POST", "/%61dmin?q", "k")
	f.Add("GET", "/"+strings.Repeat("a", MaxTargetBytes-1), "k") // at the bound, which nginx's absolute URI once passed
	f.Add("GET", "/"+strings.Repeat("a", MaxTargetBytes), "k")
	f.Add("GET", "/a", "k")
	f.Fuzz(func(t *testing.T, method, target, key string) {
		if !validToken(method) || !validTarget(target) || key == "" || !httpguts.ValidHeaderFieldValue(key) || strings.TrimSpace(key) != key {
			return // not one request every protocol can carry
		}
		var got [][]int
		for _, front := range frontEnds(t) {
			got = append(got, []int{front(method, target, key), front(method, target, key)})
		}
		for i := 1; i < len(got); i++ {
			if got[i][0] != got[0][0] || got[i][1] != got[0][1] {
				t.Fatalf("%s %q key %q: front ends decide %v (HTTP/1.1 proxy, h2c proxy, check API for Traefik, check API for nginx, RLS)", method, target, key, got)
			}
		}
	})
}

func validToken(s string) bool {
	if s == "" {
		return false
	}
	for i := range len(s) {
		if !httpguts.IsTokenRune(rune(s[i])) {
			return false
		}
	}
	return true
}

// validTarget is an origin-form request target: a path, without bytes no HTTP version carries.
func validTarget(s string) bool {
	if !strings.HasPrefix(s, "/") {
		return false
	}
	for i := range len(s) {
		if c := s[i]; c <= ' ' || c >= 0x7f || c == '#' {
			return false
		}
	}
	return true
}

// frontEnds returns one function per front end that decides a request through it, on a limiter
// of its own, and says 200, 429 or 400 (414 is 400: RLS has one code for both). The nginx
// endpoint gets the target as nginx builds X-Original-URL, after a client's Host whose port does
// not parse, and its 403 is read as the 429 it stands for.
func frontEnds(t *testing.T) []func(method, target, key string) int {
	t.Helper()
	b := fuzzServers(t) // for its upstream and for the policies
	fresh := func() *limiter.Limiter {
		l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{})})
		l.SetPolicies(b.limiter.Policies())
		return l
	}
	class := func(s int) int {
		if s == http.StatusRequestURITooLong {
			return http.StatusBadRequest
		}
		return s
	}
	peer := &net.TCPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 1234}
	fastDecide := func(h fasthttp.RequestHandler, uri string, setHeaders func(*fasthttp.RequestHeader)) int {
		var ctx fasthttp.RequestCtx
		var req fasthttp.Request
		req.Header.SetRequestURI(uri)
		setHeaders(&req.Header)
		ctx.Init(&req, peer, nil)
		h(&ctx)
		return class(ctx.Response.StatusCode())
	}
	h1 := fresh()
	h2 := fresh()
	chk := fresh()
	ngx := &check.API{Limiter: fresh()}
	rl := fresh()
	refused, _ := url.Parse("http://127.0.0.1:1") // refused: the proxies answer 502 to what passes
	um := upstream.NewMetrics(prometheus.NewRegistry())
	fastP, err := fastproxy.New(h1, refused, fuzzUpstream, um, b.panics, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	netP := netproxy.New(h2, refused, http.DefaultTransport, time.Second, um, logr.Discard())
	c := &check.API{Limiter: chk}
	r := &rls.Server{Limiter: rl}
	passed := func(s int) int {
		if s == http.StatusBadGateway {
			return http.StatusOK
		}
		return s
	}
	return []func(method, target, key string) int{
		func(method, target, key string) int {
			return passed(fastDecide(fastP.Serve, target, func(h *fasthttp.RequestHeader) {
				h.SetMethod(method)
				h.Set("X-Api-Key", key)
			}))
		},
		func(method, target, key string) int {
			req := httptest.NewRequest(http.MethodGet, "/", nil)
			req.Method, req.RequestURI, req.RemoteAddr = method, target, peer.String()
			req.Header.Set("X-Api-Key", key)
			w := httptest.NewRecorder()
			netP.ServeHTTP(w, req)
			return passed(class(w.Code))
		},
		func(method, target, key string) int {
			return fastDecide(c.Serve, ForwardAuthPath, func(h *fasthttp.RequestHeader) {
				h.Set("X-Forwarded-Method", method)
				h.Set("X-Forwarded-Uri", target)
				h.Set("X-Api-Key", key)
			})
		},
		func(method, target, key string) int {
			s := fastDecide(ngx.Serve, AuthRequestPath, func(h *fasthttp.RequestHeader) {
				h.Set("X-Original-Method", method)
				h.Set("X-Original-Url", "http://shop.example:notaport"+target)
				h.Set("X-Api-Key", key)
			})
			if s == http.StatusForbidden {
				return http.StatusTooManyRequests
			}
			return s
		},
		func(method, target, key string) int {
			resp, err := r.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "test/fuzz", Descriptors: []*rlv3.RateLimitDescriptor{{
				Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "method", Value: method}, {Key: "path", Value: target}, {Key: "x-api-key", Value: key},
					{Key: "remote_address", Value: "192.0.2.1"}}}}})
			if _, notDecided := RefusedMalformed(resp, err); notDecided == nil {
				return http.StatusBadRequest // refused as the HTTP front ends answer 400 or 414
			}
			switch {
			case err != nil:
				t.Fatalf("RLS: %v", err)
			case resp.GetOverallCode() == rlsv3.RateLimitResponse_OVER_LIMIT:
				return http.StatusTooManyRequests
			}
			return http.StatusOK
		},
	}
}

// fuzzUpstream are the default upstream options.
var fuzzUpstream = upstream.Options{Connect: settings.Defaults().UpstreamConnectTimeout, ResponseHeader: settings.Defaults().UpstreamResponseHeaderTimeout, Idle: settings.Defaults().UpstreamIdleTimeout}
