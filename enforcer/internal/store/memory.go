package store

import (
	"context"
	"hash/maphash"
	"math"
	"sync"
	"time"

	"github.com/sluice-dev/sluice/internal/algorithm"
)

const memoryShards = 64

// DefaultMemoryMaxBytes is MemoryOptions.MaxBytes's default, 128 MiB: with Go's default GC, a
// heap of live state twice that stays within the 512Mi the rendered enforcer is allowed.
const DefaultMemoryMaxBytes = 128 << 20

// entryBytes and recordBytes are what a key costs beyond its names and its sliding log: its
// entry (or record) allocation, its map slot with the map's spare room, and the client tag's
// string; measured by TestMemoryWhenKeysAreHeldThenTheirCountedBytesCoverTheHeap.
const (
	entryBytes  = 240
	recordBytes = 120
)

// MemoryOptions configure a Memory store.
type MemoryOptions struct {
	// MaxKeys bounds the number of keys held. When a shard is full, a new key evicts, among a
	// sample of keys, the one closest to idle. Default 1,000,000.
	MaxKeys int
	// MaxBytes bounds the bytes the store's state takes, as it counts them: each key's entry
	// and map slot, its names, its sliding log's entries, and each idempotency record. A shard
	// over its share evicts as a full one does. Default DefaultMemoryMaxBytes.
	MaxBytes int64
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
	// shardBytes is each shard's share of MaxBytes.
	shardBytes int64
	stop       chan struct{}
	done       chan struct{}
}

type shard struct {
	mu sync.Mutex
	m  map[memoryKey]*memoryEntry
	// records are the idempotency records of the shard's clients, bounded like m.
	records map[memoryKey]*idemRecord
	// bytes is what m and records hold, as entryBytes, recordBytes and the names count it.
	bytes int64
	_     [24]byte // keep shards on separate cache lines
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
	// buf is the whole array st.Log lies in, which the entry's size counts: entries that left
	// the window still take room before st.Log until keep compacts them away.
	buf []algorithm.LogEntry
}

// size is the bytes the entry holds under key k.
func (e *memoryEntry) size(k memoryKey) int64 {
	return entryBytes + int64(len(k.tag)+len(k.rule)) + int64(cap(e.buf))*algorithm.LogEntrySize
}

// keep stores a charged state. A sliding log's array is the entry's own once stored: it is
// compacted when the entries that left the window outnumber those in it, and reallocated
// smaller when mostly empty, so an entry holds O(entries in the window), at amortized O(1).
func (e *memoryEntry) keep(st algorithm.State, idleAt float64) {
	log := st.Log
	switch {
	case cap(log) == 0:
		e.buf = nil
	case cap(e.buf) > 0 && &e.buf[:cap(e.buf)][cap(e.buf)-1] == &log[:cap(log)][cap(log)-1]:
		// The same array, len(log) entries at offset cap(e.buf)-cap(log).
		if cap(e.buf)-cap(log) > len(log) {
			log = e.buf[:copy(e.buf, log)]
		}
	default:
		e.buf = log[:cap(log)] // a new array: append outgrew the old one
	}
	if cap(e.buf) > 4*len(log)+16 {
		log = append(make([]algorithm.LogEntry, 0, 2*len(log)+4), log...)
		e.buf = log[:cap(log)]
	}
	st.Log = log
	e.st, e.idleAt = st, idleAt
}

// NewMemory returns a memory store. Close stops its background sweep.
func NewMemory(opts MemoryOptions) *Memory {
	if opts.MaxKeys <= 0 {
		opts.MaxKeys = 1_000_000
	}
	if opts.MaxBytes <= 0 {
		opts.MaxBytes = DefaultMemoryMaxBytes
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.SweepInterval == 0 {
		opts.SweepInterval = time.Second
	}
	s := &Memory{
		seed:       maphash.MakeSeed(),
		now:        opts.Now,
		perShard:   max(1, opts.MaxKeys/memoryShards),
		shardBytes: max(1, opts.MaxBytes/memoryShards),
		stop:       make(chan struct{}),
		done:       make(chan struct{}),
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
	at := s.now()
	now := algorithm.Micros(at)
	// The idempotency records the checks name, as decide.lua keeps them: recOf[i] is check i's
	// (1-based; 0 for none).
	var recBuf [2]memoryRecord
	recs := recBuf[:0]
	var recOfBuf [commonChecks]int
	recOf := recOfBuf[:]
	if len(checks) > commonChecks {
		recOf = make([]int, len(checks))
	}
	for i := range checks {
		c := &checks[i]
		recOf[i] = 0
		if c.Idempotency == nil {
			continue
		}
		k := memoryKey{c.Tag, c.Idempotency.Key}
		for j := range recs {
			if recs[j].key == k {
				recOf[i] = j + 1
			}
		}
		if recOf[i] == 0 {
			r := memoryRecord{sh: &s.shards[idx[i]], key: k, idem: c.Idempotency}
			if r.rec = r.sh.records[k]; r.rec != nil && r.rec.expiresAt <= now {
				r.sh.bytes -= r.rec.size(k)
				delete(r.sh.records, k)
				r.rec = nil
			}
			recs = append(recs, r)
			recOf[i] = len(recs)
		}
	}
	var freeBuf [commonChecks]bool
	free := freeBuf[:]
	if len(checks) > commonChecks {
		free = make([]bool, len(checks))
	}
	for i := range checks {
		c := &checks[i]
		st := s.shards[idx[i]].state(c)
		// A cost the rule can never admit is no repeat of an admitted request: it is refused as such.
		if j := recOf[i]; j > 0 && recs[j-1].free() && c.Cost >= 0 && c.Cost <= c.Limit.Limit {
			// A free repeat of an admitted request, for this check's policy: it passes uncharged.
			free[i] = true
			_, out[i] = c.Limit.Take(st, at, 0)
			out[i].Allowed, out[i].Wait = true, 0
			states = append(states, st)
			continue
		}
		free[i] = false
		st, d := c.Limit.Take(st, at, c.Cost)
		states, out[i] = append(states, st), d
	}
	commit := charged(checks, out)
	for j := range recs {
		if r := &recs[j]; commit && r.rec != nil && r.rec.seen < 0 {
			// A repeat of a refused request before its Retry-After, which no limit refuses now:
			// refused the same way, by the first enforced check of its record, until the
			// record ends.
			for i := range checks {
				if c := &checks[i]; c.Enforce && recOf[i] == j+1 {
					_, out[i] = c.Limit.Take(s.shards[idx[i]].state(c), at, 0)
					out[i].Allowed, out[i].Wait = false, 0
					out[i].RetryAfter = time.Duration(max(1, math.Ceil((r.rec.expiresAt-now)/1000))) * time.Millisecond
					commit = false
					break
				}
			}
		}
	}
	if !commit {
		// Nothing is charged, so the rules that would have allowed report their state as it
		// stays: what a cost-0 check sees.
		var retry time.Duration
		never := false
		for i := range checks {
			if c := &checks[i]; out[i].Allowed && !free[i] && c.Cost > 0 {
				_, out[i] = c.Limit.Take(s.shards[idx[i]].state(c), at, 0)
				out[i].Allowed = true
			} else if !out[i].Allowed && c.Enforce {
				retry = max(retry, out[i].RetryAfter)
				never = never || out[i].Never
			}
		}
		for j := range recs {
			// A request that can never pass leaves no record: its repeats are refused as it
			// was, never with a Retry-After that the record's time would promise.
			if r := &recs[j]; r.rec == nil && !never {
				// The first refusal of this request: its repeats are refused until its
				// Retry-After, in whole milliseconds as Redis keeps the record's TTL.
				s.makeRecordRoom(r.sh, now, r.key)
				ms := max(1, math.Ceil(float64(retry.Microseconds())/1000))
				r.sh.records[r.key] = &idemRecord{seen: -1, expiresAt: now + ms*1000}
			}
		}
		return false, nil
	}
	for i := range checks {
		if !free[i] {
			s.store(&s.shards[idx[i]], &checks[i], states[i], out[i], now)
		}
	}
	for j := range recs {
		if r := &recs[j]; r.rec != nil {
			r.rec.seen++ // a repeat, free or charged
		} else {
			s.makeRecordRoom(r.sh, now, r.key)
			r.sh.records[r.key] = &idemRecord{expiresAt: now + float64(r.idem.Window.Microseconds())}
		}
	}
	return true, nil
}

// memoryRecord is one idempotency record a decision names: where it lives, and what it holds
// (nil for none).
type memoryRecord struct {
	sh   *shard
	key  memoryKey
	rec  *idemRecord
	idem *Idempotency
}

// free reports whether the record makes the request a free repeat of an admitted one.
func (r *memoryRecord) free() bool {
	return r.rec != nil && r.rec.seen >= 0 && r.rec.seen < r.idem.MaxRepeats
}

// decideOne is Decide for the common single-rule request: one shard, no bookkeeping.
func (s *Memory) decideOne(c *Check, out []algorithm.Decision) (bool, error) {
	sh := &s.shards[s.shardOf(c)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	at := s.now()
	now := algorithm.Micros(at)
	k := memoryKey{c.Tag, c.Rule}
	e := sh.m[k] // one lookup serves both the read and the write
	var st algorithm.State
	if e != nil {
		st = e.st
	}
	st, d := c.Limit.Take(st, at, c.Cost)
	out[0] = d
	if c.Enforce && !d.Allowed {
		return false, nil
	}
	if d.Allowed && c.Cost > 0 {
		s.put(sh, k, e, st, now+float64(d.Reset.Microseconds()), now)
	}
	return true, nil
}

// put stores a charged state under k, whose entry is e or, if nil, new: it makes room for the
// bytes the entry grows by, then counts them. The caller holds the shard's lock.
func (s *Memory) put(sh *shard, k memoryKey, e *memoryEntry, st algorithm.State, idleAt, now float64) {
	before := int64(0)
	if e == nil {
		e = &memoryEntry{}
		s.makeRoom(sh, now, k, e.size(k)+int64(cap(st.Log))*algorithm.LogEntrySize)
		sh.m[k] = e
	} else {
		before = e.size(k)
	}
	e.keep(st, idleAt)
	grown := e.size(k) - before
	if before > 0 && grown > 0 {
		s.makeRoom(sh, now, k, grown)
	}
	sh.bytes += grown
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
	s.put(sh, k, sh.m[k], st, now+float64(d.Reset.Microseconds()), now)
}

// evictionSample is how many entries a full shard looks at to choose the one to evict.
const evictionSample = 8

// makeRoom keeps a shard within its bounds before it grows by need bytes, a new key's or a
// growing sliding log's: see evict. The key being written, keep, is never the one evicted.
func (s *Memory) makeRoom(sh *shard, now float64, keep memoryKey, need int64) {
	_, isNew := sh.m[keep]
	isNew = !isNew
	for len(sh.m) > 0 && (isNew && len(sh.m) >= s.perShard || sh.bytes+need > s.shardBytes) {
		if !evict(sh, sh.m, keep, now, func(e *memoryEntry) float64 { return e.idleAt }, (*memoryEntry).size) {
			break
		}
	}
	for len(sh.records) > 0 && sh.bytes+need > s.shardBytes {
		evict(sh, sh.records, memoryKey{}, now, func(r *idemRecord) float64 { return r.expiresAt }, (*idemRecord).size)
	}
}

// makeRecordRoom keeps a shard's idempotency records within the same bounds before an insert.
func (s *Memory) makeRecordRoom(sh *shard, now float64, k memoryKey) {
	need := recordBytes + int64(len(k.tag)+len(k.rule))
	for len(sh.records) > 0 && (len(sh.records) >= s.perShard || sh.bytes+need > s.shardBytes) {
		evict(sh, sh.records, memoryKey{}, now, func(r *idemRecord) float64 { return r.expiresAt }, (*idemRecord).size)
	}
	for len(sh.m) > 0 && sh.bytes+need > s.shardBytes {
		if !evict(sh, sh.m, memoryKey{}, now, func(e *memoryEntry) float64 { return e.idleAt }, (*memoryEntry).size) {
			break
		}
	}
	sh.bytes += need
}

func (r *idemRecord) size(k memoryKey) int64 { return recordBytes + int64(len(k.tag)+len(k.rule)) }

// evict drops, among a sample of a full map's entries other than keep, those that are over
// (their end has come) or, if none is, the one closest to its end, and takes their bytes off
// the shard's count. It reports whether it dropped any. Evicting a live entry forgets some usage
// of one client; the bounds are what keep a flood of random keys, or of large sliding logs,
// from exhausting memory.
func evict[V any](sh *shard, m map[memoryKey]V, keep memoryKey, now float64, end func(V) float64, size func(V, memoryKey) int64) bool {
	var victim memoryKey
	var victimV V
	victimEnd, seen, dropped := 0.0, 0, false
	for k, v := range m {
		if k == keep {
			continue
		}
		if e := end(v); e <= now {
			sh.bytes -= size(v, k)
			delete(m, k)
			dropped = true
		} else if seen == 0 || e < victimEnd {
			victim, victimV, victimEnd = k, v, e
		}
		if seen++; seen >= evictionSample {
			break
		}
	}
	if !dropped && seen > 0 {
		sh.bytes -= size(victimV, victim)
		delete(m, victim)
		dropped = true
	}
	return dropped
}

// Sweep removes every entry whose state is back to idle.
func (s *Memory) Sweep() {
	now := algorithm.Micros(s.now())
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			if e.idleAt <= now {
				sh.bytes -= e.size(k)
				delete(sh.m, k)
			}
		}
		for k, r := range sh.records {
			if r.expiresAt <= now {
				sh.bytes -= r.size(k)
				delete(sh.records, k)
			}
		}
		sh.mu.Unlock()
	}
}

// Bytes is the bytes held, as MaxBytes counts them.
func (s *Memory) Bytes() int64 {
	n := int64(0)
	for i := range s.shards {
		s.shards[i].mu.Lock()
		n += s.shards[i].bytes
		s.shards[i].mu.Unlock()
	}
	return n
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
