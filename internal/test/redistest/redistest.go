// Package redistest starts real redis-server processes on free loopback ports for tests: a
// standalone node and a cluster of masters. Tests never rely on a Redis that is already running.
package redistest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// Server is one redis-server process.
type Server struct {
	Port int
	// CAFile and TLS are set for a server that speaks only TLS: the PEM file that signs its
	// certificate, and a client configuration that trusts it.
	CAFile string
	TLS    *tls.Config
	dir    string
	args   []string
	cmd    *exec.Cmd
	done   chan struct{}
}

// Addr is the server's loopback address.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port)) }

// NewServer starts a standalone Redis that is stopped when the test ends.
func NewServer(t testing.TB) *Server {
	t.Helper()
	tier.Needs(t, "redis-server")
	t.Helper()
	s, err := StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// NewServerWithConfig starts a standalone Redis that reads configFile first, as redis-server
// reads a config file named before its flags, then args; it is stopped when the test ends. A
// server that asks for a password counts as started once it answers NOAUTH.
func NewServerWithConfig(t testing.TB, configFile string, args ...string) *Server {
	t.Helper()
	tier.Needs(t, "redis-server")
	t.Helper()
	s, err := start(false, func(s *Server) ([]string, error) {
		rest, err := standalone(args)(s)
		return append([]string{configFile}, rest...), err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// StartServer starts a standalone Redis, given extra flags. The caller stops it.
func StartServer(extra ...string) (*Server, error) { return start(false, standalone(extra)) }

// standalone returns the arguments of a server on port, with extra appended.
func standalone(extra []string) func(s *Server) ([]string, error) {
	return func(s *Server) ([]string, error) {
		return append([]string{
			"--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1", "--dir", s.dir,
			"--save", "", "--appendonly", "no", "--logfile", filepath.Join(s.dir, "redis.log"),
		}, extra...), nil
	}
}

// start finds a free port and starts the server whose arguments args returns.
func start(withBus bool, args func(s *Server) ([]string, error)) (*Server, error) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		return nil, errors.New("redis-server is not on PATH: run 'make redis-server' or install Redis 7")
	}
	dir, err := os.MkdirTemp("", "sluice-redis-")
	if err != nil {
		return nil, err
	}
	var lastErr error
	for range 5 {
		port, err := freePort(withBus)
		if err != nil {
			return nil, err
		}
		s := &Server{Port: port, dir: dir}
		if s.args, lastErr = args(s); lastErr != nil {
			break
		}
		if lastErr = s.Start(); lastErr == nil {
			return s, nil
		}
	}
	_ = os.RemoveAll(dir)
	return nil, lastErr
}

// Start (re)starts the process on the same port and waits until it answers PING.
func (s *Server) Start() error {
	cmd := exec.Command("redis-server", s.args...)
	// The server must not outlive a crashed test binary.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start redis-server: %w", err)
	}
	s.cmd, s.done = cmd, make(chan struct{})
	go func(done chan struct{}) { _ = cmd.Wait(); close(done) }(s.done)

	c := redis.NewClient(&redis.Options{Addr: s.Addr(), TLSConfig: s.TLS, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer func() { _ = c.Close() }()
	var exited error
	err := poll.Until(10*time.Second, func() error {
		select {
		case <-s.done:
			log, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			exited = fmt.Errorf("redis-server on port %d exited: %s", s.Port, lastLines(string(log), 5))
			return nil // no use waiting on
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		if err := c.Ping(ctx).Err(); err != nil && !strings.HasPrefix(err.Error(), "NOAUTH") {
			return err
		}
		return nil
	})
	if exited != nil {
		return exited
	}
	if err != nil {
		s.Kill()
		return fmt.Errorf("redis-server on port %d did not answer PING: %w", s.Port, err)
	}
	// The port was free when chosen, but another process (a test binary of another package,
	// running at the same time) may have taken it since: then this server fails to bind and
	// exits, and the PING was the other's. Tests must never share a server unknowingly: one
	// that stops its server would fail the other's decisions, which fail open.
	if err := s.owns(c, cmd.Process.Pid); err != nil {
		s.Kill()
		return err
	}
	return nil
}

// owns fails unless the server answering on s's port is the process pid. A server that asks
// for a password before INFO is taken as its own.
func (s *Server) owns(c *redis.Client, pid int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		if strings.HasPrefix(err.Error(), "NOAUTH") {
			return nil
		}
		return fmt.Errorf("redis-server on port %d: INFO: %w", s.Port, err)
	}
	for line := range strings.SplitSeq(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "process_id:"); ok {
			if v != strconv.Itoa(pid) {
				return fmt.Errorf("port %d is another redis-server's (process %s, not %d)", s.Port, v, pid)
			}
			return nil
		}
	}
	return fmt.Errorf("redis-server on port %d: INFO server has no process_id", s.Port)
}

// Kill ends the process at once, as a crash would, and waits for it to exit.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // a paused process must wake to die
	_ = s.cmd.Process.Kill()
	<-s.done
	s.cmd = nil
}

// Pause freezes the process with SIGSTOP: connections stay open but nothing is answered.
func (s *Server) Pause() { _ = s.cmd.Process.Signal(syscall.SIGSTOP) }

// Resume wakes a paused process.
func (s *Server) Resume() { _ = s.cmd.Process.Signal(syscall.SIGCONT) }

// Stop kills the process and removes its directory.
func (s *Server) Stop() {
	s.Kill()
	_ = os.RemoveAll(s.dir)
}

// Client returns a client of this server, closed when the test ends.
func (s *Server) Client(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), TLSConfig: s.TLS})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Cluster is a Redis Cluster: its masters, then their replicas, if any.
type Cluster struct {
	Nodes []*Server
}

// Addrs are the nodes' addresses, usable as seeds.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		addrs[i] = n.Addr()
	}
	return addrs
}

// NewCluster starts a cluster of n masters that is stopped when the test ends.
func NewCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	tier.Needs(t, "redis-server")
	t.Helper()
	c, err := StartCluster(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	return c
}

// NewClusterWithReplicas starts a cluster of n masters with one replica each, that fails a master
// over to its replica about two seconds after the master stops answering. It is stopped when the
// test ends.
func NewClusterWithReplicas(t testing.TB, n int) *Cluster {
	t.Helper()
	tier.Needs(t, "redis-server")
	t.Helper()
	c, err := startCluster(n, 1, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	return c
}

// StartCluster starts n masters, joins them with `redis-cli --cluster create`, and waits until
// every node reports cluster_state:ok. The caller stops it.
func StartCluster(n int) (*Cluster, error) { return startCluster(n, 0, 5*time.Second) }

func startCluster(masters, replicas int, nodeTimeout time.Duration) (*Cluster, error) {
	c := &Cluster{}
	for range masters * (1 + replicas) {
		s, err := start(true, standalone([]string{
			"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", strconv.FormatInt(nodeTimeout.Milliseconds(), 10),
			// A replica fails over however long ago it last heard from its master: on a busy
			// machine the first sync can be late, and a test must not depend on it.
			"--cluster-replica-validity-factor", "0",
		}))
		if err != nil {
			c.Stop()
			return nil, err
		}
		c.Nodes = append(c.Nodes, s)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		c.Stop()
		return nil, fmt.Errorf("redis-cli --cluster create: %w: %s", err, lastLines(string(out), 5))
	}
	if err := c.waitOK(30 * time.Second); err != nil {
		c.Stop()
		return nil, err
	}
	if err := c.waitReplicasInSync(30 * time.Second); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

func (c *Cluster) waitOK(timeout time.Duration) error {
	return c.waitEach(timeout, "cluster state ok", func(rc *redis.Client) (string, error) {
		return rc.ClusterInfo(context.Background()).Result()
	}, func(info string) bool { return strings.Contains(info, "cluster_state:ok") })
}

// waitReplicasInSync waits until every replica's link to its master is up: only then has it the
// master's data to take over with.
func (c *Cluster) waitReplicasInSync(timeout time.Duration) error {
	return c.waitEach(timeout, "replication in sync", func(rc *redis.Client) (string, error) {
		return rc.Info(context.Background(), "replication").Result()
	}, func(info string) bool {
		return strings.Contains(info, "role:master") || strings.Contains(info, "master_link_status:up")
	})
}

// waitEach polls every node with read until done holds for what it read, all within timeout.
func (c *Cluster) waitEach(timeout time.Duration, what string, read func(*redis.Client) (string, error), done func(string) bool) error {
	deadline := time.Now().Add(timeout)
	for _, n := range c.Nodes {
		rc := redis.NewClient(&redis.Options{Addr: n.Addr()})
		err := poll.Until(time.Until(deadline), func() error {
			info, err := read(rc)
			if err == nil && !done(info) {
				err = fmt.Errorf("%s", info)
			}
			return err
		})
		_ = rc.Close()
		if err != nil {
			return fmt.Errorf("cluster node %s: no %s: %w", n.Addr(), what, err)
		}
	}
	return nil
}

// Stop stops every node.
func (c *Cluster) Stop() {
	for _, n := range c.Nodes {
		n.Stop()
	}
}

// Client returns a cluster client, closed when the test ends.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// freePort finds a free loopback port. For cluster nodes the cluster bus port (port+10000) must
// be free too.
func freePort(withBus bool) (int, error) {
	for range 50 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		if !withBus {
			return port, nil
		}
		if port+10000 > 65535 {
			continue
		}
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		if err != nil {
			continue
		}
		_ = bus.Close()
		return port, nil
	}
	return 0, errors.New("no free loopback port")
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

var scriptStat = regexp.MustCompile(`cmdstat_(evalsha|eval|fcall):calls=(\d+)`)

// ScriptCalls is how many scripts the server ran (EVALSHA, EVAL and FCALL), from INFO commandstats.
// Commands that scripts call are counted there under their own names, and are left out.
func ScriptCalls(tb testing.TB, c *redis.Client) int64 {
	tb.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		tb.Fatal(err)
	}
	var total int64
	for _, m := range scriptStat.FindAllStringSubmatch(info, -1) {
		n, _ := strconv.ParseInt(m[2], 10, 64)
		total += n
	}
	return total
}
