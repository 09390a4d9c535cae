package store_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// calls is how many times Redis ran command (fcall, evalsha, eval), from INFO commandstats:
// rejected calls (an unknown function, a refused user) are not counted.
func calls(t *testing.T, c *redis.Client, command string) int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`cmdstat_` + command + `:calls=(\d+)`).FindStringSubmatch(info)
	if m == nil {
		return 0
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	return n
}

// exactly decides one request of a window of limit in s, and fails unless it passed with want
// remaining: each decision charged once, whichever way its script went.
func exactly(t *testing.T, s store.Store, c store.Check, want int64) {
	t.Helper()
	out := make([]algorithm.Decision, 1)
	if ok, err := s.Decide(context.Background(), []store.Check{c}, out); err != nil || !ok || out[0].Remaining != want {
		t.Fatalf("decision with %d to remain: passed %v, error %v, remaining %d", want, ok, err, out[0].Remaining)
	}
}

// Decisions go by FCALL of the script's library once the store loaded it in the background (or
// found it loaded); a Redis that lost it (FUNCTION FLUSH, as a restart does) has decisions go by
// EVALSHA, each charged once, until it is loaded again.
func TestRedisWhenTheLibraryIsLoadedOrLostThenEachDecisionIsChargedOnce(t *testing.T) {
	tier.Needs(t, "redis-server")
	srv := redistest.NewServer(t)
	admin := srv.Client(t)
	s := newRedis(t, store.RedisOptions{Addrs: []string{srv.Addr()}}, nil)
	c := store.Check{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 1000, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}
	left := c.Limit.Limit
	byFCALL := func(what string) {
		t.Helper()
		before := calls(t, admin, "fcall")
		poll.WaitFor(t, 10*time.Second, func() error {
			left--
			exactly(t, s, c, left)
			if calls(t, admin, "fcall") == before {
				return fmt.Errorf("no decision went by FCALL %s", what)
			}
			return nil
		})
	}
	byFCALL("after the first")
	if err := admin.FunctionFlush(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	evalsha := calls(t, admin, "evalsha")
	left--
	exactly(t, s, c, left) // its FCALL refused: sent again by EVALSHA
	if calls(t, admin, "evalsha") == evalsha {
		t.Fatal("the decision after FUNCTION FLUSH did not go by EVALSHA")
	}
	byFCALL("after FUNCTION FLUSH")

	// Another enforcer finds the library loaded: the same code, by its name.
	s = newRedis(t, store.RedisOptions{Addrs: []string{srv.Addr()}}, nil)
	byFCALL("of another enforcer")
}

// A Redis that refuses functions (a Redis 6, whose FCALL and FUNCTION are unknown commands, or
// an ACL user that may not use them) has every decision go by EVALSHA, charged once, without
// an error.
func TestRedisWhenFunctionsAreRefusedThenDecisionsGoByEVALSHA(t *testing.T) {
	tier.Needs(t, "redis-server")
	for _, c := range []struct {
		name string
		// rules are the ACL rules of the store's user; "" for the default user.
		rules string
	}{
		{"no functions", ""},
		{"a user without FUNCTION", "-function"},
		{"a user without FCALL", "-fcall"},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv, opts := noFunctions, store.RedisOptions{Addrs: []string{noFunctions.Addr()}}
			if c.rules != "" {
				srv = redistest.NewServer(t)
				opts = store.RedisOptions{Addrs: []string{srv.Addr()}, Username: "sluice", Password: "secret"}
				if err := srv.Client(t).Do(context.Background(), "ACL", "SETUSER", "sluice", "on", ">secret", "~*", "+@all", c.rules).Err(); err != nil {
					t.Fatal(err)
				}
			}
			admin := srv.Client(t)
			fcalls, evalsha := calls(t, admin, "fcall"), calls(t, admin, "evalsha")
			s := newRedis(t, opts, nil)
			check := store.Check{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 20, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}
			for i := range 10 {
				exactly(t, s, check, int64(19-i))
			}
			if c.rules == "-fcall" { // the library loads: the next decisions try FCALL
				poll.WaitFor(t, 10*time.Second, poll.True("the library loaded", func() bool {
					libs, err := admin.FunctionList(context.Background(), redis.FunctionListQuery{}).Result()
					return err == nil && len(libs) > 0
				}))
			}
			for i := range 10 {
				exactly(t, s, check, int64(9-i))
			}
			out := make([]algorithm.Decision, 1)
			if ok, err := s.Decide(context.Background(), []store.Check{check}, out); err != nil || ok {
				t.Fatalf("the 21st decision of a window of 20: passed %v, error %v", ok, err)
			}
			if n := calls(t, admin, "fcall") - fcalls; n != 0 {
				t.Errorf("%d FCALLs ran", n)
			}
			if n := calls(t, admin, "evalsha") - evalsha; n < 21 {
				t.Errorf("%d EVALSHAs ran for 21 decisions", n)
			}
		})
	}
}

// A Redis that refuses writes (out of memory, too few replicas) refuses a function that may write
// before it runs, where a script runs until its first write: a request over its limit is still
// refused, without an error (not a failure of the store, whose failure mode would admit it), as
// by EVALSHA.
func TestRedisWhenRedisRefusesWritesThenRequestsOverTheLimitAreStillRefused(t *testing.T) {
	tier.Needs(t, "redis-server")
	srv := redistest.NewServer(t)
	admin := srv.Client(t)
	ctx := context.Background()
	s := newRedis(t, store.RedisOptions{Addrs: []string{srv.Addr()}}, nil)
	poll.WaitFor(t, 10*time.Second, poll.True("the library loaded", s.(*store.Redis).Functions))
	c := store.Check{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 3, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}
	for i := range 3 {
		exactly(t, s, c, int64(2-i))
	}
	for _, refusal := range [][2]string{{"maxmemory", "1"}, {"min-replicas-to-write", "1"}} {
		t.Run(refusal[0], func(t *testing.T) {
			if err := admin.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
				t.Fatal(err)
			}
			if err := admin.ConfigSet(ctx, refusal[0], refusal[1]).Err(); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := admin.ConfigSet(ctx, refusal[0], "0").Err(); err != nil {
					t.Fatal(err)
				}
			}()
			if err := admin.Do(ctx, "FCALL", store.DecideFunction, "0").Err(); err == nil || strings.Contains(err.Error(), "script: ") {
				t.Fatalf("FCALL with %s %s: %v, want it refused before it runs", refusal[0], refusal[1], err)
			}
			out := make([]algorithm.Decision, 1)
			if ok, err := s.Decide(ctx, []store.Check{c}, out); ok || err != nil {
				t.Fatalf("a request over its limit with %s %s: passed %v, error %v; want refused without an error", refusal[0], refusal[1], ok, err)
			}
			if !s.(*store.Redis).Functions() {
				t.Error("the library counts as lost after a refused write")
			}
		})
	}
}

// A library of the decide library's name holding other code (loaded by anyone who may use
// FUNCTION: the name follows from the code, which is public) is never called: decisions go by
// EVALSHA, and stay exact. Here the impostor admits everything.
func TestRedisWhenALibraryOfItsNameHoldsOtherCodeThenItIsNeverCalled(t *testing.T) {
	tier.Needs(t, "redis-server")
	srv := redistest.NewServer(t)
	admin := srv.Client(t)
	ctx := context.Background()
	impostor := "#!lua name=" + store.DecideFunction + "\nredis.register_function('" + store.DecideFunction +
		"', function(keys, args) return {1, 0, 1, 1000, 0, 0, 0, 0} end)\n"
	if err := admin.FunctionLoad(ctx, impostor).Err(); err != nil {
		t.Fatal(err)
	}
	s := newRedis(t, store.RedisOptions{Addrs: []string{srv.Addr()}}, nil)
	poll.WaitFor(t, 10*time.Second, poll.True("the library's code compared", func() bool { return calls(t, admin, "function\\|list") > 0 }))
	c := store.Check{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 5, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}
	passed := 0
	for range 10 {
		ok, err := s.Decide(ctx, []store.Check{c}, make([]algorithm.Decision, 1))
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			passed++
		}
	}
	if passed != 5 {
		t.Errorf("%d of 10 passed a window of 5", passed)
	}
	if n := calls(t, admin, "fcall"); n != 0 {
		t.Errorf("the impostor was called %d times", n)
	}
}

// A Redis demoted to a replica (a failover) refuses the function before it runs, and go-redis
// drops a connection that was answered READONLY: over-limit requests are still refused, and
// calls go by EVALSHA for a while, not by a refused FCALL and a new connection each.
func TestRedisWhenItsRedisBecameAReplicaThenOverLimitRequestsAreRefusedWithoutReconnecting(t *testing.T) {
	tier.Needs(t, "redis-server")
	master, replica := redistest.NewServer(t), redistest.NewServer(t)
	ctx := context.Background()
	s := byFunction(t, newRedis(t, store.RedisOptions{Addrs: []string{replica.Addr()}}, nil))
	m := byFunction(t, newRedis(t, store.RedisOptions{Addrs: []string{master.Addr()}}, nil))
	c := store.Check{Limit: algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 3, Period: time.Hour}, Cost: 1, Enforce: true, Tag: uniqueTag(t), Rule: "r"}
	for i := range 3 {
		exactly(t, m, c, int64(2-i))
	}
	admin := replica.Client(t)
	host, port, _ := strings.Cut(master.Addr(), ":")
	if err := admin.ReplicaOf(ctx, host, port).Err(); err != nil {
		t.Fatal(err)
	}
	poll.WaitFor(t, 10*time.Second, poll.True("the replica in sync", func() bool {
		info, err := admin.Info(ctx, "replication").Result()
		return err == nil && strings.Contains(info, "master_link_status:up")
	}))
	connections := func() int64 {
		m := regexp.MustCompile(`total_connections_received:(\d+)`).FindStringSubmatch(admin.Info(ctx, "stats").Val())
		n, _ := strconv.ParseInt(m[1], 10, 64)
		return n
	}
	before := connections()
	for range 50 {
		if ok, err := s.Decide(ctx, []store.Check{c}, make([]algorithm.Decision, 1)); ok || err != nil {
			t.Fatalf("a request over its limit on the replica: passed %v, error %v; want refused without an error", ok, err)
		}
	}
	if n := connections() - before; n > 5 {
		t.Errorf("%d connections opened for 50 decisions", n)
	}
}
