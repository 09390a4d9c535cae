package store_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
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
