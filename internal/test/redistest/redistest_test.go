package redistest_test

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// timeScript returns the server's clock from TIME, in microseconds.
var timeScript = redis.NewScript(`
local t = redis.call('TIME')
redis.call('SET', KEYS[1], t[1], 'PX', 10000)
return tonumber(t[1]) * 1000000 + tonumber(t[2])
`)

func checkTime(t *testing.T, c redis.Scripter, key string) {
	t.Helper()
	us, err := timeScript.Run(context.Background(), c, []string{key}).Int64()
	if err != nil {
		t.Fatalf("run the TIME script for %s: %v", key, err)
	}
	if d := time.Since(time.UnixMicro(us)); d < -2*time.Second || d > 2*time.Second {
		t.Errorf("Redis TIME differs from the local clock by %v", d)
	}
}

func TestStandaloneWhenStartedThenAnswersLuaWithTIME(t *testing.T) {
	s := redistest.NewServer(t)
	c := s.Client(t)
	checkTime(t, c, "smoke")
	if ttl := c.PTTL(context.Background(), "smoke").Val(); ttl <= 0 {
		t.Errorf("PTTL = %v, want a TTL set by the script", ttl)
	}
}

func TestStandaloneWhenKilledAndRestartedThenServesAgainOnTheSamePort(t *testing.T) {
	s := redistest.NewServer(t)
	c := s.Client(t)
	s.Kill()
	if err := c.Ping(context.Background()).Err(); err == nil {
		t.Fatal("PING succeeded against a killed server")
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("PING after restart: %v", err)
	}
}

func TestClusterWhenStartedThenThreeMastersCoverAllSlotsAndRunLua(t *testing.T) {
	cl := redistest.NewCluster(t, 3)
	c := cl.Client(t)
	ctx := context.Background()

	info, err := c.ClusterInfo(ctx).Result()
	if err != nil || !strings.Contains(info, "cluster_slots_assigned:16384") || !strings.Contains(info, "cluster_known_nodes:3") {
		t.Fatalf("cluster info = %q, %v; want 16384 slots on 3 nodes", info, err)
	}
	// Keys in different hash tags land on different masters; the script runs on each.
	masters := map[string]bool{}
	for i := range 30 {
		key := fmt.Sprintf("{tag%d}:k", i)
		checkTime(t, c, key)
		slot := c.ClusterKeySlot(ctx, key).Val()
		for _, shard := range c.ClusterShards(ctx).Val() {
			for _, r := range shard.Slots {
				if slot >= r.Start && slot <= r.End {
					masters[shard.Nodes[0].Endpoint+":"+fmt.Sprint(shard.Nodes[0].Port)] = true
				}
			}
		}
	}
	if len(masters) != 3 {
		t.Errorf("scripts ran on %d masters, want 3", len(masters))
	}
}

// A server whose port another redis-server took meanwhile (another package's test binary) fails
// to start, rather than answering PING with the other's: a test must never decide against a
// server it does not own, which may stop under it.
func TestStandaloneWhenAnotherServerHoldsItsPortThenStartFails(t *testing.T) {
	s := redistest.NewServer(t)
	s.Kill()
	other := exec.Command("redis-server", "--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	if err := poll.Until(10*time.Second, func() error { return c.Ping(context.Background()).Err() }); err != nil {
		t.Fatal(err)
	}
	err := s.Start()
	if err == nil || !strings.Contains(err.Error(), "another redis-server's") {
		t.Fatalf("Start on a port another server holds: %v, want it refused", err)
	}
}
