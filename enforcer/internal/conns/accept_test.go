package conns

import (
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// failingListener fails its first Accepts with errs, as the kernel does when the process is out
// of file descriptors, then hands out conn.
type failingListener struct {
	net.Listener
	errs []error
	conn net.Conn
}

func (l *failingListener) Accept() (net.Conn, error) {
	if len(l.errs) > 0 {
		err := l.errs[0]
		l.errs = l.errs[1:]
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", err)}
	}
	return l.conn, nil
}

// A listener whose Accept fails for want of file descriptors or kernel memory waits and accepts
// again, as net/http's servers do: the error passes once connections close. Returned, it stopped
// the server that got it, and with it the enforcer (found by a hostile session: h2c clients
// holding enough requests in flight, each with an upstream connection of its own, took the
// process to its descriptor limit, and the enforcer exited with "accept4: too many open files").
func TestGuardListenerWhenAcceptRunsOutOfDescriptorsThenItWaitsAndAcceptsAgain(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	client, server := net.Pipe()
	defer func() { _ = client.Close() }()
	fake := &failingListener{Listener: ln, conn: server, errs: []error{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM}}
	g := Guard(fake, "proxy", Limits{Budget: NewBudget(10, 10)}, NewMetrics(prometheus.NewRegistry()))
	start := time.Now()
	c, err := g.Accept()
	if err != nil {
		t.Fatalf("Accept: %v; want it to wait out the shortage and accept", err)
	}
	_ = c.Close()
	if waited := time.Since(start); waited < 5*time.Millisecond || waited > 2*time.Second {
		t.Errorf("waited %v over 4 failures; want a back-off from 5ms, at most 1s each", waited)
	}
}
