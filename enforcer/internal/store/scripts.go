package store

import (
	"context"
	"crypto/sha1"
	_ "embed" // the scripts are embedded
	"encoding/hex"
	"errors"
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

// library is the code of a function library holding body, whose function run(keys, args) it
// registers, and the name that calls it.
func library(name, body string) (code, function string) {
	sum := sha1.Sum([]byte(body))
	lib := "sluice_" + name + "_" + hex.EncodeToString(sum[:8])
	return "#!lua name=" + lib + "\n" + body +
		"\nredis.register_function('" + lib + "', function(keys, args) return run(keys, args) end)\n", lib
}

// How soon a library may be loaded again after a load that failed: soon when Redis did not answer,
// seldom when it refused (a Redis without functions, or an ACL user without FUNCTION).
const (
	reloadAfterFailure = time.Second
	reloadAfterRefusal = time.Minute
)

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
	// library and function are the library's code and its function's name; "" for none.
	library, function string
	// loaded is true while calls go by FCALL.
	loaded atomic.Bool
	// next is when a load may start, in Unix nanoseconds; a load in flight holds it at its end.
	next atomic.Int64
	mu   sync.Mutex
	// ctx ends the load in flight at close, which waits for it.
	ctx     context.Context
	cancel  context.CancelFunc
	loading sync.WaitGroup
}

func newScripts(client redis.UniversalClient, script *redis.Script, library, function string) *scripts {
	ctx, cancel := context.WithCancel(context.Background())
	return &scripts{client: client, script: script, library: library, function: function, ctx: ctx, cancel: cancel}
}

// close ends the load in flight, if any, and waits for it; none starts after.
func (s *scripts) close() {
	s.mu.Lock()
	s.cancel()
	s.mu.Unlock()
	s.loading.Wait()
}

// run sends each call's decide script in one pipeline, and hands each its reply.
func (s *scripts) run(ctx context.Context, calls []*scriptCall) {
	var retry []*scriptCall
	if s.loaded.Load() {
		cmds := exec(ctx, s.client, calls, func(p redis.Pipeliner, c *scriptCall) *redis.Cmd {
			return p.FCall(ctx, s.function, c.keys, c.args...)
		})
		refusedAny := false
		for i, c := range calls {
			if why := notRun(cmds[i].Err()); why != ran {
				refusedAny = refusedAny || why == refused
				retry = append(retry, c)
				continue
			}
			c.reply, c.err = cmds[i].Result()
		}
		if len(retry) == 0 {
			return
		}
		s.loaded.Store(false)
		if refusedAny {
			s.next.Store(time.Now().Add(reloadAfterRefusal).UnixNano())
		}
		calls = retry
	}
	s.load()
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
)

// notRun reports whether an FCALL's error says that the function did not run, and why.
func notRun(err error) int {
	var reply redis.Error
	if !errors.As(err, &reply) {
		return ran
	}
	msg := strings.ToLower(reply.Error())
	switch {
	case strings.HasPrefix(msg, "err function not found"):
		return missing
	case strings.HasPrefix(msg, "err unknown command") && strings.Contains(msg, "fcall"),
		strings.HasPrefix(msg, "noperm") && strings.Contains(msg, "'fcall'"):
		return refused
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
		ctx, cancel := context.WithTimeout(s.ctx, 10*time.Second)
		defer cancel()
		err := s.loadAll(ctx)
		var reply redis.Error
		switch {
		case err == nil:
			s.loaded.Store(true)
			s.next.Store(time.Now().Add(reloadAfterFailure).UnixNano()) // at most one a second
		case errors.As(err, &reply):
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
		if errors.As(err, &reply) && strings.HasPrefix(reply.Error(), "ERR Library '") && strings.HasSuffix(reply.Error(), "' already exists") {
			return nil // loaded by another enforcer, or kept since: the same code, by its name
		}
		return err
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
