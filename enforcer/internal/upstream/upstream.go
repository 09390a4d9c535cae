// Package upstream is what both proxies share of the hop to the upstream: the schemes it takes,
// its settings, and how its failures are counted and answered. Which proxy serves which
// combination:
//
//	upstream   client HTTP/1.1                  client h2c (and gRPC)
//	http://    fasthttp, HTTP/1.1 (fast path)   net/http, HTTP/1.1
//	https://   net/http, h2 or HTTP/1.1 (ALPN)  net/http, h2 or HTTP/1.1 (ALPN)
//	h2c://     net/http, h2c                    net/http, h2c
//
// Both proxies bound the hop with the same three timeouts and count its failures alike.
package upstream

import (
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
)

// Schemes are the schemes --upstream takes.
var Schemes = []string{"http", "https", "h2c"}

// ErrTimeout is why a request whose upstream sent no response header in time ended.
var ErrTimeout = errors.New("upstream sent no response header within the response header timeout")

// Options are the hop's settings, from the enforcer's Config.
type Options struct {
	// TLS is the client TLS of an https upstream; nil trusts the system roots and names the
	// URL's host.
	TLS *tls.Config
	// Connect bounds a connection's dial (and TLS handshake); ResponseHeader, the wait for the
	// response header once the request is sent; Idle, how long a pooled connection idles.
	Connect, ResponseHeader, Idle time.Duration
}

// Metrics count the requests the upstream failed, by reason: timeout (504) or error (502:
// refused, reset, a TLS failure).
type Metrics struct{ failures *prometheus.CounterVec }

// NewMetrics registers the hop's metrics with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{failures: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_upstream_failures_total",
		Help: "Proxied requests the upstream failed, by reason: timeout (answered 504) or error (502).",
	}, []string{"reason"})}
	for _, reason := range []string{"timeout", "error"} {
		m.failures.WithLabelValues(reason)
	}
	reg.MustRegister(m.failures)
	return m
}

// Failed counts a failed upstream request and returns the status that answers it.
func (m *Metrics) Failed(err error) int {
	if IsTimeout(err) {
		m.failures.WithLabelValues("timeout").Inc()
		return http.StatusGatewayTimeout
	}
	m.failures.WithLabelValues("error").Inc()
	return http.StatusBadGateway
}

// IsTimeout reports whether an upstream request failed for want of time, on either proxy.
func IsTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, fasthttp.ErrTimeout) ||
		errors.Is(err, fasthttp.ErrDialTimeout) || (errors.As(err, &ne) && ne.Timeout())
}
