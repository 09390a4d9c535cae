package enforcer_test

import (
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
)

// Through the proxy, on memory and Redis: a client whose response was lost retries with the same
// Idempotency-Key and passes although its limit is used up, and is charged once; the same key
// from another client is that client's own.
func TestProxyWhenAClientRetriesWithItsIdempotencyKeyThenTheRetryPassesUncharged(t *testing.T) {
	for name, opts := range stores(t) {
		t.Run(name, func(t *testing.T) {
			up := newUpstream(t)
			e := start(t, policyDoc(name+"-idem", `    - name: per-client
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: 1, window: 1h}
`, "  retries:\n    idempotencyKey: {maxRepeats: 2}\n"), up, opts)
			send := func(client, key string) int {
				h := []string{"X-Client", client}
				if key != "" {
					h = append(h, "Idempotency-Key", key)
				}
				return get(t, e.proxy+"/orders", h...).StatusCode
			}
			if s := send("alice", "order-1"); s != http.StatusOK {
				t.Fatalf("first request: %d", s)
			}
			// The response was lost on the way back: the retry carries the same key.
			if s := send("alice", "order-1"); s != http.StatusOK {
				t.Errorf("retry with the same Idempotency-Key: %d, want 200 though the limit of 1 is used", s)
			}
			if s := send("alice", "order-2"); s != http.StatusTooManyRequests {
				t.Errorf("a new request: %d, want 429: the retry was not charged, the first was", s)
			}
			if s := send("alice", "order-2"); s != http.StatusTooManyRequests {
				t.Errorf("the refused request's retry: %d, want 429", s)
			}
			if s := send("alice", "order-1"); s != http.StatusOK {
				t.Errorf("second free repeat: %d", s)
			}
			if s := send("alice", "order-1"); s != http.StatusTooManyRequests {
				t.Errorf("third repeat, past maxRepeats 2: %d, want 429: charged like a new request", s)
			}
			if s := send("bob", "order-1"); s != http.StatusOK {
				t.Errorf("bob with alice's key: %d, want his own first request", s)
			}
			if got := up.hits.Load(); got != 4 {
				t.Errorf("the upstream saw %d requests, want the 4 admitted (the repeats are forwarded: the upstream's idempotency answers them)", got)
			}
		})
	}
}

// Clients refused together are told to come back at spread-out times: over 1,000 refusals the
// advertised Retry-After values cover most of the jitter's range, never below what the limit
// needs; without jitter they are all the same.
func TestProxyWhenRetryAfterJitterIsOnThenRefusedClientsAreSpread(t *testing.T) {
	for _, jitter := range []int{0, 50} {
		t.Run(strconv.Itoa(jitter)+"%", func(t *testing.T) {
			extra := ""
			if jitter > 0 {
				extra = "  retries:\n    retryAfterJitterPercent: " + strconv.Itoa(jitter) + "\n"
			}
			e := start(t, policyDoc("jitter-"+strconv.Itoa(jitter), `    - name: all
      fixedWindow: {limit: 1, window: 1h}
`, extra), newUpstream(t), nil)
			get(t, e.proxy+"/")
			var values []int
			for range 1000 {
				r := get(t, e.proxy+"/")
				ra, err := strconv.Atoi(r.Header.Get("Retry-After"))
				if r.StatusCode != http.StatusTooManyRequests || err != nil {
					t.Fatalf("%d, Retry-After %q", r.StatusCode, r.Header.Get("Retry-After"))
				}
				_, _, _, reset := rateLimit(t, r.Header)
				if reset < int64(ra) {
					t.Fatalf("RateLimit t=%d below Retry-After %d: the field promises the quota sooner", reset, ra)
				}
				values = append(values, ra)
			}
			slices.Sort(values)
			lo, hi := values[0], values[len(values)-1]
			// The window ends within the hour: what the limit needs is at most 3600 s.
			need := int(time.Until(time.Now().Truncate(time.Hour).Add(time.Hour)).Seconds()) + 1
			p10, p90 := values[100], values[900]
			t.Logf("jitter %d%%: Retry-After from %d to %d s, p10 %d, p90 %d (the limit needs %d)", jitter, lo, hi, p10, p90, need)
			if lo < need-2 {
				t.Errorf("Retry-After %d is below what the limit needs (%d): a client would come back too early", lo, need)
			}
			switch {
			case jitter == 0 && hi-lo > 2:
				t.Errorf("without jitter the values spread from %d to %d", lo, hi)
			case jitter > 0 && float64(p90-p10) < 0.3*float64(need):
				t.Errorf("with %d%% jitter the middle 80%% spans %d s of the %d s range", jitter, p90-p10, need/2)
			case jitter > 0 && float64(hi) > 1.5*float64(need)+2:
				t.Errorf("Retry-After %d exceeds the limit's need %d by more than the 50%% jitter", hi, need)
			}
		})
	}
}

// With jitter on, Retry-After is still honest: a request sent when it says passes.
func TestProxyWhenJitterIsOnThenARequestAtTheAdvertisedTimePasses(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Now())
	e := start(t, policyDoc("jitter-honest", `    - name: slow
      slidingLog: {limit: 2, window: 1500ms}
`, "  retries:\n    retryAfterJitterPercent: 100\n"), newUpstream(t), nil, onClock(clk))
	get(t, e.proxy+"/")
	get(t, e.proxy+"/")
	resp := get(t, e.proxy+"/")
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != http.StatusTooManyRequests || ra < 2 || ra > 3 {
		t.Fatalf("third request: %d, Retry-After %d; want 429 and 2-3 s (1.5 s plus up to 100%%)", resp.StatusCode, ra)
	}
	clk.Step(time.Duration(ra) * time.Second)
	if resp := get(t, e.proxy+"/"); resp.StatusCode != http.StatusOK {
		t.Errorf("at the advertised time: %d, want 200", resp.StatusCode)
	}
}
