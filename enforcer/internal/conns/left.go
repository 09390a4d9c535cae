package conns

import (
	"errors"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Hold keeps a request for wait, as a leaky bucket's queue does, and reports false if the
// client closed its connection meanwhile, at once. fasthttp tells its handlers nothing of the
// connection, and reading it would take bytes from the next request; so the socket is watched
// with MSG_PEEK, which sees the end of the stream, or a reset, without consuming anything. A
// connection that is not a socket, or that has bytes waiting (a pipelined request), is held
// for the whole wait.
func Hold(c net.Conn, wait time.Duration) bool {
	if wait <= 0 {
		return true
	}
	deadline := time.Now().Add(wait)
	sc, ok := c.(syscall.Conn)
	if !ok {
		time.Sleep(wait)
		return true
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		time.Sleep(wait)
		return true
	}
	// The poller wakes the read below when the socket becomes readable, or when the deadline
	// passes. The server sets its own deadline again before it reads the next request.
	if err := c.SetReadDeadline(deadline); err != nil {
		time.Sleep(wait)
		return true
	}
	defer func() { _ = c.SetReadDeadline(time.Time{}) }()
	left, waiting := false, false
	var b [1]byte
	err = raw.Read(func(fd uintptr) bool {
		n, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		switch {
		case errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR):
			return false // nothing yet: wait for readability or the deadline
		case err != nil || n == 0:
			left = true // a reset, or the end of the stream
		default:
			waiting = true
		}
		return true
	})
	if left {
		return false
	}
	if waiting || err == nil {
		time.Sleep(time.Until(deadline))
	}
	return true
}

// Watch watches a client's connection while its request is forwarded, and closes the request's
// upstream connection as soon as the client leaves (the end of its stream, or a reset), seen
// with MSG_PEEK as Hold sees it, consuming nothing. fasthttp reads nothing of
// the connection meanwhile: it reads the next request only once the response is written. A
// connection that has bytes waiting (a pipelined request) cannot tell: the watch then ends
// without a verdict.
type Watch struct {
	client net.Conn
	raw    syscall.RawConn
	gone   bool
	done   chan struct{}
}

// WatchClient starts watching client for up's sake; a client that is no socket is not watched.
func WatchClient(client, up net.Conn) *Watch {
	w := &Watch{client: client, done: make(chan struct{})}
	sc, ok := client.(syscall.Conn)
	if ok {
		w.raw, _ = sc.SyscallConn()
	}
	if w.raw == nil {
		close(w.done)
		return w
	}
	go func() {
		defer close(w.done)
		var b [1]byte
		_ = w.raw.Read(func(fd uintptr) bool {
			n, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
			switch {
			case errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR):
				return false // nothing yet: wait for readability, or for Stop's deadline
			case err != nil || n == 0:
				w.gone = true // a reset, or the end of the stream
			}
			return true
		})
		if w.gone {
			_ = up.Close()
		}
	}()
	return w
}

// Stop ends the watch, and reports whether the client left. The connection's read deadline is
// clear again after it, for the server to set its own.
func (w *Watch) Stop() bool {
	if w.raw != nil {
		_ = w.client.SetReadDeadline(time.Unix(1, 0)) // wakes the watch's read
		<-w.done
		_ = w.client.SetReadDeadline(time.Time{})
	}
	return w.gone
}
