package enforcer_test

import (
	"bufio"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// A client that leaves a streamed response just before its trailer, which reports the cost,
// pays costFrom.max rather than the rule's cost, on both proxy paths, and on HTTP/1.1 whether
// the request holds a slot (a connection of its own) or only owes its charge (the pool): a
// client that reads the body up to its last event and leaves must not pay less than one that
// reads the trailer too (found by a hostile session: 6 responses reporting 8,000 tokens each
// were charged 1,000 each).
func TestProxyWhenAClientLeavesBeforeTheCostTrailerThenItIsChargedTheMax(t *testing.T) {
	const rules = `    - name: tokens
      match: {path: {value: /chat}}
      fixedWindow: {limit: 1000, window: 1h}
      cost: 10
      charge: {when: Response}
      costFrom: {responseHeader: X-Tokens-Used, max: 400}
`
	const slots = `    - name: streams
      match: {path: {value: /chat}}
      concurrency: {limit: 4}
`
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Tokens-Used")
		_, _ = io.WriteString(w, "data: tokens\n\ndata: [DONE]\n\n")
		_ = http.NewResponseController(w).Flush()
		select { // the usage is known a little after the last event
		case <-time.After(300 * time.Millisecond):
		case <-r.Context().Done():
		}
		w.Header().Set("X-Tokens-Used", "400")
	}))
	defer up.Close()
	for name, newClient := range proxyClients {
		for kind, doc := range map[string]string{"owing": rules, "holding": rules + slots} {
			t.Run(name+"/"+kind, func(t *testing.T) {
				e := start(t, policyDoc("cut", doc), &upstream{Server: up}, nil)
				resp, err := newClient().Get(e.proxy + "/chat")
				if err != nil {
					t.Fatal(err)
				}
				br := bufio.NewReader(resp.Body)
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						t.Fatalf("the stream ended before its last event: %v", err)
					}
					if strings.Contains(line, "[DONE]") {
						break
					}
				}
				_ = resp.Body.Close() // leaves before the trailer: the pool may still read it, and charge it
				waitUntil(t, "the response charged", func() bool {
					n := 0.0
					for _, result := range []string{"charged", "clamped", "default_cost", "incomplete"} {
						n += metric(t, e.admin, `sluice_response_charges_total{namespace="test",policy="cut",result="`+result+`",rule="tokens"}`)
					}
					return n == 1
				})
				if got := get(t, e.proxy+"/nothing-charged").StatusCode; got != http.StatusOK {
					t.Fatalf("an unlimited path: %d", got)
				}
				r, err := newClient().Get(e.proxy + "/chat")
				if err != nil {
					t.Fatal(err)
				}
				_ = r.Body.Close()
				if got := r.Header.Get("RateLimit"); !strings.Contains(got, `"tokens";r=600`) {
					t.Errorf("RateLimit %q after the cut response, want r=600 of 1000: charged max (400)", got)
				}
			})
		}
	}
}
