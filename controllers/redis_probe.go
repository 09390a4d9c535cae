package controllers

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
	"k8s.io/utils/clock"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// RedisProbe reports whether any of a Redis's addresses accepts a connection.
type RedisProbe func(ctx context.Context, addrs []string) error

// DialRedis is the RedisProbe of the manager: a TCP connection to any address, within 2 seconds.
// It sees Redis from the manager's network position, not the enforcers', and cannot tell a wrong
// password: the controller uses it only for a policy none of whose replicas reports, whose own
// reports say all of that.
func DialRedis(ctx context.Context, addrs []string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var d net.Dialer
	var errs []error
	for _, a := range addrs {
		c, err := d.DialContext(ctx, "tcp", a)
		if err == nil {
			return c.Close()
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// SharedProbe makes the policies that name the same Redis share its probe: a result is reused
// for ttl by clk, and concurrent probes of one address list wait for the one in flight. Without
// it, a thousand policies on one unreachable Redis would each hold a worker for the dial's timeout.
// The shared probe runs with a context of its own, bounded by sharedProbeTimeout: the reconcile
// that happened to start it may end or be cancelled without failing the others, and without its
// cancellation being cached as an unreachable Redis. A waiter whose context ends stops waiting.
func SharedProbe(probe RedisProbe, ttl time.Duration, clk clock.PassiveClock) RedisProbe {
	type result struct {
		err error
		at  time.Time
	}
	var (
		mu      sync.Mutex
		results = map[string]result{}
		flight  singleflight.Group
	)
	return func(ctx context.Context, addrs []string) error {
		key := strings.Join(addrs, ",")
		mu.Lock()
		res, ok := results[key]
		mu.Unlock()
		if ok && clk.Since(res.at) < ttl {
			return res.err
		}
		ch := flight.DoChan(key, func() (any, error) {
			// A caller that missed the cache while the last flight stored its result, and
			// came after that flight ended, finds the result here.
			mu.Lock()
			cached, ok := results[key]
			mu.Unlock()
			if ok && clk.Since(cached.at) < ttl {
				return cached, nil
			}
			probeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sharedProbeTimeout)
			defer cancel()
			err := probe(probeCtx, addrs)
			res := result{err: err, at: clk.Now()}
			mu.Lock()
			defer mu.Unlock()
			for k, old := range results { // forget lists no policy names any more
				if res.at.Sub(old.at) >= ttl {
					delete(results, k)
				}
			}
			results[key] = res
			return res, nil
		})
		select {
		case v := <-ch:
			return v.Val.(result).err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// sharedProbeTimeout bounds a shared probe, whoever waits for it.
const sharedProbeTimeout = 5 * time.Second

// probeRedis probes the Redis of a pool's storage.redis, and returns why it is unreachable, or
// "", and whether it probed. A managed Redis is watched through its Deployment instead.
func (r *RateLimitPolicyReconciler) probeRedis(ctx context.Context, s *v1alpha1.Storage) (string, bool) {
	if r.ProbeRedis == nil || s == nil || s.Redis == nil {
		return "", false
	}
	addrs := make([]string, len(s.Redis.Addresses))
	for i, a := range s.Redis.Addresses {
		addrs[i] = string(a)
	}
	if err := r.ProbeRedis(ctx, addrs); err != nil {
		if ctx.Err() != nil {
			return "", false // the reconcile ended, which says nothing of Redis
		}
		return fmt.Sprintf("the manager cannot reach Redis at %s: %v; while the enforcers cannot either, each rule applies its failureMode",
			strings.Join(addrs, ", "), err), true
	}
	return "", true
}
