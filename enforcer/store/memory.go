package store

import (
	"context"
	"hash/maphash"
	"math"
	"sync"
	"time"

	"github.com/sluice-dev/sluice/enforcer/algorithm"
)

const memoryShards = 64

// MemoryOptions configure a Memory store.
type MemoryOptions struct {
	// MaxKeys bounds the number of keys held. When a shard is full, a new key evicts, among a
	// sample of keys, the one closest to idle. Default 1,000,000.
	MaxKeys int
	// Now is the clock. Default time.Now.
	Now func() time.Time
	// SweepInterval is how often idle keys are removed. Default one second; negative disables
	// the background sweep (tests call Sweep).
	SweepInterval time.Duration
}

// Memory is the in-process store, exact for one enforcer replica. It is sharded so that requests
// for different keys rarely contend: a decision locks only the shards of its keys, in ascending
// order, and holds them while it checks and charges every rule.
type Memory struct {
	shards   [memoryShards]shard
	seed     maphash.Seed
	now      func() time.Time
	perShard int
	stop     chan struct{}
	done     chan struct{}
}

type shard struct {
	mu sync.Mutex
	m  map[memoryKey]*memoryEntry
	// records are the idempotency records of the shard's clients, bounded like m.
	records map[memoryKey]*idemRecord
	_       [32]byte // keep shards on separate cache lines
}

// idemRecord is what decide.lua keeps in a request's record: the repeats seen of an admitted
// request, or -1 for a refused one; expiresAt is its TTL, in microseconds.
type idemRecord struct {
	seen      int64
	expiresAt float64
}

type memoryKey struct{ tag, rule string }

type memoryEntry struct {
	st algorithm.State
	// idleAt is when the state is back to idle, in microseconds: from then on, dropping the
	// entry changes no decision.
	idleAt float64
}

// NewMemory returns a memory store. Close stops its background sweep.
func NewMemory(opts MemoryOptions) *Memory {
	if opts.MaxKeys <= 0 {
		opts.MaxKeys = 1_000_000
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.SweepInterval == 0 {
		opts.SweepInterval = time.Second
	}
	s := &Memory{
		seed:     maphash.MakeSeed(),
		now:      opts.Now,
		perShard: max(1, opts.MaxKeys/memoryShards),
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
	}
	for i := range s.shards {
		s.shards[i].m = make(map[memoryKey]*memoryEntry)
		s.shards[i].records = make(map[memoryKey]*idemRecord)
	}
	if opts.SweepInterval > 0 {
		go s.sweepEvery(opts.SweepInterval)
	} else {
		close(s.done)
	}
	return s
}

// shardOf shards by client: all rules of one client share a shard, so the common decision takes
// one lock.
func (s *Memory) shardOf(c *Check) int {
	return int(maphash.String(s.seed, c.Tag) % memoryShards)
}

// commonChecks is how many rules a decision may have before its bookkeeping allocates. Any
// number is decided: the rules of all matching policies, which no bound of one policy limits.
const commonChecks = 32

// Decide implements Store.
func (s *Memory) Decide(_ context.Context, checks []Check, out []algorithm.Decision) (bool, error) {
	if len(checks) == 1 && checks[0].Idempotency == nil {
		return s.decideOne(&checks[0], out)
	}
	var idxBuf, lockedBuf [commonChecks]int
	idx, locked := idxBuf[:], lockedBuf[:]
	if len(checks) > commonChecks {
		idx, locked = make([]int, len(checks)), make([]int, len(checks))
	}
	n := 0
	for i := range checks {
		idx[i] = s.shardOf(&checks[i])
		// Insertion into the sorted, duplicate-free list of shards to lock.
		j := n
		for j > 0 && locked[j-1] > idx[i] {
			j--
		}
		if j > 0 && locked[j-1] == idx[i] {
			continue
		}
		copy(locked[j+1:n+1], locked[j:n])
		locked[j] = idx[i]
		n++
	}
	for _, sh := range locked[:n] {
		s.shards[sh].mu.Lock()
	}
	defer func() {
		for _, sh := range locked[:n] {
			s.shards[sh].mu.Unlock()
		}
	}()

	var buf [4]algorithm.State
	states := buf[:0]
	if len(checks) > len(buf) {
		states = make([]algorithm.State, 0, len(checks))
	}
	now := algorithm.Micros(s.now())
	// The idempotency record, under the first check that names one, as decide.lua keeps it.
	var rsh *shard
	var rkey memoryKey
	var rec *idemRecord
	var idem *Idempotency
	for i := range checks {
		if c := &checks[i]; c.Idempotency != nil {
			idem, rsh, rkey = c.Idempotency, &s.shards[idx[i]], memoryKey{c.Tag, c.Idempotency.Key}
			if rec = rsh.records[rkey]; rec != nil && rec.expiresAt <= now {
				delete(rsh.records, rkey)
				rec = nil
			}
			break
		}
	}
	if rec != nil && rec.seen >= 0 && rec.seen < idem.MaxRepeats {
		// A free repeat of an admitted request: it passes, and nothing is charged.
		rec.seen++
		for i := range checks {
			c := &checks[i]
			_, out[i] = c.Limit.Take(s.shards[idx[i]].state(c), now, 0)
			out[i].Allowed, out[i].Wait = true, 0
		}
		return true, nil
	}
	for i := range checks {
		c := &checks[i]
		st, d := c.Limit.Take(s.shards[idx[i]].state(c), now, c.Cost)
		states, out[i] = append(states, st), d
	}
	refusedRepeat := rec != nil && rec.seen < 0
	if refusedRepeat && charged(checks, out) {
		// A repeat of a refused request before its Retry-After, which no limit refuses now:
		// refused the same way, by the first enforced rule, until the record ends.
		for i := range checks {
			if c := &checks[i]; c.Enforce {
				_, out[i] = c.Limit.Take(s.shards[idx[i]].state(c), now, 0)
				out[i].Allowed, out[i].RetryAfter = false, time.Duration(max(1, rec.expiresAt-now))*time.Microsecond
				break
			}
		}
	}
	if refusedRepeat || !charged(checks, out) {
		// Nothing is charged, so the rules that would have allowed report their state as it
		// stays: what a cost-0 check sees.
		var retry time.Duration
		for i := range checks {
			if c := &checks[i]; out[i].Allowed && c.Cost > 0 {
				_, out[i] = c.Limit.Take(s.shards[idx[i]].state(c), now, 0)
				out[i].Allowed = true
			} else if !out[i].Allowed && c.Enforce {
				retry = max(retry, out[i].RetryAfter)
			}
		}
		if idem != nil && rec == nil {
			// The first refusal of this request: its repeats are refused until its Retry-After,
			// in whole milliseconds as Redis keeps the record's TTL.
			s.makeRecordRoom(rsh, now)
			ms := max(1, math.Ceil(float64(retry.Microseconds())/1000))
			rsh.records[rkey] = &idemRecord{seen: -1, expiresAt: now + ms*1000}
		}
		return false, nil
	}
	for i := range checks {
		s.store(&s.shards[idx[i]], &checks[i], states[i], out[i], now)
	}
	if idem != nil {
		if rec != nil {
			rec.seen++ // a charged repeat, past the free ones
		} else {
			s.makeRecordRoom(rsh, now)
			rsh.records[rkey] = &idemRecord{expiresAt: now + float64(idem.Window.Microseconds())}
		}
	}
	return true, nil
}

// decideOne is Decide for the common single-rule request: one shard, no bookkeeping.
func (s *Memory) decideOne(c *Check, out []algorithm.Decision) (bool, error) {
	sh := &s.shards[s.shardOf(c)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	now := algorithm.Micros(s.now())
	k := memoryKey{c.Tag, c.Rule}
	e := sh.m[k] // one lookup serves both the read and the write
	var st algorithm.State
	if e != nil {
		st = e.st
	}
	st, d := c.Limit.Take(st, now, c.Cost)
	out[0] = d
	if c.Enforce && !d.Allowed {
		return false, nil
	}
	if d.Allowed && c.Cost > 0 {
		if e == nil {
			e = &memoryEntry{}
			s.makeRoom(sh, now)
			sh.m[k] = e
		}
		e.st, e.idleAt = st, now+float64(d.Reset.Microseconds())
	}
	return true, nil
}

func (sh *shard) state(c *Check) algorithm.State {
	if e := sh.m[memoryKey{c.Tag, c.Rule}]; e != nil {
		return e.st
	}
	return algorithm.State{}
}

// store keeps the state a charged check produced. The caller holds the shard's lock.
func (s *Memory) store(sh *shard, c *Check, st algorithm.State, d algorithm.Decision, now float64) {
	if !d.Allowed || c.Cost == 0 {
		return // a check, or a shadow rule that would refuse: nothing to charge
	}
	k := memoryKey{c.Tag, c.Rule}
	e := sh.m[k]
	if e == nil {
		e = &memoryEntry{}
		s.makeRoom(sh, now)
		sh.m[k] = e
	}
	e.st = st
	e.idleAt = now + float64(d.Reset.Microseconds())
}

// evictionSample is how many entries a full shard looks at to choose the one to evict.
const evictionSample = 8

// makeRoom keeps a shard's counters within its bound before an insert: see evict.
func (s *Memory) makeRoom(sh *shard, now float64) {
	evict(sh.m, s.perShard, now, func(e *memoryEntry) float64 { return e.idleAt })
}

// makeRecordRoom keeps a shard's idempotency records within the same bound: see evict.
func (s *Memory) makeRecordRoom(sh *shard, now float64) {
	evict(sh.records, s.perShard, now, func(r *idemRecord) float64 { return r.expiresAt })
}

// evict makes room in a full map before an insert: it drops the entries that are over (their
// end has come) among a sample and, if none is, the sampled entry closest to its end. Evicting a
// live entry forgets some usage of one client; the bound is what keeps a flood of random keys
// from exhausting memory.
func evict[V any](m map[memoryKey]V, bound int, now float64, end func(V) float64) {
	if len(m) < bound {
		return
	}
	var victim memoryKey
	victimEnd, seen := 0.0, 0
	for k, v := range m {
		if e := end(v); e <= now {
			delete(m, k)
		} else if seen == 0 || e < victimEnd {
			victim, victimEnd = k, e
		}
		if seen++; seen >= evictionSample {
			break
		}
	}
	if len(m) >= bound {
		delete(m, victim)
	}
}

// Sweep removes every entry whose state is back to idle.
func (s *Memory) Sweep() {
	now := algorithm.Micros(s.now())
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			if e.idleAt <= now {
				delete(sh.m, k)
			}
		}
		for k, r := range sh.records {
			if r.expiresAt <= now {
				delete(sh.records, k)
			}
		}
		sh.mu.Unlock()
	}
}

// Len is the number of keys held: counters and idempotency records.
func (s *Memory) Len() int {
	n := 0
	for i := range s.shards {
		s.shards[i].mu.Lock()
		n += len(s.shards[i].m) + len(s.shards[i].records)
		s.shards[i].mu.Unlock()
	}
	return n
}

func (s *Memory) sweepEvery(d time.Duration) {
	defer close(s.done)
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			s.Sweep()
		}
	}
}

// Ping implements Store: memory always answers.
func (s *Memory) Ping(context.Context) error { return nil }

// Close stops the background sweep.
func (s *Memory) Close() error {
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	<-s.done
	return nil
}
