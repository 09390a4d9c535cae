// Package panics contains a panic in a request path: the request is answered 500 (gRPC
// INTERNAL), the panic counted in sluice_panics_total{server} and logged with its stack at most
// once a minute, and the server serves on. One request must not stop a security component for
// everyone.
package panics

import (
	"context"
	"fmt"
	"net/http"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Panics contains the panics of the enforcer's request paths.
type Panics struct {
	count *prometheus.CounterVec
	log   logr.Logger
	// logged is when (Unix nanoseconds) a panic was last logged.
	logged atomic.Int64
}

// New counts the panics it contains in reg, and logs them to log.
func New(reg prometheus.Registerer, log logr.Logger) *Panics {
	p := &Panics{log: log, count: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_panics_total",
		Help: "Panics in request paths, by server (proxy, check, rls, admin): each was answered 500 and the server served on.",
	}, []string{"server"})}
	for _, s := range []string{"proxy", "check", "rls", "admin"} {
		p.count.WithLabelValues(s)
	}
	reg.MustRegister(p.count)
	return p
}

// panicHook, when set (by tests, Inject), runs in every request path under the recovery.
var panicHook atomic.Pointer[func(server string)]

// Inject makes every request path of the given server panic until the returned undo runs: for
// tests that show a panic is contained.
func Inject(server string) (undo func()) {
	h := func(s string) {
		if s == server {
			panic("injected into " + s)
		}
	}
	panicHook.Store(&h)
	return func() { panicHook.Store(nil) }
}

// Counter counts the contained panics of a server.
func (p *Panics) Counter(server string) prometheus.Counter { return p.count.WithLabelValues(server) }

func injected(server string) {
	if h := panicHook.Load(); h != nil {
		(*h)(server)
	}
}

// recovered records a recovered panic.
func (p *Panics) recovered(server string, v any) {
	p.count.WithLabelValues(server).Inc()
	now, last := time.Now().UnixNano(), p.logged.Load()
	if now-last >= int64(time.Minute) && p.logged.CompareAndSwap(last, now) {
		p.log.Error(fmt.Errorf("panic: %v", v), "A request panicked: it was answered 500 and the server serves on. Logged at most once a minute; sluice_panics_total counts them all",
			"server", server, "stack", string(debug.Stack()))
	}
}

// Fast contains panics in a fasthttp handler.
func (p *Panics) Fast(server string, h fasthttp.RequestHandler) fasthttp.RequestHandler {
	return func(ctx *fasthttp.RequestCtx) {
		defer func() {
			if v := recover(); v != nil {
				p.recovered(server, v)
				ctx.Response.Reset()
				ctx.SetStatusCode(http.StatusInternalServerError)
				ctx.SetConnectionClose()
			}
		}()
		injected(server)
		h(ctx)
	}
}

// Goroutine contains panics in a goroutine a request started (an upgraded connection's splice):
// it is deferred there.
func (p *Panics) Goroutine(server string) {
	if v := recover(); v != nil {
		p.recovered(server, v)
	}
}

// HTTP contains panics in a net/http handler. http.ErrAbortHandler is net/http's own way to end a
// response midway, and is passed on.
func (p *Panics) HTTP(server string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler { //nolint:errorlint // the sentinel itself is what net/http panics with
					panic(v)
				}
				p.recovered(server, v)
				if r.ProtoMajor == 1 {
					w.Header().Set("Connection", "close")
				}
				w.WriteHeader(http.StatusInternalServerError)
			}
		}()
		injected(server)
		h.ServeHTTP(w, r)
	})
}

// GRPC contains panics in gRPC calls: they end with INTERNAL.
func (p *Panics) GRPC() []grpc.ServerOption {
	internal := func(v any) error {
		p.recovered("rls", v)
		return status.Error(codes.Internal, "internal error")
	}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (_ any, err error) {
			defer func() {
				if v := recover(); v != nil {
					err = internal(v)
				}
			}()
			injected("rls")
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) (err error) {
			defer func() {
				if v := recover(); v != nil {
					err = internal(v)
				}
			}()
			injected("rls")
			return h(srv, ss)
		}),
	}
}
