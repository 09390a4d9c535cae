package enforcer_test

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/enforcer"
)

// sendHalfClosed sends a raw request, shuts the connection for writing, as a client may once its
// request is sent, and returns everything the server writes before it closes the connection.
func sendHalfClosed(t *testing.T, addr, request string) string {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if _, err := io.WriteString(conn, request); err != nil {
		t.Fatal(err)
	}
	if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, _ := io.ReadAll(conn)
	return string(got)
}

// A client whose connection ends (the end of its stream, seen with MSG_PEEK) while its request
// holds a slot, or waits in a leaky bucket's queue, is taken to have left: its request ends, and
// nothing answers it. A client that only half-closed its connection still reads it, so the
// answer must never be one nobody gave: not a 200 with no body for a request the upstream never
// answered or that was never forwarded, and not the check API's 200 for a request that did not
// wait its turn.
func TestEnforcerWhenAClientHalfClosesThenItIsNeverAnsweredWhatNobodyDecided(t *testing.T) {
	up := createdAfter(t, 300*time.Millisecond)
	e := start(t, policyDoc("half", slotPolicy+`    - name: queue
      match: {path: {value: /queued}}
      leakyBucket: {capacity: 5, drain: {requests: 1, period: 2s}}
`), &upstream{Server: up}, nil)
	honest := func(got string) bool {
		return got == "" || strings.HasPrefix(got, "HTTP/1.1 201 ")
	}
	if got := sendHalfClosed(t, e.ProxyAddr, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"); !honest(got) {
		t.Errorf("a request holding a slot, half-closed: %q; want the upstream's 201 or no answer", firstLine(got))
	}
	get(t, e.proxy+"/queued") // departs at once; the next waits 2s
	if got := sendHalfClosed(t, e.ProxyAddr, "GET /queued HTTP/1.1\r\nHost: x\r\n\r\n"); !honest(got) {
		t.Errorf("a queued proxy request, half-closed: %q; want the upstream's 201 or no answer", firstLine(got))
	}
	check := "GET " + enforcer.ForwardAuthPath + " HTTP/1.1\r\nHost: x\r\nX-Forwarded-Method: GET\r\nX-Forwarded-Uri: /queued\r\n\r\n"
	sendHalfClosed(t, e.CheckAddr, strings.Replace(check, "\r\n\r\n", "\r\nConnection: close\r\n\r\n", 1))
	start := time.Now()
	if got := sendHalfClosed(t, e.CheckAddr, check); got != "" && (!strings.HasPrefix(got, "HTTP/1.1 200 ") || time.Since(start) < time.Second) {
		t.Errorf("a queued check, half-closed: %q after %v; want no answer, or 200 after its wait", firstLine(got), time.Since(start))
	}
}

// createdAfter is an upstream that answers every request 201 after a delay.
func createdAfter(t *testing.T, d time.Duration) *httptest.Server {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		time.Sleep(d) // real time passes: the slow upstream under test
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "done")
	}))
	t.Cleanup(s.Close)
	return s
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\r\n")
	return line
}
