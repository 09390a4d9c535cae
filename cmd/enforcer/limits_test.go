package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// renewalRound waits until the n requests that p holds under a concurrency rule have renewed
// their leases, all within half a second (a round: they renew together, once a second), and
// returns a time before every renewal of that round. Kill p at once, and their last renewals
// are that round's.
func renewalRound(t *testing.T, p *proc, n float64) time.Time {
	t.Helper()
	type count struct {
		at      time.Time // when the scrape was sent
		renewed float64
	}
	var seen []count
	var before time.Time
	poll.WaitFor(t, 15*time.Second, func() error {
		c := count{time.Now(), scrape(p.admin, `sluice_lease_renewals_total{result="renewed"}`)}
		seen = append(seen, c)
		for i := len(seen) - 1; i >= 0 && c.at.Sub(seen[i].at) < 500*time.Millisecond; i-- {
			if c.renewed-seen[i].renewed >= n {
				before = seen[i].at // the latest scrape that counted none of the round
				return nil
			}
		}
		return fmt.Errorf("no round of %v renewals: %v renewed", n, c.renewed)
	})
	return before
}

// proc is an enforcer binary started by startProc.
type proc struct {
	proxy, admin string
	p            *local.Process
}

// startProc runs the enforcer binary with policy in front of upstream, with flags, until the
// test ends (the test prints its log if it fails), and waits until it is ready.
func startProc(t *testing.T, upstream, policy string, flags ...string) *proc {
	t.Helper()
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(policy), 0o600); err != nil {
		t.Fatal(err)
	}
	proxy, _ := local.FreeAddr()
	admin, _ := local.FreeAddr()
	log := &local.Output{}
	args := []string{"--policy=" + file, "--upstream=" + upstream, "--listen=" + proxy, "--check-listen=", "--admin-listen=" + admin, "--shutdown-delay=0s"}
	if len(flags) > 0 {
		args = append(args, "--redis-timeout=2s") // generous: three binaries and a Cluster share two cores
	}
	p, err := local.Start("enforcer", log, binary(t), append(args, flags...)...)
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
	return &proc{proxy: "http://" + proxy, admin: admin, p: p}
}

// storeSets are the stores the binary tests of leases and charges run on: memory (one
// enforcer), and three enforcers on one standalone Redis and on one 3-master Cluster.
func storeSets() map[string]func(t *testing.T) (flags []string, replicas int) {
	return map[string]func(t *testing.T) ([]string, int){
		"memory": func(*testing.T) ([]string, int) { return nil, 1 },
		"redis": func(t *testing.T) ([]string, int) {
			t.Helper()
			return []string{"--redis-url=redis://" + redistest.NewServer(t).Addr() + "/0"}, 3
		},
		"cluster": func(t *testing.T) ([]string, int) {
			t.Helper()
			return []string{"--redis-cluster=" + strings.Join(redistest.NewCluster(t, 3).Addrs(), ",")}, 3
		},
	}
}

// holder is an upstream that counts the requests in flight at it, and the most there ever were:
// /slow is held until the test releases the requests held so far (or the request ends), /quick
// is answered at once, /stream writes a first line and its last once released (/stream?short
// ends after the first).
type holder struct {
	*httptest.Server
	mu             sync.Mutex
	release        chan struct{}
	inFlight, most atomic.Int64
	arrived        atomic.Int64
}

func newHolder(t *testing.T) *holder {
	t.Helper()
	h := &holder{release: make(chan struct{})}
	h.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/quick" {
			return
		}
		n := h.inFlight.Add(1)
		defer h.inFlight.Add(-1)
		for m := h.most.Load(); n > m && !h.most.CompareAndSwap(m, n); m = h.most.Load() {
		}
		h.arrived.Add(1)
		h.mu.Lock()
		release := h.release
		h.mu.Unlock()
		if r.URL.Path == "/stream" {
			_, _ = io.WriteString(w, "first\n")
			_ = http.NewResponseController(w).Flush()
			if r.URL.Query().Has("short") {
				return
			}
		}
		select {
		case <-release:
			_, _ = io.WriteString(w, "last\n")
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(h.Close)
	t.Cleanup(h.releaseAll)
	return h
}

// releaseAll answers every request held so far.
func (h *holder) releaseAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	close(h.release)
	h.release = make(chan struct{})
}

const concurrencyPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: slots, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: in-flight
      match: {path: {type: RegularExpression, value: "/(slow|quick)"}}
      key: [{type: Header, name: X-Api-Key}]
      concurrency: {limit: 10, leaseTimeout: 3s}
    - name: stream
      match: {path: {value: /stream}}
      key: [{type: Header, name: X-Api-Key}]
      concurrency: {limit: 1, leaseTimeout: 3s}
`

// sendHeld sends n requests for key at once, spread over the enforcers, and returns their
// answers' statuses by a channel as each comes, and the cancel that makes every client leave.
func sendHeld(ps []*proc, key, path string, n int) (<-chan int, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	statuses := make(chan int, n)
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n, DisableKeepAlives: true}, Timeout: 60 * time.Second}
	for i := range n {
		go func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, ps[i%len(ps)].proxy+path, nil)
			req.Header.Set("X-Api-Key", key)
			resp, err := c.Do(req)
			if err != nil {
				statuses <- 0 // the client left
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			statuses <- resp.StatusCode
		}()
	}
	return statuses, cancel
}

// collect counts n statuses by value, within a minute.
func collect(t *testing.T, statuses <-chan int, n int) map[int]int {
	t.Helper()
	got := map[int]int{}
	timeout := time.After(time.Minute)
	for range n {
		select {
		case s := <-statuses:
			got[s]++
		case <-timeout:
			t.Fatalf("only %v of %d answers within a minute", got, n)
		}
	}
	return got
}

// probe sends one /quick request for key and returns its status.
func probe(p *proc, key string) int {
	req, _ := http.NewRequest(http.MethodGet, p.proxy+"/quick", nil)
	req.Header.Set("X-Api-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// 200 clients each hold a slow request against a concurrency limit of 10 (leases of 3s), through
// three enforcer binaries on one Redis (one on memory; three on a Cluster): exactly 10 are in
// flight at the upstream, never more, and the other 190 are refused with 429 at once; leases
// are renewed while the requests last past their timeout; slots are freed when the requests
// complete, when their clients leave, and, when the enforcer holding them is SIGKILLed, within
// the lease timeout; a streamed response holds its slot until its last byte.
func TestEnforcerBinariesWhenTwoHundredClientsHoldSlowRequestsThenTenAreInFlightAtATime(t *testing.T) {
	for name, set := range storeSets() {
		t.Run(name, func(t *testing.T) {
			flags, replicas := set(t)
			h := newHolder(t)
			var ps []*proc
			for range replicas {
				ps = append(ps, startProc(t, h.URL, concurrencyPolicy, flags...))
			}
			free := func(what, key string) {
				t.Helper()
				poll.WaitFor(t, 15*time.Second, func() error {
					if s := probe(ps[len(ps)-1], key); s != http.StatusOK {
						return fmt.Errorf("%s: a probe is answered %d", what, s)
					}
					return nil
				})
			}

			// All hold on: exactly 10 pass, and stay in flight past two lease timeouts.
			statuses, leave := sendHeld(ps, "a", "/slow", 200)
			if got := collect(t, statuses, 190); got[http.StatusTooManyRequests] != 190 {
				t.Fatalf("answers while 10 are held: %v, want 190 refused", got)
			}
			poll.WaitFor(t, 15*time.Second, func() error {
				if n := h.inFlight.Load(); n != 10 {
					return fmt.Errorf("%d in flight at the upstream, want 10", n)
				}
				return nil
			})
			renewals := func() float64 {
				n := 0.0
				for _, p := range ps {
					n += scrape(p.admin, `sluice_lease_renewals_total{result="renewed"}`)
				}
				return n
			}
			poll.WaitFor(t, 30*time.Second, func() error {
				// A renewal every second per request: seven each take them past two timeouts.
				if n := renewals(); n < 70 {
					return fmt.Errorf("%v renewals", n)
				}
				return nil
			})
			if s := probe(ps[0], "a"); s != http.StatusTooManyRequests {
				t.Errorf("after two lease timeouts of renewed leases: %d, want 429", s)
			}
			if s := probe(ps[0], "b"); s != http.StatusOK {
				t.Errorf("another key: %d, want 200", s)
			}

			// Completion frees the slots.
			h.releaseAll()
			if got := collect(t, statuses, 10); got[http.StatusOK] != 10 {
				t.Fatalf("the held requests: %v, want 10 answered 200", got)
			}
			leave()
			free("after completion", "a")

			// A second wave: again 10, and the clients leave: their slots are freed.
			statuses, leave = sendHeld(ps, "a", "/slow", 200)
			if got := collect(t, statuses, 190); got[http.StatusTooManyRequests] != 190 {
				t.Fatalf("second wave: %v, want 190 refused", got)
			}
			poll.WaitFor(t, 15*time.Second, func() error {
				if n := h.inFlight.Load(); n != 10 {
					return fmt.Errorf("%d in flight, want 10", n)
				}
				return nil
			})
			leave()
			collect(t, statuses, 10)
			poll.WaitFor(t, 15*time.Second, func() error {
				if n := h.inFlight.Load(); n != 0 {
					return fmt.Errorf("%d still in flight at the upstream after their clients left", n)
				}
				return nil
			})
			free("after the clients left", "a")
			if m := h.most.Load(); m != 10 {
				t.Errorf("at most %d in flight at the upstream, want exactly 10", m)
			}

			// A streamed response holds its slot to its last byte.
			req, _ := http.NewRequest(http.MethodGet, ps[0].proxy+"/stream", nil)
			req.Header.Set("X-Api-Key", "s")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body := bufio.NewReader(resp.Body)
			if line, _ := body.ReadString('\n'); line != "first\n" {
				t.Fatalf("stream: %q", line)
			}
			second, _ := sendHeld(ps[len(ps)-1:], "s", "/stream", 1)
			if s := <-second; s != http.StatusTooManyRequests {
				t.Errorf("a second stream while the first runs: %d, want 429", s)
			}
			h.releaseAll()
			if rest, _ := io.ReadAll(body); string(rest) != "last\n" {
				t.Errorf("the stream's end: %q", rest)
			}
			_ = resp.Body.Close()
			poll.WaitFor(t, 15*time.Second, func() error {
				third, _ := sendHeld(ps[len(ps)-1:], "s", "/stream?short", 1)
				if s := <-third; s != http.StatusOK {
					return fmt.Errorf("after the stream's last byte: %d", s)
				}
				return nil
			})

			if replicas == 1 {
				return // a memory store dies with its enforcer: nothing outlives a SIGKILL
			}
			// 10 held by the first enforcer, which is killed: the upstream's requests end with
			// its connections; the leases stay in Redis until their timeout, unrenewed.
			statuses, leave = sendHeld(ps[:1], "k", "/slow", 10)
			defer leave()
			poll.WaitFor(t, 15*time.Second, func() error {
				if n := h.inFlight.Load(); n != 10 {
					return fmt.Errorf("%d in flight, want 10", n)
				}
				return nil
			})
			// The kill comes right after a round of renewals: every lease ends 3 s after its last
			// renewal, which Redis's TIME took between renewedAfter and the kill.
			renewedAfter := renewalRound(t, ps[0], 10)
			if err := ps[0].p.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			killed := time.Now()
			collect(t, statuses, 10)
			// A probe refused was decided while the ten slots were held, so it started before a
			// lease ended; one admitted was decided after one ended, so it ended after that. Both
			// against the same clock as Redis's TIME: no slack for the probe's pace or its time.
			var lastRefused, firstAdmitted time.Time
			poll.WaitFor(t, 15*time.Second, func() error {
				sent := time.Now()
				switch s := probe(ps[1], "k"); s {
				case http.StatusTooManyRequests:
					lastRefused = sent
					return fmt.Errorf("%v after the kill: %d", time.Since(killed), s)
				case http.StatusOK:
					firstAdmitted = time.Now()
					return nil
				default:
					return fmt.Errorf("%v after the kill: %d", time.Since(killed), s)
				}
			})
			const lease = 3 * time.Second
			t.Logf("the killed enforcer's slots were freed %v to %v after the kill (%v after the renewals)",
				lastRefused.Sub(killed), firstAdmitted.Sub(killed), firstAdmitted.Sub(renewedAfter))
			if lastRefused.IsZero() {
				t.Error("no probe after the kill was refused: the dead enforcer's leases were not held")
			}
			if !lastRefused.Before(killed.Add(lease)) {
				t.Errorf("a probe sent %v after the kill was refused: a lease outlived its timeout (%v) after its last renewal", lastRefused.Sub(killed), lease)
			}
			// The renewal's answer reaches the counter after Redis took its TIME: a quarter of the
			// renewal interval (1 s) is the most it may lag on two loaded cores.
			if margin := 250 * time.Millisecond; !firstAdmitted.After(renewedAfter.Add(lease - margin)) {
				t.Errorf("a probe answered %v after the last renewals was admitted: a lease ended before its timeout (%v)", firstAdmitted.Sub(renewedAfter), lease)
			}
		})
	}
}

const chargePolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: charges, namespace: test}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: failed-logins
      match: {path: {value: /login}}
      key: [{type: Header, name: X-Account}]
      fixedWindow: {limit: 5, window: 1h}
      charge: {when: Response, statuses: ["401", "403"]}
    - name: tokens
      match: {path: {value: /chat}}
      key: [{type: Header, name: X-Api-Key}]
      tokenBucket: {capacity: 1000, refill: {tokens: 1, period: 1h}}
      charge: {when: Response}
      costFrom: {responseHeader: X-Tokens-Used, max: 1000}
    - name: bounded-failures
      match: {path: {value: /bounded}}
      key: [{type: Header, name: X-Account}]
      fixedWindow: {limit: 5, window: 1h}
      charge: {when: Response, statuses: ["401"]}
    - name: bounded-in-flight
      match: {path: {value: /bounded}}
      key: [{type: Header, name: X-Account}]
      concurrency: {limit: 3}
`

// Rules charged by the response, through the enforcer binary on memory, Redis and Cluster: 20
// logins of which 3 fail all pass, two more failures pass too, and the next attempt is refused,
// successes never charged; a token budget of 1,000 charged 300 by each response refuses the
// fifth request. Each response is charged in the background once it has ended: the test waits
// for the charge the binary reports before the next request.
func TestEnforcerBinaryWhenResponsesAreChargedThenFailedLoginsAndTokensCount(t *testing.T) {
	for name, set := range storeSets() {
		t.Run(name, func(t *testing.T) {
			flags, _ := set(t)
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				switch r.URL.Path {
				case "/login":
					if r.URL.Query().Get("password") != "right" {
						w.WriteHeader(http.StatusUnauthorized)
					}
				case "/chat":
					w.Header().Set("X-Tokens-Used", "300")
				}
			}))
			defer up.Close()
			p := startProc(t, up.URL, chargePolicy, flags...)
			charges := func(rule string) float64 {
				return scrape(p.admin, `sluice_response_charges_total{namespace="test",policy="charges",result="charged",rule="`+rule+`"}`)
			}
			send := func(path, header, value string) int {
				t.Helper()
				req, _ := http.NewRequest(http.MethodGet, p.proxy+path, nil)
				req.Header.Set(header, value)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				_ = resp.Body.Close()
				return resp.StatusCode
			}
			waitCharged := func(rule string, n float64) {
				t.Helper()
				poll.WaitFor(t, 15*time.Second, func() error {
					if got := charges(rule); got != n {
						return fmt.Errorf("%s charged %v times, want %v", rule, got, n)
					}
					return nil
				})
			}
			failures := 0.0
			for i := range 20 {
				path := "/login?password=right"
				if i%6 == 5 { // 3 of the 20
					path = "/login?password=wrong"
				}
				status := send(path, "X-Account", "alice")
				if status == http.StatusTooManyRequests {
					t.Fatalf("login %d refused: 20 logins with 3 failures all pass", i+1)
				}
				if status == http.StatusUnauthorized {
					failures++
					waitCharged("failed-logins", failures)
				}
			}
			for range 2 {
				if s := send("/login?password=wrong", "X-Account", "alice"); s != http.StatusUnauthorized {
					t.Fatalf("the 4th and 5th failures: %d, want them forwarded", s)
				}
				failures++
				waitCharged("failed-logins", failures)
			}
			if s := send("/login?password=right", "X-Account", "alice"); s != http.StatusTooManyRequests {
				t.Errorf("after 5 failures: %d, want 429 even for the right password", s)
			}
			for i := range 30 {
				if s := send("/login?password=right", "X-Account", "bob"); s != http.StatusOK {
					t.Fatalf("bob's login %d: %d: successes are never charged", i+1, s)
				}
			}
			if got := charges("failed-logins"); got != 5 {
				t.Errorf("%v charges, want the 5 failures alone", got)
			}

			for i := range 4 {
				if s := send("/chat", "X-Api-Key", "k"); s != http.StatusOK {
					t.Fatalf("chat %d: %d", i+1, s)
				}
				waitCharged("tokens", float64(i+1))
			}
			if s := send("/chat", "X-Api-Key", "k"); s != http.StatusTooManyRequests {
				t.Errorf("the fifth chat, after 4 x 300 of 1000 tokens: %d, want 429", s)
			}
		})
	}
}

// The overshoot of a rule charged by the response, through the binary: 50 login attempts at
// once, all failing, against a limit of 5 failures. Alone, the rule admits every attempt in
// flight when its limit is reached: the upstream holds them until all 50 have arrived, so all
// pass, 45 beyond the limit, the bound; the next is refused. With a concurrency rule of 3 on the
// same requests (clients retrying a concurrency refusal), at most 3 are ever in flight, and at
// most 5 + 3 - 1 pass: the attempt whose charge reaches the limit frees its slot with it.
func TestEnforcerBinaryWhenFiftyFailingLoginsArriveAtOnceThenTheOvershootStaysWithinTheBound(t *testing.T) {
	for name, set := range storeSets() {
		t.Run(name, func(t *testing.T) {
			flags, _ := set(t)
			var forwarded, barrier atomic.Int64
			all := make(chan struct{})
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				forwarded.Add(1)
				if r.URL.Path == "/login" && barrier.Add(1) == 50 {
					close(all)
				}
				if r.URL.Path == "/login" {
					select {
					case <-all:
					case <-r.Context().Done():
					}
				}
				w.WriteHeader(http.StatusUnauthorized)
			}))
			defer up.Close()
			p := startProc(t, up.URL, chargePolicy, flags...)
			c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 50}, Timeout: 30 * time.Second}
			attempt := func(path, account string) (int, string) {
				req, _ := http.NewRequest(http.MethodGet, p.proxy+path, nil)
				req.Header.Set("X-Account", account)
				resp, err := c.Do(req)
				if err != nil {
					return 0, err.Error()
				}
				defer func() { _ = resp.Body.Close() }()
				var problem struct{ Type string }
				_ = json.NewDecoder(resp.Body).Decode(&problem)
				return resp.StatusCode, problem.Type
			}
			var wg sync.WaitGroup
			var passed atomic.Int64
			for range 50 {
				wg.Go(func() {
					if s, _ := attempt("/login", "mallory"); s == http.StatusUnauthorized {
						passed.Add(1)
					}
				})
			}
			wg.Wait()
			if passed.Load() != 50 || forwarded.Load() != 50 {
				t.Fatalf("%d passed (%d forwarded): all 50 were in flight before any response", passed.Load(), forwarded.Load())
			}
			poll.WaitFor(t, 15*time.Second, func() error {
				if s, _ := attempt("/login", "mallory"); s != http.StatusTooManyRequests {
					return fmt.Errorf("after 50 failures: %d", s)
				}
				return nil
			})

			forwarded.Store(0)
			for range 50 {
				wg.Go(func() {
					for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
						s, problem := attempt("/bounded", "eve")
						if s != http.StatusTooManyRequests || problem != "https://sluice.dev/problems/concurrency-limited" {
							return // forwarded, or refused by the failures' limit
						}
					}
					t.Error("an attempt was refused by the concurrency rule for 30s")
				})
			}
			wg.Wait()
			t.Logf("with a concurrency rule of 3: %d of the attempts forwarded", forwarded.Load())
			if n := forwarded.Load(); n < 5 || n > 5+3-1 {
				t.Errorf("%d attempts forwarded, want from 5 to 7: the limit, and at most the 2 others in flight when it was reached", n)
			}
		})
	}
}
