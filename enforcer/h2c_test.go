package enforcer_test

import (
	"bytes"
	"net"
	"strconv"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// h2cConn is a raw cleartext HTTP/2 connection with prior knowledge: it sends pseudo-header
// fields exactly as given, which net/http's client checks and cleans first.
type h2cConn struct {
	t    *testing.T
	conn net.Conn
	fr   *http2.Framer
	next uint32
}

func dialH2C(t *testing.T, addr string) *h2cConn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	c := &h2cConn{t: t, conn: conn, fr: http2.NewFramer(conn, conn), next: 1}
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := c.fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return c
}

// send opens a stream with a GET of no body and returns its ID.
func (c *h2cConn) send(path string, header ...string) uint32 {
	c.t.Helper()
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	fields := append([]string{":method", "GET", ":scheme", "http", ":authority", "enforcer", ":path", path}, header...)
	for i := 0; i+1 < len(fields); i += 2 {
		_ = enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	id := c.next
	c.next += 2
	if err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		c.t.Fatal(err)
	}
	return id
}

// status reads frames until the response header of stream id arrives, and returns its status;
// -1 if the server ends the stream or the connection first.
func (c *h2cConn) status(id uint32) int {
	c.t.Helper()
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			return -1
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = c.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				_ = c.fr.WritePing(true, f.Data)
			}
		case *http2.GoAwayFrame:
			return -1
		case *http2.RSTStreamFrame:
			if f.StreamID == id {
				return -1
			}
		case *http2.MetaHeadersFrame:
			if f.StreamID == id {
				s, _ := strconv.Atoi(f.PseudoValue("status"))
				return s
			}
		}
	}
}

// h2cStatus sends one GET on a connection of its own and returns the status.
func h2cStatus(t *testing.T, addr, path string, header ...string) int {
	t.Helper()
	c := dialH2C(t, addr)
	defer func() { _ = c.conn.Close() }()
	return c.status(c.send(path, header...))
}
