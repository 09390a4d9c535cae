// Package sniff splits one listener in two by the first bytes of each connection: cleartext
// HTTP/2 with prior knowledge, and the rest.
package sniff

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"syscall"
	"time"
)

// h2Preface opens every cleartext HTTP/2 connection with prior knowledge (RFC 9113, 3.4).
const h2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

var preface = []byte(h2Preface)

// Listener accepts connections on one listener and hands each to one of two others by its first
// bytes: those that open with the HTTP/2 preface to H2, the rest to H1. The first bytes
// are read in a goroutine of the connection's own, within timeout, so a slow client holds up
// nobody; one that sends nothing in time is closed, as the servers' own read timeouts would.
type Listener struct {
	ln      net.Listener
	timeout time.Duration
	h1, h2  *chanListener
	once    sync.Once
}

// Split starts splitting the connections of ln, each read for its first bytes within timeout.
func Split(ln net.Listener, timeout time.Duration) *Listener {
	s := &Listener{ln: ln, timeout: timeout, h1: newChanListener(ln.Addr()), h2: newChanListener(ln.Addr())}
	go s.accept()
	return s
}

func (s *Listener) accept() {
	var delay time.Duration
	for {
		c, err := s.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				// Out of file descriptors or the like: back off as net/http does.
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				time.Sleep(delay)
				continue
			}
			s.close(err)
			return
		}
		delay = 0
		go s.route(c)
	}
}

// route reads until the bytes received either stop matching the preface or complete it.
func (s *Listener) route(c net.Conn) {
	_ = c.SetReadDeadline(time.Now().Add(s.timeout))
	buf := make([]byte, len(h2Preface))
	n := 0
	for n < len(buf) && bytes.HasPrefix(preface, buf[:n]) {
		m, err := c.Read(buf[n:])
		n += m
		if err != nil && bytes.HasPrefix(preface, buf[:n]) {
			_ = c.Close() // nothing, or a part of the preface, then silence or the end
			return
		}
	}
	_ = c.SetReadDeadline(time.Time{})
	to := s.h1
	if bytes.Equal(buf[:n], preface) {
		to = s.h2
	}
	if !to.deliver(&prefixConn{Conn: c, prefix: buf[:n]}) {
		_ = c.Close()
	}
}

// H1 accepts the connections that do not open with the HTTP/2 preface.
func (s *Listener) H1() net.Listener { return s.h1 }

// H2 accepts the connections that open with the HTTP/2 preface.
func (s *Listener) H2() net.Listener { return s.h2 }

// Close stops accepting; connections already handed over stay with their servers.
func (s *Listener) Close() error {
	err := s.ln.Close()
	s.close(net.ErrClosed)
	return err
}

func (s *Listener) close(err error) {
	s.once.Do(func() {
		s.h1.close(err)
		s.h2.close(err)
	})
}

// chanListener is a net.Listener fed with connections by a Listener.
type chanListener struct {
	addr   net.Addr
	conns  chan net.Conn
	done   chan struct{}
	err    error
	closed sync.Once
}

func newChanListener(addr net.Addr) *chanListener {
	return &chanListener{addr: addr, conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *chanListener) deliver(c net.Conn) bool {
	select {
	case l.conns <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, l.err
	}
}

func (l *chanListener) close(err error) {
	l.closed.Do(func() {
		l.err = err
		close(l.done)
	})
}

// Close of one side closes that side only; the Listener's Close stops both.
func (l *chanListener) Close() error {
	l.close(net.ErrClosed)
	return nil
}

func (l *chanListener) Addr() net.Addr { return l.addr }

// prefixConn replays the bytes read to route a connection before reading on.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// SyscallConn exposes the socket, for conns.Hold and conns.WatchClient.
func (c *prefixConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}
