package store

import (
	"context"
	"crypto/sha1"
	_ "embed" // the scripts are embedded
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed scripts/decide.lua
	decideLua string
	// decideScript is decide.lua as a script, for EVALSHA and EVAL: Lua makes its helpers anew
	// on every call.
	decideScript = redis.NewScript(decideLua + "\nreturn run(KEYS, ARGV)\n")
	// decideLibrary is decide.lua as a Redis function library (Redis 7): its helpers are made
	// once, when it is loaded, and each call only runs. Its name is its code's hash, so that
	// enforcers of two versions never call each other's.
	decideLibrary, decideFunction = library("decide", decideLua)

	//go:embed scripts/refund.lua
	refundLua    string
	refundScript = redis.NewScript(refundLua)
)

// libraryCode is a function library of one function, named as the library, that calls the
// body's run(keys, args).
const libraryCode = "#!lua name=%[1]s\n%[2]s\nredis.register_function('%[1]s', function(keys, args) return run(keys, args) end)\n"

// library is the code of a function library holding body, and the name that calls it: a hash of
// the code, so that two codes never share a name.
func library(name, body string) (code, function string) {
	sum := sha1.Sum([]byte(fmt.Sprintf(libraryCode, "", body)))
	lib := "sluice_" + name + "_" + hex.EncodeToString(sum[:8])
	return fmt.Sprintf(libraryCode, lib, body), lib
}

// errForeignLibrary is a library of the decide library's name but other code, on a server.
var errForeignLibrary = errors.New("a library of the decide library's name holds other code")

// How soon a library may be loaded again after a load that failed: soon when Redis did not answer,
// seldom when it refused (a Redis without functions, or an ACL user without FUNCTION).
const (
	reloadAfterFailure = time.Second
	reloadAfterRefusal = time.Minute
)

// evalWhileDenied is how long calls go by EVALSHA after Redis refused an FCALL a write.
const evalWhileDenied = time.Second

// scripts runs the decide script on one Redis deployment: by FCALL once its library is loaded,
// by EVALSHA (EVAL when Redis forgot the script) before that and wherever Redis has no functions
// or refuses them. Loading happens in the background: no decision waits for it.
//
// A call whose FCALL did not run (the function is not loaded: Redis restarted, or a Cluster node
// is new; FCALL is unknown or not permitted) is sent again by EVALSHA at once, and the library
// is loaded again. Nothing that ran is ever sent twice.
type scripts struct {
	client redis.UniversalClient
	script *redis.Script
	// library and function are the library's code and its function's name, which is the
	// library's too; "" for none.
	library, function string
	// loaded is true while calls go by FCALL.
	loaded atomic.Bool
	// next is when a load may start, in Unix nanoseconds; a load in flight holds it at its end.
	next atomic.Int64
	// deniedUntil is when calls may go by FCALL again after Redis refused it a write (Unix
	// nanoseconds): meanwhile they go by EVALSHA at once, without an FCALL refused first (and,
	// on a replica, the connection go-redis closes after a READONLY reply).
	deniedUntil atomic.Int64
	mu          sync.Mutex
	// timeout bounds each load; ctx ends at close, which waits for the load in flight.
	timeout time.Duration
	ctx     context.Context
	cancel  context.CancelFunc
	loading sync.WaitGroup
}

// newScripts runs script, and the library's function where Redis takes it; each load of the
// library takes at most timeout, but at least a second (Redis compiles it).
func newScripts(client redis.UniversalClient, script *redis.Script, library, function string, timeout time.Duration) *scripts {
	ctx, cancel := context.WithCancel(context.Background())
	return &scripts{client: client, script: script, library: library, function: function,
		timeout: max(timeout, time.Second), ctx: ctx, cancel: cancel}
}

// close stops loads: none starts after it, and it waits for the one in flight, which its
// timeout bounds (a read blocked on Redis does not see a cancel).
func (s *scripts) close() {
	s.mu.Lock()
	s.cancel()
	s.mu.Unlock()
	s.loading.Wait()
}

// run sends each call's decide script in one pipeline, and hands each its reply.
func (s *scripts) run(ctx context.Context, calls []*scriptCall) {
	var retry []*scriptCall
	if s.loaded.Load() && time.Now().UnixNano() >= s.deniedUntil.Load() {
		cmds := exec(ctx, s.client, calls, func(p redis.Pipeliner, c *scriptCall) *redis.Cmd {
			return p.FCall(ctx, s.function, c.keys, c.args...)
		})
		var lost, refusedAny, deniedAny bool
		for i, c := range calls {
			why := notRun(cmds[i].Err())
			if why == ran {
				c.reply, c.err = cmds[i].Result()
				continue
			}
			retry = append(retry, c)
			lost = lost || why == missing || why == refused
			refusedAny = refusedAny || why == refused
			deniedAny = deniedAny || why == denied
		}
		if len(retry) == 0 {
			return
		}
		if lost {
			s.loaded.Store(false)
		}
		if refusedAny {
			s.next.Store(time.Now().Add(reloadAfterRefusal).UnixNano())
		}
		if deniedAny {
			s.deniedUntil.Store(time.Now().Add(evalWhileDenied).UnixNano())
		}
		calls = retry
	}
	if !s.loaded.Load() {
		s.load()
	}
	cmds := exec(ctx, s.client, calls, func(p redis.Pipeliner, c *scriptCall) *redis.Cmd {
		return s.script.EvalSha(ctx, p, c.keys, c.args...)
	})
	// NOSCRIPT means the script did not run: Redis forgot it. Send those again with its body.
	var again []*scriptCall
	for i, c := range calls {
		if err := cmds[i].Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			again = append(again, c)
			continue
		}
		c.reply, c.err = cmds[i].Result()
	}
	if len(again) == 0 {
		return
	}
	cmds = exec(ctx, s.client, again, func(p redis.Pipeliner, c *scriptCall) *redis.Cmd {
		return s.script.Eval(ctx, p, c.keys, c.args...)
	})
	for i, c := range again {
		c.reply, c.err = cmds[i].Result()
	}
}

// What an FCALL's error says of the function.
const (
	ran     = iota // it ran (its error, if any, is its own)
	missing        // it is not loaded on that server: load it
	refused        // the server has no FCALL, or the user may not call it: use EVALSHA
	// denied: the server refuses writes now (out of memory, too few replicas, a replica, a failed
	// save), and a function that may write is refused before it runs, where a script runs until
	// its first write: a refusal that writes nothing is still answered. Sent by EVALSHA, as
	// before the library, and so are the calls of the next evalWhileDenied.
	denied
)

// notRun reports whether an FCALL's error says that the function did not run, and why. Errors
// that a running function raised name it ("script: <name>"): those ran.
func notRun(err error) int {
	var reply redis.Error
	if !errors.As(err, &reply) {
		return ran
	}
	msg := reply.Error()
	if strings.Contains(msg, "script: ") {
		return ran
	}
	lower := strings.ToLower(msg)
	switch {
	case strings.HasPrefix(msg, "ERR Function not found"):
		return missing
	case strings.HasPrefix(msg, "ERR unknown command") && strings.Contains(lower, "fcall"),
		strings.HasPrefix(msg, "NOPERM") && strings.Contains(lower, "'fcall'"):
		return refused
	case strings.HasPrefix(msg, "OOM "), strings.HasPrefix(msg, "NOREPLICAS "),
		strings.HasPrefix(msg, "READONLY "), strings.HasPrefix(msg, "MISCONF "):
		return denied
	}
	return ran
}

// load loads the library in the background, on every master of a Cluster, unless a load is in
// flight or failed too recently; calls go by FCALL once it is loaded everywhere.
func (s *scripts) load() {
	if s.library == "" || time.Now().UnixNano() < s.next.Load() {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if time.Now().UnixNano() < s.next.Load() || s.ctx.Err() != nil {
		return // another call started it meanwhile, or the store closed
	}
	s.next.Store(math.MaxInt64) // until this one ends
	s.loading.Add(1)
	go func() {
		defer s.loading.Done()
		ctx, cancel := context.WithTimeout(s.ctx, s.timeout)
		defer cancel()
		err := s.loadAll(ctx)
		var reply redis.Error
		switch {
		case err == nil:
			s.loaded.Store(true)
			s.next.Store(time.Now().Add(reloadAfterFailure).UnixNano()) // at most one a second
		case errors.As(err, &reply), errors.Is(err, errForeignLibrary):
			s.next.Store(time.Now().Add(reloadAfterRefusal).UnixNano())
		default:
			s.next.Store(time.Now().Add(reloadAfterFailure).UnixNano())
		}
	}()
}

func (s *scripts) loadAll(ctx context.Context) error {
	one := func(ctx context.Context, c *redis.Client) error {
		err := c.FunctionLoad(ctx, s.library).Err()
		var reply redis.Error
		if !errors.As(err, &reply) || !strings.HasPrefix(reply.Error(), "ERR Library '") || !strings.HasSuffix(reply.Error(), "' already exists") {
			return err
		}
		// Loaded by another enforcer, or kept since; or by someone else under its name, which
		// anyone may compute: its code must be this one, or FCALL would decide by another's.
		libs, err := c.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: s.function, WithCode: true}).Result()
		if err != nil {
			return err
		}
		for _, l := range libs {
			if l.Name == s.function && l.Code == s.library {
				return nil
			}
		}
		return errForeignLibrary
	}
	switch c := s.client.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, one)
	case *redis.Client:
		return one(ctx, c)
	default:
		return errors.New("unknown client")
	}
}

// exec sends one command per call in one pipeline; each command carries its own error.
func exec(ctx context.Context, client redis.UniversalClient, calls []*scriptCall, add func(redis.Pipeliner, *scriptCall) *redis.Cmd) []*redis.Cmd {
	p := client.Pipeline()
	cmds := make([]*redis.Cmd, len(calls))
	for i, c := range calls {
		cmds[i] = add(p, c)
	}
	_, _ = p.Exec(ctx)
	return cmds
}
