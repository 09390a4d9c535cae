package enforcer

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
	adminMaxConns          = 256
	adminMaxConnsPerClient = 64
)

// connBudget counts open connections against a total and a per-address bound. The proxy, the
// check API and Envoy's rate limit service share one, so that their sum, and so the memory their
// connections hold, is bounded; the admin listener has its own.
type connBudget struct {
	// max bounds the open connections in all; perClient those of one client address (the TCP
	// peer: behind an ingress, the ingress pod, so the default leaves room for its pool).
	max, perClient int

	mu    sync.Mutex
	total int
	per   map[netip.Addr]int
}

func newConnBudget(total, perClient int) *connBudget {
	return &connBudget{max: total, perClient: perClient, per: map[netip.Addr]int{}}
}

// admit counts a new connection in, or says which bound it is over.
func (b *connBudget) admit(addr netip.Addr) string {
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

func (b *connBudget) release(addr netip.Addr) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.total--
	if b.per[addr]--; b.per[addr] <= 0 {
		delete(b.per, addr)
	}
}

// connLimits bound the connections of one server.
type connLimits struct {
	budget *connBudget
	// writeTimeout ends a connection whose writes make no progress for that long: a client that
	// stops reading its response holds nothing for ever, however long a stream lasts.
	writeTimeout time.Duration
	// http makes a refused connection get an HTTP answer (429 for its address' bound, 503 for the
	// total) before it is closed; other protocols are closed.
	http bool
}

// guardListener enforces a server's connLimits. A connection over a bound is answered and closed
// as it is accepted, never queued, so a flood from one address stalls no other client.
type guardListener struct {
	net.Listener
	limits  connLimits
	server  string
	refused *prometheus.CounterVec
	open    prometheus.Gauge
}

func newGuardListener(ln net.Listener, server string, limits connLimits, m *connMetrics) *guardListener {
	return &guardListener{Listener: ln, limits: limits, server: server, refused: m.refused, open: m.open.WithLabelValues(server)}
}

func (l *guardListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		addr := netip.Addr{}
		if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
			addr = a.AddrPort().Addr().Unmap()
		}
		if reason := l.limits.budget.admit(addr); reason != "" {
			l.refuse(c, reason)
			continue
		}
		l.open.Inc()
		return &guardedConn{Conn: c, l: l, addr: addr, timeout: l.limits.writeTimeout}, nil
	}
}

func (l *guardListener) release(addr netip.Addr) {
	l.limits.budget.release(addr)
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
	if !l.limits.http {
		_ = c.Close()
		return
	}
	_ = c.SetDeadline(time.Now().Add(time.Second))
	_, _ = c.Write(refusals[reason])
	closeWrite(c)
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

// NetConn is the connection underneath, for closeWrite.
func (c *guardedConn) NetConn() net.Conn { return c.Conn }

// SyscallConn exposes the socket, for holdConn.
func (c *guardedConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

// connMetrics count what the guards do.
type connMetrics struct {
	refused *prometheus.CounterVec
	open    *prometheus.GaugeVec
}

func newConnMetrics(reg prometheus.Registerer) *connMetrics {
	m := &connMetrics{
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
