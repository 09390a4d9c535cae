package store

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/algorithm"
	"github.com/sluice-dev/sluice/internal/settings"
)

// RedisOptions configure a Redis store.
type RedisOptions struct {
	// Mode is the topology, the API's own type: one definition of it.
	Mode       v1alpha1.RedisMode
	Addrs      []string
	MasterName string
	DB         int
	Username   string
	Password   string
	// Credentials, when set, replaces Username and Password: it is asked at every new
	// connection, so rotated credentials (a mounted Secret the kubelet updates) take effect
	// without a restart.
	Credentials func() (username, password string)
	TLS         *tls.Config
	// Timeout bounds each call. Default settings.Defaults().RedisTimeout.
	Timeout time.Duration
	// PoolSize is the number of connections per node. Default go-redis's (10 per CPU).
	PoolSize int
	// Pipelines is how many pipelines of concurrent decisions may be in flight at once, on
	// Standalone and Sentinel (see batcher). Default 4; negative sends every decision on its own.
	Pipelines int
	// Now, for tests only, replaces Redis TIME as the scripts' time, so that a test can move
	// time on instead of sleeping. Nil in production: every replica must read Redis's clock.
	Now func() time.Time
}

// Redis is the store for many enforcer replicas. Each decision is one Lua script per hash tag:
// on a standalone or Sentinel Redis every key lives on one server, so a decision is exactly one
// script call in at most one round trip, whatever the number of rules; concurrent decisions share
// pipelines (see batcher). On a Cluster, rules with the
// same client key share a tag and are decided by one script; rules with different client keys
// are decided by one script per tag, and when any of them refuses, a refund script gives back
// what the others charged. See docs/guarantees.md.
//
// Decisions are never retried: a script that timed out may still run, and a retry would charge
// twice. A timeout is an error, and the caller applies each rule's failure mode.
type Redis struct {
	client  redis.UniversalClient
	cluster bool
	timeout time.Duration
	idBase  string
	seq     atomic.Uint64
	// clock, when set by tests, replaces Redis TIME. Production leaves it nil.
	clock func() time.Time
	// leaseScript and leaseAnswer, when set by tests, run before each script of the leases (a
	// trip, a refill) is sent, once it reserved its units, and once its answer came, before it
	// is noted: they hold a decision between its bookkeeping and Redis. Production leaves them
	// nil.
	leaseScript, leaseAnswer func()
	// scripts runs the decide script; batch pipelines decisions through it, nil on a Cluster,
	// where every tag may live on another node.
	scripts *scripts
	batch   *batcher
	// leases are the units this enforcer holds of leased rules; refills, the trips in flight
	// that take units ahead.
	leases  leases
	refills sync.WaitGroup
}

// NewRedis connects to Redis. It does not wait for Redis to answer: decisions fail until it does.
func NewRedis(opts RedisOptions) (*Redis, error) {
	if len(opts.Addrs) == 0 {
		return nil, errors.New("redis: no addresses")
	}
	if opts.Timeout <= 0 {
		opts.Timeout = settings.Defaults().RedisTimeout
	}
	client, err := newClient(opts)
	if err != nil {
		return nil, err
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	s := &Redis{
		client:  client,
		cluster: opts.Mode == v1alpha1.RedisCluster,
		timeout: opts.Timeout,
		idBase:  hex.EncodeToString(b[:]) + ".",
		clock:   opts.Now,
		scripts: newScripts(client, decideScript, decideLibrary, decideFunction, opts.Timeout),
	}
	if opts.Pipelines == 0 {
		opts.Pipelines = 4
	}
	if !s.cluster && opts.Pipelines > 0 {
		s.batch = newBatcher(s.scripts, opts.Pipelines, opts.Timeout)
	}
	s.scripts.load()
	return s, nil
}

// newClient is the go-redis client of the options' mode, every call bounded by their timeout.
func newClient(opts RedisOptions) (redis.UniversalClient, error) {
	uo := &redis.UniversalOptions{
		Addrs:                 opts.Addrs,
		DB:                    opts.DB,
		Username:              opts.Username,
		Password:              opts.Password,
		CredentialsProvider:   opts.Credentials,
		TLSConfig:             opts.TLS,
		DialTimeout:           opts.Timeout,
		ReadTimeout:           opts.Timeout,
		WriteTimeout:          opts.Timeout,
		PoolTimeout:           opts.Timeout,
		ContextTimeoutEnabled: true,
		PoolSize:              opts.PoolSize,
		// No retries and no redirects: a replayed decision would charge twice. After a MOVED
		// reply the slot map reloads, and the next decision goes to the right node.
		MaxRetries:   -1,
		MaxRedirects: -1,
		// One dial per new connection: go-redis's five, 100 ms apart, outlast a decision's
		// timeout, which then fails with its deadline rather than the refused connection or
		// unknown host that names the cause. The next decision dials again.
		DialerRetries: 1,
	}
	switch opts.Mode {
	case v1alpha1.RedisStandalone, "":
		if len(opts.Addrs) != 1 {
			return nil, fmt.Errorf("redis: mode Standalone takes one address, got %d", len(opts.Addrs))
		}
		return redis.NewClient(uo.Simple()), nil
	case v1alpha1.RedisSentinel:
		if opts.MasterName == "" {
			return nil, errors.New("redis: mode Sentinel needs a master name")
		}
		uo.MasterName = opts.MasterName
		return redis.NewFailoverClient(uo.Failover()), nil
	case v1alpha1.RedisCluster:
		return redis.NewClusterClient(uo.Cluster()), nil
	}
	return nil, fmt.Errorf("redis: unknown mode %q", opts.Mode)
}

// Client is the underlying client.
func (s *Redis) Client() redis.UniversalClient { return s.client }

// Ping asks Redis for PONG, within ctx's deadline. Its error is Redis's own when Redis answered:
// a wrong password gives the server's WRONGPASS message.
func (s *Redis) Ping(ctx context.Context) error { return s.client.Ping(ctx).Err() }

// Timeout is the deadline of each call.
func (s *Redis) Timeout() time.Duration { return s.timeout }

// Close stops sending decisions and closes the connections.
func (s *Redis) Close() error {
	s.leases.mu.Lock()
	s.leases.closed = true
	s.leases.mu.Unlock()
	s.refills.Wait()
	if s.batch != nil {
		s.batch.close()
	}
	s.scripts.close()
	return s.client.Close()
}

// Decide implements Store.
func (s *Redis) Decide(ctx context.Context, checks []Check, out []algorithm.Decision) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	if s.leasing(checks) {
		return s.decideLeased(ctx, checks, out)
	}
	id := s.requestID(checks)

	if !s.cluster {
		// One server holds every key: one script decides them all.
		ok, _, err := s.run(ctx, modeDecide, checks, indexes(len(checks)), id, out, nil)
		return ok, err
	}
	ok, err := s.decideCluster(ctx, checks, id, out)
	s.followFailover(ctx, err)
	return ok, err
}

// The decide script's modes.
const (
	modeDecide = "d"
	modeFinish = "f"
	modeRenew  = "r"
)

// requestID names a decision's request: the Lease the limiter gave it, or a name of the store's
// own, unique across enforcers.
func (s *Redis) requestID(checks []Check) string {
	for i := range checks {
		if checks[i].Lease != "" {
			return checks[i].Lease
		}
	}
	return s.idBase + strconv.FormatUint(s.seq.Add(1), 36)
}

// followFailover asks a Cluster client to reload its slot map after a failed call. A master that
// died cannot answer MOVED, and go-redis otherwise reloads the slot map only once a minute: ask
// it to reload now, so calls follow a promoted replica as soon as the cluster has one. Reloads
// run in the background, one at a time.
func (s *Redis) followFailover(ctx context.Context, err error) {
	if s.cluster && err != nil && !errors.Is(err, ErrFault) && !errors.Is(err, context.Canceled) {
		s.client.(*redis.ClusterClient).ReloadState(context.WithoutCancel(ctx))
	}
}

// Finish implements Store: one script per hash tag, in the decide script's finish mode.
func (s *Redis) Finish(ctx context.Context, checks []Check, out []algorithm.Decision) error {
	return s.settle(ctx, modeFinish, checks, out)
}

// Renew implements Store: one script per hash tag, in the decide script's renew mode.
func (s *Redis) Renew(ctx context.Context, checks []Check, out []algorithm.Decision) error {
	return s.settle(ctx, modeRenew, checks, out)
}

// settle runs the decide script in a mode that never refuses, once per hash tag.
func (s *Redis) settle(ctx context.Context, mode string, checks []Check, out []algorithm.Decision) error {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	id := s.requestID(checks)
	groups := [][]int{indexes(len(checks))}
	if s.cluster {
		groups = s.groups(checks, indexes(len(checks)))
	}
	var errs []error
	for _, g := range groups {
		if _, _, err := s.run(ctx, mode, checks, g, id, out, nil); err != nil {
			errs = append(errs, err)
		}
	}
	err := errors.Join(errs...)
	s.followFailover(ctx, err)
	return err
}

// decideCluster decides on a Cluster: one script per hash tag of the decision.
func (s *Redis) decideCluster(ctx context.Context, checks []Check, id string, out []algorithm.Decision) (bool, error) {
	return s.decideGroups(ctx, checks, s.groups(checks, indexes(len(checks))), id, out)
}

// decideGroups decides the groups of checks, one script each, all or nothing.
func (s *Redis) decideGroups(ctx context.Context, checks []Check, groups [][]int, id string, out []algorithm.Decision) (bool, error) {
	if len(groups) == 1 {
		ok, _, err := s.run(ctx, modeDecide, checks, groups[0], id, out, nil)
		return ok, err
	}
	// Cluster, several tags: each group is decided by its own script; any refusal refunds the
	// groups that charged, less their free repeats.
	all := true
	chargedAt := make([]int64, len(groups))
	free := make([]bool, len(checks))
	for gi, g := range groups {
		ok, at, err := s.run(ctx, modeDecide, checks, g, id, out, free)
		if err != nil {
			s.refund(ctx, checks, groups[:gi], chargedAt[:gi], id, out, free)
			return false, err
		}
		chargedAt[gi] = at
		if !ok {
			all = false
			chargedAt[gi] = 0
		}
	}
	if !all {
		s.refund(ctx, checks, groups, chargedAt[:len(groups)], id, out, free)
	}
	return all, nil
}

// indexes returns 0..n-1, without allocating for the common decision.
func indexes(n int) []int {
	if n <= len(commonIndexes) {
		return commonIndexes[:n]
	}
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	return idx
}

var commonIndexes = func() (idx [commonChecks]int) {
	for i := range idx {
		idx[i] = i
	}
	return idx
}()

// groups partitions the checks of a Cluster decision named by idx by tag: the sets one script
// may decide.
func (s *Redis) groups(checks []Check, idx []int) [][]int {
	var groups [][]int
	for _, i := range idx {
		placed := false
		for gi, g := range groups {
			if checks[g[0]].Tag == checks[i].Tag {
				groups[gi] = append(g, i)
				placed = true
				break
			}
		}
		if !placed {
			groups = append(groups, []int{i})
		}
	}
	return groups
}

// run decides one group with one script call. It returns whether the group charged and the
// time it decided at, in microseconds; free, when not nil, receives which checks passed as free
// repeats, uncharged.
func (s *Redis) run(ctx context.Context, mode string, checks []Check, group []int, id string, out []algorithm.Decision, free []bool) (bool, int64, error) {
	keys, args := s.scriptArgs(mode, checks, group, id)
	var reply any
	var err error
	if s.batch != nil {
		reply, err = s.batch.run(ctx, keys, args)
	} else {
		c := &scriptCall{keys: keys, args: args}
		s.scripts.run(ctx, []*scriptCall{c})
		reply, err = c.reply, c.err
	}
	if err != nil {
		if scriptFault(err) {
			err = fmt.Errorf("%w: %w", ErrFault, err)
		}
		return false, 0, fmt.Errorf("run the decide script: %w", err)
	}
	return decodeDecisions(reply, checks, group, out, free)
}

// scriptArgs are the keys and arguments of the decide script for one group, as its header
// describes them.
func (s *Redis) scriptArgs(mode string, checks []Check, group []int, id string) ([]string, []any) {
	keys := make([]string, len(group), len(group)+1)
	args := make([]any, 5, 5+argsPerRule*len(group))
	args[0], args[1], args[2], args[3], args[4] = "", id, "", mode, s.idBase
	if s.clock != nil {
		args[0] = strconv.FormatInt(s.clock().UnixMicro(), 10)
	}
	var records []string   // the records' keys, KEYS[n+1...]
	var leaseKeys []string // the leased token buckets' leases, after the records
	var specs string       // their windows and free repeats, ARGV[3]
	for i, ci := range group {
		c := &checks[ci]
		keys[i] = c.Key()
		record := 0
		if c.Idempotency != nil {
			record, records, specs = recordOf(c, records, specs)
		}
		leases, take, expiry := 0, int64(-1), int64(0)
		if c.UnitLease != nil {
			if c.Limit.Kind == algorithm.TokenBucket {
				leaseKeys = append(leaseKeys, c.leaseKey())
				leases = len(leaseKeys)
			}
			if c.taking {
				take, expiry = c.extra, c.UnitLease.Expiry.Microseconds()
			}
		}
		args = append(args, int(c.Limit.Kind), c.Limit.Limit, c.Limit.Rate,
			c.Limit.Period.Microseconds(), c.Limit.MaxWait.Microseconds(), c.Cost, flag(c.Enforce), record, flag(c.Deferred),
			leases, take, expiry, c.back, c.backAt, c.hold, c.spent)
	}
	keys = append(keys, records...)
	keys = append(keys, leaseKeys...)
	args[2] = specs
	return keys, args
}

// recordOf is the number (from 1) of a check's idempotency record among records, added with its
// window and free repeats to specs if it is new.
func recordOf(c *Check, records []string, specs string) (int, []string, string) {
	rk := c.recordKey()
	for j, k := range records {
		if k == rk {
			return j + 1, records, specs
		}
	}
	if specs != "" {
		specs += " "
	}
	specs += strconv.FormatInt(c.Idempotency.Window.Milliseconds(), 10) + ":" + strconv.FormatInt(c.Idempotency.MaxRepeats, 10)
	return len(records) + 1, append(records, rk), specs
}

// flag is a boolean argument of the decide script.
func flag(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// scriptFault reports whether Redis ran the script and the script failed: a runtime error
// ("ERR user_script:...") or a command on a key of the wrong type. Other error replies (LOADING,
// READONLY, MASTERDOWN, CLUSTERDOWN, NOAUTH, OOM, ...) say that the server cannot serve anyone.
func scriptFault(err error) bool {
	var reply redis.Error
	if !errors.As(err, &reply) {
		return false // a timeout, a refused connection: no reply at all
	}
	msg := reply.Error()
	return strings.HasPrefix(msg, "WRONGTYPE ") || strings.HasPrefix(msg, "ERR ") && strings.Contains(msg, "script")
}

// decodeDecisions reads the decide script's reply: {committed, now_us, then per rule allowed,
// remaining, reset_us, retry_us, wait_us, leased}. committed is 1 when the group was charged, 2
// when every rule passed as a free repeat (nothing charged, but the records counted the repeat,
// which a refund takes back), 0 when refused; a rule's allowed is 2 when it passed as a free
// repeat, which free, when not nil, receives. A check taking a lease (the lease path's copy of
// it) receives what was leased, and when. Anything else is ErrUnexpectedReply, never a panic.
func decodeDecisions(reply any, checks []Check, group []int, out []algorithm.Decision, free []bool) (bool, int64, error) {
	vals, ok := reply.([]any)
	if !ok || len(vals) != 2+repliesPerRule*len(group) {
		return false, 0, fmt.Errorf("%w: %T of %d values for %d rules", ErrUnexpectedReply, reply, len(vals), len(group))
	}
	ints := make([]int64, len(vals))
	for i, v := range vals {
		n, ok := v.(int64)
		if !ok {
			return false, 0, fmt.Errorf("%w: value %d is %T", ErrUnexpectedReply, i, v)
		}
		ints[i] = n
	}
	for i, ci := range group {
		r := ints[2+repliesPerRule*i:]
		out[ci] = algorithm.Decision{
			Allowed:   r[0] == 1 || r[0] == 2,
			Limit:     checks[ci].Limit.Limit,
			Remaining: r[1],
			Reset:     time.Duration(r[2]) * time.Microsecond,
			Wait:      time.Duration(r[4]) * time.Microsecond,
		}
		if free != nil {
			free[ci] = r[0] == 2
		}
		if checks[ci].taking {
			checks[ci].granted, checks[ci].at = r[5], ints[1]
		}
		if r[3] == retryNever {
			out[ci].Never = true
		} else {
			out[ci].RetryAfter = time.Duration(r[3]) * time.Microsecond
		}
	}
	if ints[0] == 1 || ints[0] == 2 {
		return true, ints[1], nil
	}
	return false, ints[1], nil
}

// The decide script's arguments and reply values per rule (decide.lua).
const (
	argsPerRule    = 16
	repliesPerRule = 6
)

// retryNever is the decide script's retry_us for a rule the request can never pass.
const retryNever = -1

// refund gives back what the groups with a non-zero charge time charged, and the counts of
// the records they wrote. Best effort: an error leaves the charge, which expires with its key.
func (s *Redis) refund(ctx context.Context, checks []Check, groups [][]int, chargedAt []int64, id string, out []algorithm.Decision, free []bool) {
	for gi, g := range groups {
		if chargedAt[gi] == 0 {
			continue
		}
		keys := make([]string, 0, len(g)+1)
		args := []any{chargedAt[gi], id, ""}
		// A rule named twice in one decision was charged once, the last cost (decide.lua), so
		// only its last charged check is given back: the checks are walked from the end.
		for _, ci := range slices.Backward(g) {
			c := &checks[ci]
			if c.Cost == 0 || !out[ci].Allowed || free[ci] || c.Deferred || slices.Contains(keys, c.Key()) {
				continue // not charged: a check, a refusing shadow rule, a free repeat, a rule charged by the response, a rule named again
			}
			keys = append(keys, c.Key())
			args = append(args, int(c.Limit.Kind), c.Limit.Rate, c.Limit.Period.Microseconds(), c.Cost)
		}
		records := 0
		for _, ci := range g {
			if c := &checks[ci]; c.Idempotency != nil && !slices.Contains(keys[len(keys)-records:], c.recordKey()) {
				keys = append(keys, c.recordKey())
				records++
			}
		}
		if records > 0 {
			args[2] = strconv.Itoa(records)
		}
		if len(keys) > 0 {
			_ = refundScript.Run(ctx, s.client, keys, args...).Err()
		}
	}
}
