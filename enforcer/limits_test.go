package enforcer_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
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
