package store

import (
	"context"
	"hash/maphash"
	"iter"
	"maps"
	"math"
	"sync"
	"time"

	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/settings"
)

const memoryShards = 64

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
	// over its share evicts as a full one does. Default settings.Defaults().MemoryMaxBytes.
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
	// collide makes every key's hash 0, so that tests run the collided path.
	collide bool
}

type shard struct {
	mu sync.Mutex
	// m holds each key's entry by the hash of its names (Memory.locate): a lookup hashes and
	// compares one fixed-size key, and the entry's own names confirm it. A key whose hash
	// another key's entry holds already lives in collided, by its names: with a random 64-bit
	// seed that is rare, and it costs the key a second lookup, never a shared state.
	m        map[uint64]*memoryEntry
	collided map[memoryKey]*memoryEntry
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
	key  memoryKey
	hash uint64
	st   algorithm.State
	// idleAt is when the state is back to idle, in microseconds: from then on, dropping the
	// entry changes no decision.
	idleAt float64
	// buf is the whole array st.Log lies in, which the entry's size counts: entries that left
	// the window still take room before st.Log until keep compacts them away.
	buf []algorithm.LogEntry
}

// size is the bytes the entry holds.
func (e *memoryEntry) size() int64 {
	return entryBytes + int64(len(e.key.tag)+len(e.key.rule)) + int64(cap(e.buf))*algorithm.LogEntrySize + int64(cap(e.st.Leases))*algorithm.LeaseSize
}

// keep stores a charged state. A sliding log's array is the entry's own once stored: it is
// compacted when the entries that left the window outnumber those in it, and reallocated
// smaller when mostly empty, so an entry holds O(entries in the window), at amortized O(1).
func (e *memoryEntry) keep(st *algorithm.State, idleAt float64) {
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
	e.st, e.idleAt = *st, idleAt
	e.st.Log = log
}

// NewMemory returns a memory store. Close stops its background sweep.
func NewMemory(opts MemoryOptions) *Memory {
	if opts.MaxKeys <= 0 {
		opts.MaxKeys = settings.Defaults().MemoryMaxKeys
	}
	if opts.MaxBytes <= 0 {
		opts.MaxBytes = settings.Defaults().MemoryMaxBytes
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
		s.shards[i].m = make(map[uint64]*memoryEntry)
		s.shards[i].records = make(map[memoryKey]*idemRecord)
	}
	if opts.SweepInterval > 0 {
		go s.sweepEvery(opts.SweepInterval)
	} else {
		close(s.done)
	}
	return s
}

// locate returns the shard of a check's key and its hash in the shard's map. It shards by
// client: all rules of one client share a shard, so the common decision takes one lock.
func (s *Memory) locate(c *Check) (shard int, hash uint64) {
	client := maphash.String(s.seed, c.Tag)
	if s.collide {
		return int(client % memoryShards), 0
	}
	return int(client % memoryShards), client ^ maphash.String(s.seed, c.Rule)*0x9e3779b97f4a7c15
}

// get returns the entry of key k, whose hash is h, or nil.
func (sh *shard) get(h uint64, k memoryKey) *memoryEntry {
	if e := sh.m[h]; e != nil && e.key == k {
		return e
	}
	if len(sh.collided) > 0 {
		return sh.collided[k]
	}
	return nil
}

// add holds a new entry, which no key of the shard names.
func (sh *shard) add(e *memoryEntry) {
	if _, taken := sh.m[e.hash]; !taken {
		sh.m[e.hash] = e
		return
	}
	if sh.collided == nil {
		sh.collided = make(map[memoryKey]*memoryEntry)
	}
	sh.collided[e.key] = e
}

// drop removes an entry the shard holds, and its bytes from the shard's count.
func (sh *shard) drop(e *memoryEntry) {
	sh.bytes -= e.size()
	if sh.m[e.hash] == e {
		delete(sh.m, e.hash)
	} else {
		delete(sh.collided, e.key)
	}
}

// keys is how many entries the shard holds.
func (sh *shard) keys() int { return len(sh.m) + len(sh.collided) }

// entries yields the shard's entries by their names; the caller may drop the one yielded.
func (sh *shard) entries(yield func(memoryKey, *memoryEntry) bool) {
	for _, e := range sh.m {
		if !yield(e.key, e) {
			return
		}
	}
	for k, e := range sh.collided {
		if !yield(k, e) {
			return
		}
	}
}

// commonChecks is how many rules a decision may have before its bookkeeping allocates. Any
// number is decided: the rules of all matching policies, which no bound of one policy limits.
const commonChecks = 32

// Decide implements Store.
func (s *Memory) Decide(_ context.Context, checks []Check, out []algorithm.Decision) (bool, error) {
	if len(checks) == 1 && checks[0].Idempotency == nil {
		return s.decideOne(&checks[0], out)
	}
	d := decisions.Get().(*memoryDecision)
	defer d.release()
	d.init(s, checks, out)
	d.lock()
	defer d.unlock()
	d.findRecords()
	d.take()
	if !d.commitOrRefuseRepeat() {
		d.keepRefusal()
		return false, nil
	}
	d.charge()
	return true, nil
}

// memoryDecision is one decision of several checks, or of checks with idempotency records, in
// the steps decide.lua takes: lock the checks' shards, find their records, take every check,
// then charge all of them or none.
type memoryDecision struct {
	s      *Memory
	checks []Check
	out    []algorithm.Decision
	at     time.Time
	now    float64 // at, in microseconds
	// idx[i] is check i's shard and hash[i] its key's hash there; locked are the shards to
	// lock, in order, without repeats.
	idx, locked []int
	hash        []uint64
	// states[i] is check i's state after its take.
	states []algorithm.State
	// recs are the records the checks name; recOf[i] is check i's (1-based; 0 for none).
	recs  []memoryRecord
	recOf []int
	// free[i] is whether check i passes as a free repeat of an admitted request.
	free []bool

	// The slices start in these arrays, so that a decision of up to commonChecks rules, with
	// its memoryDecision from the pool, allocates nothing.
	idxBuf, lockedBuf, recOfBuf [commonChecks]int
	hashBuf                     [commonChecks]uint64
	freeBuf                     [commonChecks]bool
	statesBuf                   [commonChecks]algorithm.State
	recsBuf                     [2]memoryRecord
}

// decisions keeps memoryDecisions for reuse: one is too large for the stack's comfort, and its
// slices point into its own arrays.
var decisions = sync.Pool{New: func() any { return new(memoryDecision) }}

func (d *memoryDecision) init(s *Memory, checks []Check, out []algorithm.Decision) {
	d.s, d.checks, d.out = s, checks, out
	d.at = s.now()
	d.now = algorithm.Micros(d.at)
	d.idx, d.hash, d.locked, d.recOf, d.free = d.idxBuf[:], d.hashBuf[:], d.lockedBuf[:0], d.recOfBuf[:], d.freeBuf[:]
	d.states, d.recs = d.statesBuf[:0], d.recsBuf[:0]
	if n := len(checks); n > commonChecks {
		d.idx, d.hash, d.locked, d.recOf, d.free = make([]int, n), make([]uint64, n), make([]int, 0, n), make([]int, n), make([]bool, n)
		d.states = make([]algorithm.State, 0, n)
	}
}

// release returns the decision to the pool, holding nothing of the request.
func (d *memoryDecision) release() {
	clear(d.states)
	clear(d.recs)
	d.s, d.checks, d.out, d.states, d.recs = nil, nil, nil, nil, nil
	decisions.Put(d)
}

// lock takes the locks of the checks' shards in shard order, so that decisions that share
// shards never deadlock.
func (d *memoryDecision) lock() {
	for i := range d.checks {
		d.idx[i], d.hash[i] = d.s.locate(&d.checks[i])
		// Insertion into the sorted, duplicate-free list of shards to lock.
		n, j := len(d.locked), len(d.locked)
		for j > 0 && d.locked[j-1] > d.idx[i] {
			j--
		}
		if j > 0 && d.locked[j-1] == d.idx[i] {
			continue
		}
		d.locked = append(d.locked, 0)
		copy(d.locked[j+1:n+1], d.locked[j:n])
		d.locked[j] = d.idx[i]
	}
	for _, sh := range d.locked {
		d.s.shards[sh].mu.Lock()
	}
}

func (d *memoryDecision) unlock() {
	for _, sh := range d.locked {
		d.s.shards[sh].mu.Unlock()
	}
}

// findRecords finds the idempotency record each check names, as decide.lua keeps them: checks
// that name the same record share it, and a record past its time is gone.
func (d *memoryDecision) findRecords() {
	for i := range d.checks {
		c := &d.checks[i]
		d.recOf[i] = 0
		if c.Idempotency == nil {
			continue
		}
		k := memoryKey{c.Tag, c.Idempotency.Key}
		for j := range d.recs {
			if d.recs[j].key == k {
				d.recOf[i] = j + 1
			}
		}
		if d.recOf[i] == 0 {
			r := memoryRecord{sh: &d.s.shards[d.idx[i]], key: k, idem: c.Idempotency}
			if r.rec = r.sh.records[k]; r.rec != nil && r.rec.expiresAt <= d.now {
				r.sh.bytes -= r.rec.size(k)
				delete(r.sh.records, k)
				r.rec = nil
			}
			d.recs = append(d.recs, r)
			d.recOf[i] = len(d.recs)
		}
	}
}

// take decides every check at its cost, or passes it uncharged as a free repeat.
func (d *memoryDecision) take() {
	for i := range d.checks {
		c := &d.checks[i]
		st := d.state(i)
		// A cost the rule can never admit is no repeat of an admitted request: it is refused as such.
		if j := d.recOf[i]; j > 0 && d.recs[j-1].free() && c.Cost >= 0 && c.Cost <= c.Limit.Limit {
			// A free repeat of an admitted request, for this check's policy: it passes uncharged.
			d.free[i] = true
			_, d.out[i] = c.Limit.Take(st, d.at, 0)
			d.out[i].Allowed, d.out[i].Wait = true, 0
			d.states = append(d.states, st)
			continue
		}
		d.free[i] = false
		st, dec := c.take(st, d.at)
		d.states, d.out[i] = append(d.states, st), dec
	}
}

// take decides a check at its cost, as the Redis script does: a deferred check (charged by the
// response) that would admit its cost reports its state as it stays, since nothing is charged.
func (c *Check) take(st algorithm.State, at time.Time) (algorithm.State, algorithm.Decision) {
	next, d := c.Limit.TakeAs(st, at, c.Cost, c.Lease)
	if !c.Deferred || !d.Allowed {
		return next, d
	}
	_, d = c.Limit.Take(st, at, 0)
	d.Allowed = true
	return st, d
}

// takeIn is take in place: st becomes the state to store if the check is charged, d its decision.
func (c *Check) takeIn(st *algorithm.State, at time.Time, d *algorithm.Decision) {
	if c.Deferred {
		*st, *d = c.take(*st, at)
		return
	}
	c.Limit.TakeIn(st, at, c.Cost, c.Lease, d)
}

// commitOrRefuseRepeat reports whether the decision is charged: every enforced check allowed,
// and no check's record is that of a refused request whose Retry-After has not come. Such a
// repeat, which no limit refuses now, is refused the same way, by the first enforced check of
// its record, until the record ends.
func (d *memoryDecision) commitOrRefuseRepeat() bool {
	if !charged(d.checks, d.out) {
		return false
	}
	for j := range d.recs {
		r := &d.recs[j]
		if r.rec == nil || r.rec.seen >= 0 {
			continue
		}
		for i := range d.checks {
			if c := &d.checks[i]; c.Enforce && d.recOf[i] == j+1 {
				_, d.out[i] = c.Limit.Take(d.state(i), d.at, 0)
				d.out[i].Allowed, d.out[i].Wait = false, 0
				d.out[i].RetryAfter = time.Duration(max(1, math.Ceil((r.rec.expiresAt-d.now)/1000))) * time.Millisecond
				return false
			}
		}
	}
	return true
}

// keepRefusal ends a decision that charges nothing: the rules that would have allowed report
// their state as it stays (what a cost-0 check sees), and the first refusal of a request with an
// idempotency key is recorded, so that its repeats are refused until its Retry-After.
func (d *memoryDecision) keepRefusal() {
	var retry time.Duration
	never := false
	for i := range d.checks {
		if c := &d.checks[i]; d.out[i].Allowed && !d.free[i] && c.Cost > 0 {
			_, d.out[i] = c.Limit.Take(d.state(i), d.at, 0)
			d.out[i].Allowed = true
		} else if !d.out[i].Allowed && c.Enforce {
			retry = max(retry, d.out[i].RetryAfter)
			never = never || d.out[i].Never
		}
	}
	for j := range d.recs {
		// A request that can never pass leaves no record: its repeats are refused as it was,
		// never with a Retry-After that the record's time would promise.
		if r := &d.recs[j]; r.rec == nil && !never {
			// Its repeats are refused until its Retry-After, in whole milliseconds as Redis
			// keeps the record's TTL.
			d.s.makeRecordRoom(r.sh, d.now, r.key)
			ms := max(1, math.Ceil(float64(retry.Microseconds())/1000))
			r.sh.records[r.key] = &idemRecord{seen: -1, expiresAt: d.now + ms*1000}
		}
	}
}

// charge stores every charged check's state and counts the request in its records.
func (d *memoryDecision) charge() {
	for i := range d.checks {
		if !d.free[i] {
			d.store(i)
		}
	}
	for j := range d.recs {
		if r := &d.recs[j]; r.rec != nil {
			r.rec.seen++ // a repeat, free or charged
		} else {
			d.s.makeRecordRoom(r.sh, d.now, r.key)
			r.sh.records[r.key] = &idemRecord{expiresAt: d.now + float64(r.idem.Window.Microseconds())}
		}
	}
}

// Finish implements Store: each check in turn, under the locks of their shards.
func (s *Memory) Finish(_ context.Context, checks []Check, out []algorithm.Decision) error {
	s.settle(checks, out, func(c *Check, st algorithm.State, at time.Time) (algorithm.State, algorithm.Decision) {
		if c.Limit.Kind == algorithm.Concurrency {
			return c.Limit.Release(st, at, c.Lease, c.Cost)
		}
		return c.Limit.Charge(st, at, c.Cost)
	})
	return nil
}

// Renew implements Store.
func (s *Memory) Renew(_ context.Context, checks []Check, out []algorithm.Decision) error {
	s.settle(checks, out, func(c *Check, st algorithm.State, at time.Time) (algorithm.State, algorithm.Decision) {
		if c.Limit.Kind == algorithm.Concurrency {
			return c.Limit.Renew(st, at, c.Lease, c.Cost)
		}
		_, d := c.Limit.Take(st, at, 0)
		return st, d
	})
	return nil
}

// settle applies step to each check in turn, each seeing what the ones before it stored, and
// stores what it returns when it allows (a post-response charge always does but on a leaky
// bucket; a release and a renewal always do).
func (s *Memory) settle(checks []Check, out []algorithm.Decision, step func(*Check, algorithm.State, time.Time) (algorithm.State, algorithm.Decision)) {
	d := decisions.Get().(*memoryDecision)
	defer d.release()
	d.init(s, checks, out)
	d.lock()
	defer d.unlock()
	for i := range checks {
		c := &checks[i]
		sh := &s.shards[d.idx[i]]
		k := memoryKey{c.Tag, c.Rule}
		e := sh.get(d.hash[i], k)
		var st algorithm.State
		if e != nil {
			st = e.st
		}
		next, dec := step(c, st, d.at)
		out[i] = dec
		if dec.Allowed && (e != nil || dec.Reset > 0) { // a fresh key left idle needs no entry
			s.put(sh, d.hash[i], k, e, &next, d.now+float64(dec.Reset.Microseconds()), d.now)
		}
	}
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
	i, h := s.locate(c)
	sh := &s.shards[i]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	at := s.now()
	now := algorithm.Micros(at)
	k := memoryKey{c.Tag, c.Rule}
	e := sh.get(h, k) // one lookup serves both the read and the write
	var st algorithm.State
	if e != nil {
		st = e.st
	}
	d := &out[0]
	c.takeIn(&st, at, d)
	if c.Enforce && !d.Allowed {
		return false, nil
	}
	if d.Allowed && c.Cost > 0 && !c.Deferred {
		s.put(sh, h, k, e, &st, now+float64(d.Reset.Microseconds()), now)
	}
	return true, nil
}

// put stores a charged state under k, whose hash is h and whose entry is e or, if nil, new: it
// makes room for the bytes the entry grows by, then counts them. The caller holds the shard's
// lock.
func (s *Memory) put(sh *shard, h uint64, k memoryKey, e *memoryEntry, st *algorithm.State, idleAt, now float64) {
	before := int64(0)
	if e == nil {
		e = &memoryEntry{key: k, hash: h}
		s.makeRoom(sh, now, k, true, e.size()+int64(cap(st.Log))*algorithm.LogEntrySize)
		sh.add(e)
	} else {
		before = e.size()
	}
	e.keep(st, idleAt)
	grown := e.size() - before
	if before > 0 && grown > 0 {
		s.makeRoom(sh, now, k, false, grown)
	}
	sh.bytes += grown
}

// state is check i's state as its shard holds it.
func (d *memoryDecision) state(i int) algorithm.State {
	c := &d.checks[i]
	if e := d.s.shards[d.idx[i]].get(d.hash[i], memoryKey{c.Tag, c.Rule}); e != nil {
		return e.st
	}
	return algorithm.State{}
}

// store keeps the state check i's charge produced. The caller holds the shard's lock.
func (d *memoryDecision) store(i int) {
	c, dec := &d.checks[i], &d.out[i]
	if !dec.Allowed || c.Cost == 0 || c.Deferred {
		return // a check, a shadow rule that would refuse, a rule charged by the response: nothing to charge
	}
	sh, k := &d.s.shards[d.idx[i]], memoryKey{c.Tag, c.Rule}
	d.s.put(sh, d.hash[i], k, sh.get(d.hash[i], k), &d.states[i], d.now+float64(dec.Reset.Microseconds()), d.now)
}

// evictionSample is how many entries a full shard looks at to choose the one to evict.
const evictionSample = 8

// makeRoom keeps a shard within its bounds before it grows by need bytes, a new key's or a
// growing sliding log's (isNew false): see evict. The key being written, keep, is never the
// one evicted.
func (s *Memory) makeRoom(sh *shard, now float64, keep memoryKey, isNew bool, need int64) {
	for sh.keys() > 0 && (isNew && sh.keys() >= s.perShard || sh.bytes+need > s.shardBytes) {
		if !sh.evictEntry(&keep, now) {
			break
		}
	}
	for len(sh.records) > 0 && sh.bytes+need > s.shardBytes {
		if !sh.evictRecord(now) {
			break
		}
	}
}

// makeRecordRoom keeps a shard's idempotency records within the same bounds before an insert.
func (s *Memory) makeRecordRoom(sh *shard, now float64, k memoryKey) {
	need := recordBytes + int64(len(k.tag)+len(k.rule))
	for len(sh.records) > 0 && (len(sh.records) >= s.perShard || sh.bytes+need > s.shardBytes) {
		if !sh.evictRecord(now) {
			break
		}
	}
	for sh.keys() > 0 && sh.bytes+need > s.shardBytes {
		if !sh.evictEntry(nil, now) {
			break
		}
	}
	sh.bytes += need
}

func (r *idemRecord) size(k memoryKey) int64 { return recordBytes + int64(len(k.tag)+len(k.rule)) }

// evict drops, among a sample of a full map's entries other than keep (nil: none), those that
// are over (their end has come) or, if none is, the one closest to its end, and takes their
// bytes off the shard's count. It reports whether it dropped any. Evicting a live entry forgets
// some usage of one client; the bounds are what keep a flood of random keys, or of large
// sliding logs, from exhausting memory.
func evict[V any](sample iter.Seq2[memoryKey, V], keep *memoryKey, now float64, end func(V) float64, drop func(memoryKey, V)) bool {
	var victim memoryKey
	var victimV V
	victimEnd, seen, dropped := 0.0, 0, false
	for k, v := range sample {
		if keep != nil && k == *keep {
			continue
		}
		if e := end(v); e <= now {
			drop(k, v)
			dropped = true
		} else if seen == 0 || e < victimEnd {
			victim, victimV, victimEnd = k, v, e
		}
		if seen++; seen >= evictionSample {
			break
		}
	}
	if !dropped && seen > 0 {
		drop(victim, victimV)
		dropped = true
	}
	return dropped
}

// evictEntry evicts among the shard's entries: see evict.
func (sh *shard) evictEntry(keep *memoryKey, now float64) bool {
	return evict(sh.entries, keep, now, func(e *memoryEntry) float64 { return e.idleAt }, func(_ memoryKey, e *memoryEntry) { sh.drop(e) })
}

// evictRecord evicts among the shard's idempotency records: see evict.
func (sh *shard) evictRecord(now float64) bool {
	return evict(maps.All(sh.records), nil, now, func(r *idemRecord) float64 { return r.expiresAt }, func(k memoryKey, r *idemRecord) {
		sh.bytes -= r.size(k)
		delete(sh.records, k)
	})
}

// Sweep removes every entry whose state is back to idle.
func (s *Memory) Sweep() {
	now := algorithm.Micros(s.now())
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for _, e := range sh.entries {
			if e.idleAt <= now {
				sh.drop(e)
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
		n += s.shards[i].keys() + len(s.shards[i].records)
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
