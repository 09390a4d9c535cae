// Package conns holds what the enforcer does with connections themselves, under any protocol:
// the guards of every listener (bounds on open connections, in all and per client address, and a
// write deadline that moves with progress), and the watch of a socket for a client that left,
// which fasthttp cannot tell its handlers.
package conns

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Bounds of the admin listener, which has a budget of its own: probes and scrapes are served
// however many connections the traffic listeners hold.
const (
	AdminMaxConns          = 256
	AdminMaxConnsPerClient = 64
)

// Budget counts open connections against a total and a per-address bound. The proxy, the
// check API and Envoy's rate limit service share one, so that their sum, and so the memory their
// connections hold, is bounded; the admin listener has its own.
type Budget struct {
	// max bounds the open connections in all; perClient those of one client address (the TCP
	// peer: behind an ingress, the ingress pod, so the default leaves room for its pool).
	max, perClient int

	mu    sync.Mutex
	total int
	per   map[netip.Addr]int
}

// NewBudget is a budget of total connections, perClient of them from one address.
func NewBudget(total, perClient int) *Budget {
	return &Budget{max: total, perClient: perClient, per: map[netip.Addr]int{}}
}

// admit counts a new connection in, or says which bound it is over.
func (b *Budget) admit(addr netip.Addr) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.total >= b.max:
		return "total"
	case b.per[addr] >= b.perClient:
		return "client"
	}
	b.total++
	b.per[addr]++
	return ""
}

func (b *Budget) release(addr netip.Addr) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.total--
	if b.per[addr]--; b.per[addr] <= 0 {
		delete(b.per, addr)
	}
}

// Limits bound the connections of one server.
type Limits struct {
	Budget *Budget
	// WriteTimeout ends a connection whose writes make no progress for that long: a client that
	// stops reading its response holds nothing for ever, however long a stream lasts.
	WriteTimeout time.Duration
	// HTTP makes a refused connection get an HTTP answer (429 for its address' bound, 503 for the
	// total) before it is closed; other protocols are closed.
	HTTP bool
}

// guardListener enforces a server's Limits. A connection over a bound is answered and closed
// as it is accepted, never queued, so a flood from one address stalls no other client.
type guardListener struct {
	net.Listener
	limits  Limits
	server  string
	refused *prometheus.CounterVec
	open    prometheus.Gauge
}

// Guard enforces limits on the connections ln accepts for server, counting them in m.
func Guard(ln net.Listener, server string, limits Limits, m *Metrics) net.Listener {
	return &guardListener{Listener: ln, limits: limits, server: server, refused: m.refused, open: m.open.WithLabelValues(server)}
}

func (l *guardListener) Accept() (net.Conn, error) {
	var delay time.Duration
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if !acceptPasses(err) {
				return nil, err
			}
			// Out of file descriptors or kernel memory: wait and accept again, as net/http's
			// servers do. Returned, the error would stop fasthttp's servers and the proxy's
			// split listener, and the enforcer with them.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			time.Sleep(delay)
			continue
		}
		delay = 0
		addr := netip.Addr{}
		if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
			addr = a.AddrPort().Addr().Unmap()
		}
		if reason := l.limits.Budget.admit(addr); reason != "" {
			l.refuse(c, reason)
			continue
		}
		l.open.Inc()
		return &guardedConn{Conn: c, l: l, addr: addr, timeout: l.limits.WriteTimeout}, nil
	}
}

// acceptPasses reports whether an Accept error passes with time rather than ending the
// listener: a timeout, or a shortage of file descriptors (EMFILE, ENFILE) or kernel memory
// (ENOBUFS, ENOMEM), which ends as connections close.
func acceptPasses(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	for _, errno := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM} {
		if errors.Is(err, errno) {
			return true
		}
	}
	return false
}

func (l *guardListener) release(addr netip.Addr) {
	l.limits.Budget.release(addr)
	l.open.Dec()
}

var refusals = map[string][]byte{
	"total":  httpRefusal(503, "Service Unavailable", "the enforcer holds its maximum of connections; retry later\n"),
	"client": httpRefusal(429, "Too Many Requests", "too many connections from this address\n"),
}

func httpRefusal(status int, text, body string) []byte {
	return []byte("HTTP/1.1 " + strconv.Itoa(status) + " " + text + "\r\nConnection: close\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
}

// lingering bounds the refused connections read to their end at once: closing a socket with
// unread bytes resets it, and a reset can reach the client before the answer does.
var lingering = make(chan struct{}, 256)

// refuse answers a connection over a bound and closes it. The answer fits a fresh socket's send
// buffer, so the write does not block the accept loop; the deadline makes sure of it.
func (l *guardListener) refuse(c net.Conn, reason string) {
	l.refused.WithLabelValues(l.server, reason).Inc()
	if !l.limits.HTTP {
		_ = c.Close()
		return
	}
	_ = c.SetDeadline(time.Now().Add(time.Second))
	_, _ = c.Write(refusals[reason])
	CloseWrite(c)
	select {
	case lingering <- struct{}{}:
		go func() {
			defer func() { <-lingering }()
			_, _ = io.Copy(io.Discard, io.LimitReader(c, 64<<10))
			_ = c.Close()
		}()
	default: // a flood: no answer is worth a goroutine each
		_ = c.Close()
	}
}

// guardedConn is an admitted connection: it leaves the count when closed, and its writes have a
// progress deadline.
type guardedConn struct {
	net.Conn
	l       *guardListener
	addr    netip.Addr
	timeout time.Duration
	// armed is when (Unix nanoseconds) the write deadline was last moved; it moves again once
	// half of it is spent, so a stream of small writes does not pay for a deadline each.
	armed  atomic.Int64
	closed sync.Once
}

func (c *guardedConn) Write(p []byte) (int, error) {
	if c.timeout > 0 {
		if now := time.Now(); now.UnixNano()-c.armed.Load() > int64(c.timeout/2) {
			c.armed.Store(now.UnixNano())
			_ = c.Conn.SetWriteDeadline(now.Add(c.timeout))
		}
	}
	return c.Conn.Write(p)
}

// SetWriteDeadline is the server's own: it replaces the progress deadline until the next write
// that moves it.
func (c *guardedConn) SetWriteDeadline(t time.Time) error {
	c.armed.Store(0)
	return c.Conn.SetWriteDeadline(t)
}

func (c *guardedConn) SetDeadline(t time.Time) error {
	c.armed.Store(0)
	return c.Conn.SetDeadline(t)
}

func (c *guardedConn) Close() error {
	err := c.Conn.Close()
	c.closed.Do(func() { c.l.release(c.addr) })
	return err
}

// NetConn is the connection underneath, for CloseWrite.
func (c *guardedConn) NetConn() net.Conn { return c.Conn }

// SyscallConn exposes the socket, for Hold and Watch.
func (c *guardedConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

// Metrics count what the guards do.
type Metrics struct {
	refused *prometheus.CounterVec
	open    *prometheus.GaugeVec
}

// NewMetrics registers the guards' metrics with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_connections_refused_total",
			Help: "Connections refused as they were accepted, by server and by the bound they were over (total, client).",
		}, []string{"server", "reason"}),
		open: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_connections_open", Help: "Open connections by server.",
		}, []string{"server"}),
	}
	reg.MustRegister(m.refused, m.open)
	return m
}

// CloseWrite half-closes a connection, so the other end sees the end of the stream and still
// sends what it has; a connection that cannot half-close is closed.
func CloseWrite(c net.Conn) {
	type closeWriter interface{ CloseWrite() error }
	for {
		switch v := c.(type) {
		case closeWriter:
			_ = v.CloseWrite()
			return
		case interface{ NetConn() net.Conn }:
			c = v.NetConn()
			continue
		}
		_ = c.Close()
		return
	}
}
