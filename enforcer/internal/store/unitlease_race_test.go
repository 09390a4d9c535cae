package store_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// The races of leased units with Redis and with each other, each forced in one order: a test
// holds a decision between the units it reserved and its script, and moves the others (or the
// clock) on meanwhile.

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

// refusedWhile sends the request of checks, which the rule spent refuses, through s, holds its
// script once it reserved its units, runs meanwhile, and lets it go on.
func refusedWhile(t *testing.T, g *gates, s store.Store, meanwhile func(), checks ...store.Check) {
	t.Helper()
	held := g.next()
	refused := make(chan bool)
	go func() {
		ok, err := s.Decide(context.Background(), checks, make([]algorithm.Decision, len(checks)))
		refused <- err == nil && !ok
	}()
	<-held.reached
	meanwhile()
	close(held.open)
	if !<-refused {
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
			clock := clocktesting.NewFakeClock(time.Unix(1_800_000_000, 0))
			stores := enforcers(t, 2, store.RedisOptions{Addrs: []string{standalone.Addr()}}, clock.Now)
			s, other := stores[0], stores[1]
			g := holdScripts(s)
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
	start := time.Now()
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
	for ran := false; !ran; {
		held, err := leases.HGetAll(context.Background(), a.LeaseKey()).Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, units := range held {
			ran = ran || !strings.HasPrefix(units, "50:")
		}
		if !ran && time.Since(start) > time.Minute {
			t.Fatalf("the take that timed out never ran: %v", held)
		}
	}
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
	for deadline := time.Now().Add(d / 2); time.Now().Before(deadline); {
		if probe.Ping(context.Background()).Err() != nil {
			return done
		}
	}
	t.Fatal("Redis did not get busy")
	return nil
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
