package store

import "time"

// SetClock makes the Redis store pass f's time to the script instead of letting it read Redis
// TIME, so that tests can drive time. Production code cannot reach it.
func (s *Redis) SetClock(f func() time.Time) { s.clock = f }

// DecodeDecisions exposes the reply decoder to tests.
var DecodeDecisions = decodeDecisions

// LeaseKey exposes the key of a leased token bucket's leases to tests.
func (c *Check) LeaseKey() string { return c.leaseKey() }

// WaitRefills waits for the lease refills in flight, so that a test's clock moves only after
// them.
func (s *Redis) WaitRefills() { s.refills.Wait() }

// BeforeLeaseScript makes f run before each script of the leases (a trip or a refill) is sent,
// once its units are reserved.
func (s *Redis) BeforeLeaseScript(f func()) { s.leaseScript = f }

// BeforeLeaseAnswer makes f run once the answer to each script of the leases came, before it is
// noted.
func (s *Redis) BeforeLeaseAnswer(f func()) { s.leaseAnswer = f }

// NewCollidingMemory returns a memory store in which every key's hash is the same, so that all
// but one key of each shard take the collided path.
func NewCollidingMemory(opts MemoryOptions) *Memory {
	s := NewMemory(opts)
	s.collide = true
	return s
}

// Functions reports whether decisions go by FCALL of the decide script's library.
func (s *Redis) Functions() bool { return s.scripts.loaded.Load() }

// DecideLibrary and DecideFunction are the decide script's function library and its function.
var DecideLibrary, DecideFunction = decideLibrary, decideFunction
