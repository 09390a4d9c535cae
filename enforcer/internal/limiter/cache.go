package limiter

import (
	"hash/maphash"
	"sync"
	"time"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/algorithm"
)

const refusalShards = 16

// refusalCache remembers, per rule and client, until when the store refuses requests of a given
// cost. It is bounded: when a shard is full, expired entries go, and if none has expired the
// refusal is simply not cached (the store will be asked again).
type refusalCache struct {
	seed     maphash.Seed
	perShard int
	shards   [refusalShards]struct {
		mu sync.Mutex
		m  map[refusalKey]refusal
	}
}

type refusalKey struct{ tag, rule string }

type refusal struct {
	until time.Time
	cost  int64
	// limit is the rule's limit when the store refused: a reloaded rule with another limit
	// (a raised capacity, say) is asked again.
	limit algorithm.Limit
	d     algorithm.Decision
}

func newRefusalCache(capacity int) *refusalCache {
	c := &refusalCache{seed: maphash.MakeSeed(), perShard: capacity / refusalShards}
	for i := range c.shards {
		c.shards[i].m = make(map[refusalKey]refusal)
	}
	return c
}

func (c *refusalCache) shard(k refusalKey) int {
	return int(maphash.String(c.seed, k.tag) % refusalShards)
}

func (c *refusalCache) put(check *store.Check, d algorithm.Decision, now time.Time) {
	if c == nil || d.RetryAfter <= 0 {
		return
	}
	k := refusalKey{check.Tag, check.Rule}
	sh := &c.shards[c.shard(k)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if len(sh.m) >= c.perShard {
		for key, r := range sh.m {
			if !now.Before(r.until) {
				delete(sh.m, key)
			}
		}
		if len(sh.m) >= c.perShard {
			return
		}
	}
	sh.m[k] = refusal{until: now.Add(d.RetryAfter), cost: check.Cost, limit: check.Limit, d: d}
}

// clear forgets every refusal.
func (c *refusalCache) clear() {
	if c == nil {
		return
	}
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		clear(sh.m)
		sh.mu.Unlock()
	}
}

// get returns the cached refusal of a check, with its retry-after and reset brought to now.
func (c *refusalCache) get(check *store.Check, now time.Time) (algorithm.Decision, bool) {
	k := refusalKey{check.Tag, check.Rule}
	sh := &c.shards[c.shard(k)]
	sh.mu.Lock()
	r, ok := sh.m[k]
	if ok && !now.Before(r.until) {
		delete(sh.m, k)
		ok = false
	}
	sh.mu.Unlock()
	if !ok || check.Cost < r.cost || check.Limit != r.limit {
		return algorithm.Decision{}, false
	}
	d := r.d
	d.RetryAfter = r.until.Sub(now)
	d.Reset = max(0, r.d.Reset-(r.d.RetryAfter-d.RetryAfter)) // less the time since it was cached
	return d, true
}
