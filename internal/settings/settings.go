// Package settings holds the enforcer's tunable settings and their defaults, each written once:
// the enforcer binary's flags take them as their defaults, the enforcer gives a field left zero
// its default, and the manager renders the enforcer pods' ports and stop times from them.
package settings

import "time"

// The ports of the enforcer's servers: in the pods the manager renders, and the enforcer
// binary's default addresses.
const (
	ProxyPort = 8080
	CheckPort = 8081
	RLSPort   = 8082
	AdminPort = 9090
)

// Enforcer holds the enforcer's timeouts and bounds.
type Enforcer struct {
	// ReloadInterval is how often the policy file is checked for changes.
	ReloadInterval time.Duration
	// StorePingInterval is how often the store is pinged for the report.
	StorePingInterval time.Duration
	// ShutdownDelay is how long, once told to stop, the enforcer keeps serving while /readyz
	// fails, so that Service endpoints and load balancers drop it before its listeners close.
	// Zero is a setting of its own (stop at once), so WithDefaults leaves it.
	ShutdownDelay time.Duration
	// ShutdownTimeout bounds the drain of in-flight requests after the delay.
	ShutdownTimeout time.Duration
	// ReadTimeout bounds the reading of a request's header block (408 past it); WriteTimeout
	// ends a connection whose writes make no progress for that long; IdleTimeout closes a
	// connection that has carried no request (no stream) for that long. On every listener.
	ReadTimeout, WriteTimeout, IdleTimeout time.Duration
	// MaxConns bounds the open connections of the proxy, the check API and the rate limit
	// service together (503 past it), MaxConnsPerClient those from one address (429).
	MaxConns, MaxConnsPerClient int
	// UpstreamConnectTimeout bounds a connection to the upstream, its TLS handshake included;
	// UpstreamResponseHeaderTimeout the wait for a response header once a request is sent;
	// UpstreamIdleTimeout how long an idle pooled connection is kept, below the keep-alive of
	// common upstreams (gunicorn 2s, Node and uvicorn 5s). A timed-out upstream is 504.
	UpstreamConnectTimeout, UpstreamResponseHeaderTimeout, UpstreamIdleTimeout time.Duration
	// RedisTimeout is the deadline of each Redis call, past which rules apply their failure
	// mode: storage.redis.timeout's default too (api/v1alpha1.DefaultRedisTimeout, held equal
	// by a test).
	RedisTimeout time.Duration
	// MemoryMaxKeys and MemoryMaxBytes bound the memory store; past either it evicts the keys
	// closest to idle. 128 MiB of counted bytes keep the heap well within the rendered 512Mi
	// limit with Go's default GC.
	MemoryMaxKeys  int
	MemoryMaxBytes int64
}

// Defaults are the settings of an enforcer that sets none.
func Defaults() Enforcer {
	return Enforcer{
		ReloadInterval:                time.Second,
		StorePingInterval:             2 * time.Second,
		ShutdownDelay:                 5 * time.Second,
		ShutdownTimeout:               30 * time.Second,
		ReadTimeout:                   10 * time.Second,
		WriteTimeout:                  30 * time.Second,
		IdleTimeout:                   2 * time.Minute,
		MaxConns:                      4_096,
		MaxConnsPerClient:             2_048,
		UpstreamConnectTimeout:        5 * time.Second,
		UpstreamResponseHeaderTimeout: 60 * time.Second,
		UpstreamIdleTimeout:           time.Second,
		RedisTimeout:                  50 * time.Millisecond,
		MemoryMaxKeys:                 1_000_000,
		MemoryMaxBytes:                128 << 20,
	}
}

// WithDefaults is s with every field that is zero or negative at its default, but ShutdownDelay,
// whose zero means no delay.
func (s Enforcer) WithDefaults() Enforcer {
	d := Defaults()
	fill := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
	}
	fill(&s.ReloadInterval, d.ReloadInterval)
	fill(&s.StorePingInterval, d.StorePingInterval)
	fill(&s.ShutdownTimeout, d.ShutdownTimeout)
	fill(&s.ReadTimeout, d.ReadTimeout)
	fill(&s.WriteTimeout, d.WriteTimeout)
	fill(&s.IdleTimeout, d.IdleTimeout)
	fill(&s.UpstreamConnectTimeout, d.UpstreamConnectTimeout)
	fill(&s.UpstreamResponseHeaderTimeout, d.UpstreamResponseHeaderTimeout)
	fill(&s.UpstreamIdleTimeout, d.UpstreamIdleTimeout)
	fill(&s.RedisTimeout, d.RedisTimeout)
	if s.MaxConns <= 0 {
		s.MaxConns = d.MaxConns
	}
	if s.MaxConnsPerClient <= 0 {
		s.MaxConnsPerClient = d.MaxConnsPerClient
	}
	if s.MemoryMaxKeys <= 0 {
		s.MemoryMaxKeys = d.MemoryMaxKeys
	}
	if s.MemoryMaxBytes <= 0 {
		s.MemoryMaxBytes = d.MemoryMaxBytes
	}
	return s
}
