package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// The races of leased units with Redis and with each other, each forced in one order: a test
// holds a decision between the units it reserved and its script, and moves the others (or the
// clock) on meanwhile.

// twoEnforcers are two Redis stores on the standalone Redis and one fake clock from start; g
// holds the first's lease scripts.
func twoEnforcers(t *testing.T, start time.Time) (clock *clocktesting.FakeClock, s, other store.Store, g *gates) {
	t.Helper()
	clock = clocktesting.NewFakeClock(start)
	stores := enforcers(t, 2, store.RedisOptions{Addrs: []string{standalone.Addr()}}, clock.Now)
	return clock, stores[0], stores[1], holdScripts(stores[0])
}

// gates hold the leases' scripts (a trip's or a refill's) of one store, in the order they are sent.
type gates struct {
	mu      sync.Mutex
	pending []*gate
}

// gate holds one script: reached closes when it is about to be sent, and it is sent once open
// is closed.
type gate struct{ reached, open chan struct{} }

func holdScripts(s store.Store) *gates {
	g := &gates{}
	s.(*store.Redis).BeforeLeaseScript(g.wait)
	return g
}

// holdAnswers is holdScripts for the answers, each held before it is noted.
func holdAnswers(s store.Store) *gates {
	g := &gates{}
	s.(*store.Redis).BeforeLeaseAnswer(g.wait)
	return g
}

// next holds the next script sent that no gate holds yet.
func (g *gates) next() *gate {
	g.mu.Lock()
	defer g.mu.Unlock()
	x := &gate{reached: make(chan struct{}), open: make(chan struct{})}
	g.pending = append(g.pending, x)
	return x
}

func (g *gates) wait() {
	g.mu.Lock()
	if len(g.pending) == 0 {
		g.mu.Unlock()
		return
	}
	x := g.pending[0]
	g.pending = g.pending[1:]
	g.mu.Unlock()
	close(x.reached)
	<-x.open
}

func admit(t *testing.T, s store.Store, checks ...store.Check) bool {
	t.Helper()
	ok, err := s.Decide(context.Background(), checks, make([]algorithm.Decision, len(checks)))
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// decidedWhile sends the request of checks through s, holds its script once it reserved its
// units, runs meanwhile, lets it go on, and reports whether it passed.
func decidedWhile(t *testing.T, g *gates, s store.Store, meanwhile func(), checks ...store.Check) bool {
	t.Helper()
	held := g.next()
	passed := make(chan bool)
	go func() {
		ok, err := s.Decide(context.Background(), checks, make([]algorithm.Decision, len(checks)))
		if err != nil {
			t.Error(err)
		}
		passed <- ok
	}()
	<-held.reached
	meanwhile()
	close(held.open)
	return <-passed
}

// refusedWhile is decidedWhile for a request that the rule spent refuses.
func refusedWhile(t *testing.T, g *gates, s store.Store, meanwhile func(), checks ...store.Check) {
	t.Helper()
	if decidedWhile(t, g, s, meanwhile, checks...) {
		t.Fatal("the request that the spent rule refuses was not refused")
	}
}

// admitted is how many of n requests of c pass through s, one after the other.
func admitted(t *testing.T, s store.Store, c store.Check, n int) int {
	t.Helper()
	passed := 0
	for range n {
		if admit(t, s, c) {
			passed++
		}
		s.(*store.Redis).WaitRefills()
	}
	return passed
}

// spent is a rule that refuses every request but its first, for a month.
func spent(t *testing.T, s store.Store, tag string) store.Check {
	t.Helper()
	c := store.Check{Limit: algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 1, Rate: 1, Period: 720 * time.Hour}, Cost: 1, Enforce: true, Tag: tag, Rule: "spent"}
	if !admit(t, s, c) {
		t.Fatal("the first request of the spent rule was refused")
	}
	return c
}

// A request covered by the units held that another rule refuses gives them back, unless a take
// replaced the lease meanwhile: a take in the next window of a fixed window holds that window's
// units only, and the units given back, the last window's, would make 14 pass in a window of 10.
func TestLeasesWhenARefusedRequestsUnitsWereReplacedByANewWindowsTakeThenTheyAreNotGivenBack(t *testing.T) {
	tier.Needs(t, "redis-server")
	clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0).Truncate(time.Hour).Add(30 * time.Minute))
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, clock.Now)
	g := holdScripts(s)
	tag := uniqueTag(t)
	a := leased(algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Hour}, tag, "a", 1, 5, time.Minute)
	refusing := spent(t, s, tag)
	if !admit(t, s, a) { // takes 5, holds 4
		t.Fatal("the first request was refused")
	}
	all := a
	all.Cost = 4
	passed := 0
	refusedWhile(t, g, s, func() {
		clock.Step(31 * time.Minute)
		passed = admitted(t, s, a, 1) // the next window: a take
	}, all, refusing)
	if passed += admitted(t, s, a, 30); passed != 10 {
		t.Fatalf("%d passed in a window of 10", passed)
	}
}

// The token bucket's form: a take, or a refill sent after the request took its units, records
// that this enforcer holds what it held then, not the units the request took; given back after
// it, they would be out of the bucket without Redis knowing, and the bucket would refill past its
// capacity: 149 (a take) or 120 (a refill) would pass at one instant of a bucket of 100.
func TestLeasesWhenARefusedRequestsUnitsWereReplacedThenOneBucketIsAllThatPasses(t *testing.T) {
	tier.Needs(t, "redis-server")
	for _, c := range []struct {
		name       string
		most, cost int64
		meanwhile  func(t *testing.T, s store.Store, a store.Check)
	}{
		{"by a take", 50, 49, func(t *testing.T, s store.Store, a store.Check) {
			t.Helper()
			if !admit(t, s, a) { // nothing left to use: takes 50
				t.Fatal("the request that takes was refused")
			}
		}},
		{"by a refill sent after", 40, 20, func(t *testing.T, s store.Store, a store.Check) {
			t.Helper()
			if admitted(t, s, a, 9) != 9 { // holds 10: a quarter of 40, refilled ahead to 40
				t.Fatal("a request within the lease was refused")
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			clock, s, other, g := twoEnforcers(t, time.Unix(1_800_000_000, 0))
			tag := uniqueTag(t)
			a := leased(algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Minute}, tag, "a", 1, c.most, time.Minute)
			refusing := spent(t, s, tag)
			if !admit(t, s, a) { // takes most, holds most - 1
				t.Fatal("the first request was refused")
			}
			some := a
			some.Cost = c.cost
			refusedWhile(t, g, s, func() { c.meanwhile(t, s, a) }, some, refusing)
			s.(*store.Redis).WaitRefills()
			clock.Step(59 * time.Second) // the bucket refilled, the leases not yet expired
			if passed := admitted(t, s, a, 150) + admitted(t, other, a, 150); passed > 100 {
				t.Fatalf("%d passed at one instant, from a bucket of 100", passed)
			}
		})
	}
}

// A refill that finds the next window of a fixed window drops the last window's units; a
// request covered by them and refused meanwhile does not put them back into the new window's
// lease (22 would pass in a window of 20).
func TestLeasesWhenARefillCrossesIntoTheNextWindowThenUnitsOfTheLastAreNotGivenBackToIt(t *testing.T) {
	tier.Needs(t, "redis-server")
	clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0).Truncate(time.Hour).Add(59*time.Minute + 30*time.Second))
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, clock.Now)
	g := holdScripts(s)
	tag := uniqueTag(t)
	a := leased(algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 20, Period: time.Hour}, tag, "a", 1, 8, time.Minute)
	refusing := spent(t, s, tag)
	if admitted(t, s, a, 5) != 5 { // takes 8, holds 3
		t.Fatal("a request within the lease was refused")
	}
	refill := g.next()
	if !admit(t, s, a) { // holds 2: a quarter of 8, refilled ahead
		t.Fatal("a request within the lease was refused")
	}
	<-refill.reached
	both := a
	both.Cost = 2
	refusedWhile(t, g, s, func() {
		clock.Step(40 * time.Second)
		close(refill.open)
		s.(*store.Redis).WaitRefills()
	}, both, refusing)
	if passed := admitted(t, s, a, 40); passed != 20 {
		t.Fatalf("%d passed in a window of 20", passed)
	}
}

// A trip that times out may still run in Redis: a take that ran counted the units the enforcer
// held as spent, so they are not used again, whatever the answer's fate. Redis is kept busy by a
// script of its own while the enforcer's trip waits behind it: put back, the 49 units would make
// 148 pass at one instant of a bucket of 100.
func TestLeasesWhenATakeTimesOutThenTheUnitsItHeldAreNotUsedAgain(t *testing.T) {
	tier.Needs(t, "redis-server")
	clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
	opts := store.RedisOptions{Addrs: []string{standalone.Addr()}, Pipelines: -1}
	s := newRedis(t, store.RedisOptions{Addrs: opts.Addrs, Pipelines: -1, Timeout: 200 * time.Millisecond}, clock.Now)
	other := newRedis(t, opts, clock.Now)
	a := leased(algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: 10 * time.Second}, uniqueTag(t), "a", 1, 50, time.Minute)
	if !admit(t, s, a) || !admit(t, other, a) { // each takes 50 and holds 49
		t.Fatal("a first request was refused")
	}
	clock.Step(500 * time.Millisecond)
	more := a
	more.Cost = 50 // the 49 held and one more
	done := keepBusy(t, standalone.Addr(), time.Second)
	if _, err := s.Decide(context.Background(), []store.Check{more}, make([]algorithm.Decision, 1)); err == nil {
		t.Fatal("the trip to a busy Redis did not time out")
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// The take waited behind the busy script and ran once it was done: each enforcer's record
	// held 50 until then.
	leases := redis.NewClient(&redis.Options{Addr: standalone.Addr()})
	defer func() { _ = leases.Close() }()
	poll.WaitFor(t, time.Minute, func() error {
		held, err := leases.HGetAll(context.Background(), a.LeaseKey()).Result()
		if err != nil {
			return err
		}
		for _, units := range held {
			if !strings.HasPrefix(units, "50:") {
				return nil
			}
		}
		return fmt.Errorf("the take that timed out has not run: %v", held)
	})
	clock.Step(30 * time.Second) // the bucket refilled, the leases not yet expired
	if passed := admitted(t, s, a, 150) + admitted(t, other, a, 150); passed > 100 {
		t.Fatalf("%d passed at one instant, from a bucket of 100", passed)
	}
}

// keepBusy runs a script that keeps the Redis at addr busy for d, and returns once Redis is busy
// with it (a PING is not answered); the script's error arrives on the channel when it is done.
func keepBusy(t *testing.T, addr string, d time.Duration) <-chan error {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: d + 10*time.Second})
	done := make(chan error, 1)
	go func() {
		defer func() { _ = c.Close() }()
		done <- c.Eval(context.Background(), `local t = redis.call('TIME')
local from = t[1] * 1e6 + t[2]
repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - from >= tonumber(ARGV[1])
return 1`, nil, d.Microseconds()).Err()
	}()
	probe := redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: 20 * time.Millisecond, MaxRetries: -1})
	defer func() { _ = probe.Close() }()
	if err := poll.Until(d/2, func() error {
		if probe.Ping(context.Background()).Err() != nil {
			return nil
		}
		return errors.New("a PING is answered")
	}); err != nil {
		t.Fatalf("Redis did not get busy: %v", err)
	}
	return done
}

// A cost above the limit never passes: with units held, it is refused as it is without them
// (Never, no Retry-After), not as a smaller request Redis would see without the units held.
func TestLeasesWhenACostIsAboveTheLimitThenItIsRefusedAsNeverPassingWithUnitsHeld(t *testing.T) {
	tier.Needs(t, "redis-server")
	for _, l := range leasedLimits {
		t.Run(l.Kind.String(), func(t *testing.T) {
			s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil)
			a := leased(l, uniqueTag(t), "a", 1, 50, time.Minute)
			if !admit(t, s, a) {
				t.Fatal("the first request was refused")
			}
			big := a
			big.Cost = l.Limit + 1
			out := make([]algorithm.Decision, 1)
			if ok, err := s.Decide(context.Background(), []store.Check{big}, out); err != nil || ok {
				t.Fatalf("a cost above the limit: passed %v, err %v", ok, err)
			}
			if !out[0].Never || out[0].RetryAfter != 0 {
				t.Fatalf("a cost above the limit was refused as %+v, want Never and no Retry-After", out[0])
			}
			if passed := admitted(t, s, a, 100); passed != 99 {
				t.Fatalf("%d passed after it, want the 99 left", passed)
			}
		})
	}
}

// Close waits for the refills in flight and starts none after: a request decided from the units
// held once the store is closed sends nothing. (A refill started while Close waited could panic
// the WaitGroup.)
func TestLeasesWhenTheStoreIsClosedThenNoRefillStarts(t *testing.T) {
	tier.Needs(t, "redis-server")
	s, err := store.NewRedis(store.RedisOptions{Addrs: []string{standalone.Addr()}, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	scripts := 0
	s.BeforeLeaseScript(func() { mu.Lock(); scripts++; mu.Unlock() })
	a := leased(algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 100, Period: time.Hour}, uniqueTag(t), "a", 1, 8, time.Minute)
	if !admit(t, s, a) { // takes 8, holds 7
		t.Fatal("the first request was refused")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	out := make([]algorithm.Decision, 1)
	for i := range 7 {
		if !s.DecideLocal([]store.Check{a}, out) {
			t.Fatalf("request %d of the 7 units held was not decided from them", i+1)
		}
	}
	s.WaitRefills()
	mu.Lock()
	defer mu.Unlock()
	if scripts != 1 {
		t.Fatalf("%d scripts were sent, want only the first take: a refill started after Close", scripts)
	}
}

// holding is one enforcer on the standalone Redis, and a fixed window of limit a month long
// leased most units at a time, whose first request the enforcer took a lease with: it holds
// most - 1.
func holding(t *testing.T, limit, most int64) (store.Store, store.Check) {
	t.Helper()
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil)
	a := leased(algorithm.Limit{Kind: algorithm.FixedWindow, Limit: limit, Period: 720 * time.Hour}, uniqueTag(t), "a", 1, most, time.Minute)
	if !admit(t, s, a) {
		t.Fatal("the first request was refused")
	}
	return s, a
}

// unlimited is a rule that never refuses.
func unlimited(tag string) store.Check {
	return store.Check{Limit: algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 1000, Rate: 1000, Period: time.Second}, Cost: 1, Enforce: true, Tag: tag, Rule: "unlimited"}
}

// A trip to Redis may take up to the store's timeout: units whose lease (token bucket) or
// window (fixed window) ends sooner, or ended, are not spent when its answer comes. Spent then,
// after Redis let their bound go and another enforcer took the refilled bucket or the next
// window, 149 would pass at one instant of a bucket of 100, and 14 in a window of 10; credited
// back to a bucket that was full since they were taken, 149 too. (A window's go back to it if it
// is still the current one; a bucket refills them.)
func TestLeasesWhenATripMayOutlastTheUnitsHeldThenTheyAreNotSpent(t *testing.T) {
	tier.Needs(t, "redis-server")
	for _, c := range []struct {
		name   string
		limit  algorithm.Limit
		start  time.Time
		before time.Duration // the request, this long before the lease or the window ends
		most   int64
	}{
		{"token bucket", algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Second}, time.Unix(1_800_000_000, 0), time.Minute - 100*time.Millisecond, 50},
		{"token bucket, expired", algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Second}, time.Unix(1_800_000_000, 0), time.Minute + 100*time.Millisecond, 50},
		{"fixed window", algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: time.Hour}, time.Unix(1_800_000_000, 0).Truncate(time.Hour).Add(59 * time.Minute), 59*time.Second + 900*time.Millisecond, 5},
	} {
		t.Run(c.name, func(t *testing.T) {
			clock, s, other, g := twoEnforcers(t, c.start)
			tag := uniqueTag(t)
			a := leased(c.limit, tag, "a", 1, c.most, time.Minute)
			if !admit(t, s, a) { // takes most, holds most - 1
				t.Fatal("the first request was refused")
			}
			clock.Step(c.before)
			all := a
			all.Cost = c.most - 1
			passed := 0
			if decidedWhile(t, g, s, func() {
				clock.Step(1500 * time.Millisecond) // the lease or the window ended
				passed = admitted(t, other, a, 150)
			}, all, unlimited(tag)) {
				passed += int(all.Cost)
			}
			if passed > int(c.limit.Limit) {
				t.Fatalf("%d passed at once, of a limit of %d", passed, c.limit.Limit)
			}
		})
	}
}

// Units that requests whose trips are in flight took stay held in Redis's record when a refill
// or a take replaces it (and the lease table keeps them meanwhile): those requests may still pass
// and spend them. Without, Redis would let their bound go, and at one instant 140 (a refill) or
// 149 (a take) would pass of a bucket of 100.
func TestLeasesWhenRequestsInFlightHoldUnitsThenARefillOrATakeKeepsThemCounted(t *testing.T) {
	tier.Needs(t, "redis-server")
	for _, c := range []struct {
		name      string
		cost      int64
		meanwhile func(t *testing.T, s store.Store, a store.Check) int
	}{
		{"a refill", 40, func(t *testing.T, s store.Store, a store.Check) int {
			t.Helper()
			return admitted(t, s, a, 1) // holds 8: refilled ahead
		}},
		{"a take", 49, func(t *testing.T, s store.Store, a store.Check) int {
			t.Helper()
			return admitted(t, s, a, 1) // holds none: takes
		}},
		{"a take once the table was swept", 49, func(t *testing.T, s store.Store, a store.Check) int {
			t.Helper()
			for i := range 1100 { // more clients than the lease table sweeps at
				others := a
				others.Tag = uniqueTag(t, i)
				admit(t, s, others)
			}
			return admitted(t, s, a, 1) // holds none: takes
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			clock, s, other, g := twoEnforcers(t, time.Unix(1_800_000_000, 0))
			tag := uniqueTag(t)
			a := leased(algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Second}, tag, "a", 1, 50, time.Minute)
			if !admit(t, s, a) { // takes 50, holds 49
				t.Fatal("the first request was refused")
			}
			some := a
			some.Cost = c.cost
			before, instant := 1, 0
			if decidedWhile(t, g, s, func() {
				before += c.meanwhile(t, s, a)
				clock.Step(1500 * time.Millisecond) // the bucket refilled, the leases not yet expired
				instant = admitted(t, other, a, 150) + admitted(t, s, a, 150)
			}, some, unlimited(tag)) {
				instant += int(c.cost)
			}
			if instant > 100 {
				t.Fatalf("%d passed at one instant (and %d before), from a bucket of 100", instant, before)
			}
		})
	}
}

// A leased token bucket named twice in one request is decided in Redis; when a lease of it has
// expired, the bucket keeps that lease's bound without losing the charge of the request:
// without, each round would pass 5 units uncharged (60 of a bucket of 20).
func TestLeasesWhenARuleIsNamedTwiceAndALeaseExpiredThenTheChargeHolds(t *testing.T) {
	tier.Needs(t, "redis-server")
	clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
	stores := enforcers(t, 2, store.RedisOptions{Addrs: []string{standalone.Addr()}}, clock.Now)
	s, other := stores[0], stores[1]
	a := leased(algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 20, Rate: 20, Period: 720 * time.Hour}, uniqueTag(t), "a", 1, 2, time.Second)
	free, five := a, a
	free.Cost, five.Cost = 0, 5
	units := 0
	for range 10 {
		if admit(t, other, a) { // takes 2 for a second
			units++
		}
		other.(*store.Redis).WaitRefills()
		clock.Step(2 * time.Second) // its lease expired
		if admit(t, s, free, five) {
			units += 5
		}
	}
	// Five leases of 2 take the bucket's 20 with the two requests of 5 that pass (rounds one and
	// two); each lease's request spent 1 of its 2: 15 pass. Over 15 is a charge lost, under it a
	// decision refused that the bucket could pass.
	if units != 15 {
		t.Fatalf("%d units passed from a bucket of 20 that barely refills, want 15", units)
	}
}

// A rule named three times in one request is decided in Redis, as one named twice: its lease
// is untouched. (The refill its last units start is held until they are counted: answered
// first, it would add to them.)
func TestLeasesWhenARuleIsNamedThreeTimesThenRedisDecidesIt(t *testing.T) {
	tier.Needs(t, "redis-server")
	s, a := holding(t, 10, 5)
	if !admit(t, s, a, a, a) {
		t.Fatal("the request naming the rule three times was refused")
	}
	g := holdScripts(s)
	refill := g.next()
	local := 0
	for s.(*store.Redis).DecideLocal([]store.Check{a}, make([]algorithm.Decision, 1)) && local < 10 {
		local++
	}
	close(refill.open)
	s.(*store.Redis).WaitRefills()
	if local != 4 {
		t.Fatalf("%d decided from the lease after the rule named three times, want the 4 it held", local)
	}
}

// A leased rule named again unleased (a shadow of it) in one request is decided in Redis: a lease
// taken beside the shadow's own charge would go uncharged (13 passed in a window of 10).
func TestLeasesWhenALeasedRuleIsNamedAgainAsAShadowThenNoMoreThanTheLimitPasses(t *testing.T) {
	tier.Needs(t, "redis-server")
	s := newRedis(t, store.RedisOptions{Addrs: []string{standalone.Addr()}}, nil)
	a := leased(algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: 720 * time.Hour}, uniqueTag(t), "a", 1, 5, time.Minute)
	shadow := a
	shadow.Enforce = false
	passed := 0
	for range 20 {
		if admit(t, s, a, shadow) {
			passed++
		}
		s.(*store.Redis).WaitRefills()
		passed += admitted(t, s, a, 4)
	}
	if passed > 10 {
		t.Fatalf("%d passed in a window of 10", passed)
	}
}

// A request whose caller gives up before its script is sent changes nothing: the units it took
// from the lease stay held (a client that leaves would otherwise burn a lease each time).
func TestLeasesWhenTheCallerGivesUpBeforeTheScriptIsSentThenTheUnitsStayHeld(t *testing.T) {
	tier.Needs(t, "redis-server")
	s, a := holding(t, 100, 50)
	ctx, cancel := context.WithCancel(context.Background())
	s.(*store.Redis).BeforeLeaseScript(cancel)
	more := a
	more.Cost = 50 // the 49 held and one more
	if _, err := s.Decide(ctx, []store.Check{more}, make([]algorithm.Decision, 1)); !errors.Is(err, context.Canceled) {
		t.Fatalf("the decision its caller gave up on: %v, want context.Canceled", err)
	}
	s.(*store.Redis).BeforeLeaseScript(nil)
	if passed := 1 + admitted(t, s, a, 200); passed != 100 {
		t.Fatalf("%d passed in a window of 100", passed)
	}
}

// Units taken under a rule's old limit are not spent under a new one: Redis counted them under
// the old one, and refuses what the new one does not allow (49 passed under a limit of 10 in a
// window that counts 50).
func TestLeasesWhenARulesLimitChangesThenUnitsHeldUnderTheOldOneAreNotSpent(t *testing.T) {
	tier.Needs(t, "redis-server")
	s, a := holding(t, 100, 50)
	lowered := leased(algorithm.Limit{Kind: algorithm.FixedWindow, Limit: 10, Period: 720 * time.Hour}, a.Tag, "a", 1, 5, time.Minute)
	if passed := admitted(t, s, lowered, 100); passed > 0 {
		t.Fatalf("%d passed under a limit of 10 in a window that counts 50", passed)
	}
	if passed := admitted(t, s, a, 100); passed != 50 {
		t.Fatalf("%d passed under the limit of 100 again, want the 50 Redis has left", passed)
	}
}

// A trip for a rule and client waits while another is out (a refill): two scripts that replace
// what Redis records this enforcer holds, run in either order, would leave it recording the one
// that ran last while the enforcer holds what both took (137 at one instant of a bucket of 100).
// The request here needs Redis for another rule, and the units held end within the store's
// timeout, so the trip would take.
func TestLeasesWhenARefillIsOutThenATripThatTakesWaitsForIt(t *testing.T) {
	tier.Needs(t, "redis-server")
	clock, s, other, g := twoEnforcers(t, time.Unix(1_800_000_000, 0))
	tag := uniqueTag(t)
	a := leased(algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 100, Period: time.Second}, tag, "a", 1, 50, time.Minute)
	if admitted(t, s, a, 37) != 37 { // takes 50, holds 13
		t.Fatal("a request within the lease was refused")
	}
	clock.Step(56 * time.Second) // 4 s of the lease left, within the 5 s timeout
	refill := g.next()
	if !admit(t, s, a) { // holds 12: refilled ahead
		t.Fatal("a request within the lease was refused")
	}
	<-refill.reached
	take := g.next()
	took := make(chan bool)
	go func() {
		ok, err := s.Decide(context.Background(), []store.Check{a, unlimited(tag)}, make([]algorithm.Decision, 2))
		if err != nil {
			t.Error(err)
		}
		took <- ok
	}()
	select {
	case <-take.reached: // it did not wait: the take runs first, the refill last
		close(take.open)
		<-took
		close(refill.open)
	case <-time.After(time.Second): // a second for a take that does not wait to reach Redis
		close(refill.open)
		<-take.reached
		close(take.open)
		<-took
	}
	s.(*store.Redis).WaitRefills()
	clock.Step(time.Second) // the bucket refilled to its capacity less the units out
	instant := admitted(t, other, a, 150)
	out := make([]algorithm.Decision, 1)
	for range 150 { // what this enforcer holds, spent at the same instant
		if !s.(*store.Redis).DecideLocal([]store.Check{a}, out) {
			break
		}
		instant++
	}
	if instant > 100 {
		t.Fatalf("%d passed at one instant, from a bucket of 100", instant)
	}
}

// Units a trip spends pass when its answer comes, and Redis counts them held until then: a take
// that replaces the record later ends their bound at that time, not at the trip's start (the
// bucket would refill over the trip as if they had passed then: 104 at one instant of 100, the
// trip 4 s long at one unit a second). Whether the request is covered or takes.
func TestLeasesWhenATripSpendsUnitsHeldThenTheyPassWhenItsAnswerComes(t *testing.T) {
	tier.Needs(t, "redis-server")
	for _, cost := range []int64{49, 50} { // covered by the 49 held; those and a take
		t.Run(fmt.Sprint("cost ", cost), func(t *testing.T) {
			clock, s, other, g := twoEnforcers(t, time.Unix(1_800_000_000, 0))
			tag := uniqueTag(t)
			a := leased(algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 1, Period: time.Second}, tag, "a", 1, 50, 10*time.Minute)
			if !admit(t, s, a) { // takes 50, holds 49
				t.Fatal("the first request was refused")
			}
			clock.Step(100 * time.Second) // the bucket refilled to 100 - 49
			some := a
			some.Cost = cost
			if !decidedWhile(t, g, s, func() { clock.Step(4 * time.Second) }, some, unlimited(tag)) {
				t.Fatal("the request was refused")
			}
			if instant := int(cost) + admitted(t, s, a, 150) + admitted(t, other, a, 150); instant > 100 {
				t.Fatalf("%d passed at one instant, from a bucket of 100", instant)
			}
		})
	}
}

// A take whose answer is noted after that of a covered request keeps the later time the covered
// request's units passed: noted as spent at the take's start, they would end their bound early,
// and the bucket would refill over the gap (102 at one instant of 100, the gap 4 s at 1/s).
func TestLeasesWhenATakesAnswerComesAfterACoveredRequestsThenItKeepsWhenThoseUnitsPassed(t *testing.T) {
	tier.Needs(t, "redis-server")
	clock, s, other, scripts := twoEnforcers(t, time.Unix(1_800_000_000, 0))
	answers := holdAnswers(s)
	tag := uniqueTag(t)
	a := leased(algorithm.Limit{Kind: algorithm.TokenBucket, Limit: 100, Rate: 1, Period: time.Second}, tag, "a", 1, 50, 10*time.Minute)
	if !admit(t, s, a) { // takes 50, holds 49
		t.Fatal("the first request was refused")
	}
	clock.Step(100 * time.Second) // the bucket refilled, but for the 49 leased
	if !admit(t, other, a) {      // takes 50: one unit of the bucket is left
		t.Fatal("the other enforcer's first request was refused")
	}
	all := a
	all.Cost = 49
	covered, coveredAnswer := scripts.next(), answers.next()
	take, takeAnswer := scripts.next(), answers.next()
	decided := make(chan bool, 2)
	decide := func(checks ...store.Check) {
		ok, err := s.Decide(context.Background(), checks, make([]algorithm.Decision, len(checks)))
		if err != nil {
			t.Error(err)
		}
		decided <- ok
	}
	go decide(all, unlimited(tag)) // covered by the 49
	<-covered.reached
	go decide(a) // nothing left to use: takes, holding the 49 pending
	<-take.reached
	close(covered.open)
	<-coveredAnswer.reached
	close(take.open)
	<-takeAnswer.reached // both scripts ran now
	clock.Step(4 * time.Second)
	close(coveredAnswer.open) // the 49 pass now
	if !<-decided {
		t.Fatal("a request was refused")
	}
	close(takeAnswer.open)
	if !<-decided {
		t.Fatal("a request was refused")
	}
	if instant := 49 + admitted(t, s, a, 150) + admitted(t, other, a, 150); instant > 100 {
		t.Fatalf("%d passed at one instant, from a bucket of 100", instant)
	}
}
