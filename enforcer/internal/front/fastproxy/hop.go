package fastproxy

import (
	"errors"
	"io"
	"net"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/sluice-dev/sluice/enforcer/internal/upstream"
)

// headerDeadlineConn is a fasthttp upstream connection with the response header timeout: each
// write of the request sets a read deadline that the first byte of the response clears, so that
// a streamed response may last any time once it has begun.
type headerDeadlineConn struct {
	net.Conn
	timeout time.Duration
	waiting bool
}

func (c *headerDeadlineConn) Write(p []byte) (int, error) {
	c.waiting = true
	_ = c.Conn.SetReadDeadline(time.Now().Add(c.timeout))
	return c.Conn.Write(p)
}

func (c *headerDeadlineConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.waiting {
		c.waiting = false
		_ = c.Conn.SetReadDeadline(time.Time{})
	}
	return n, err
}

// SetReadDeadline keeps the header deadline while the response has not begun: fasthttp clears
// the read deadline of a connection after writing a request on it (it sets none of its own).
func (c *headerDeadlineConn) SetReadDeadline(t time.Time) error {
	if t.IsZero() && c.waiting {
		return nil
	}
	return c.Conn.SetReadDeadline(t)
}

// retryOnce is fasthttp's retry rule, net/http's: a request that failed before any byte of its
// response arrived (the upstream closed a pooled connection as it was reused) is sent once more
// on a new connection when it is idempotent and its body can be sent again. fasthttp does not
// retry a streamed body at all.
func retryOnce(req *fasthttp.Request, attempts int, err error) (resetTimeout, retry bool) {
	if attempts > 1 || upstream.IsTimeout(err) {
		return false, false
	}
	if !errors.Is(err, io.EOF) && !errors.Is(err, fasthttp.ErrConnectionClosed) && !errors.Is(err, net.ErrClosed) && !isReset(err) {
		return false, false
	}
	h := &req.Header
	idempotent := h.IsGet() || h.IsHead() || h.IsOptions() || h.IsTrace() || h.IsPut() || h.IsDelete() ||
		len(h.Peek("Idempotency-Key")) > 0 || len(h.Peek("X-Idempotency-Key")) > 0
	return false, idempotent
}

func isReset(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "read" && strings.Contains(oe.Err.Error(), "reset")
}
