package local_test

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// childEnv makes this test binary the test bed of TestChildren... instead of running tests.
const childEnv = "SLUICE_TEST_BED_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(startTestBed())
	}
	os.Exit(m.Run())
}

// startTestBed starts every long-lived process the tests start, each as they start it, says
// "started" on stdout, and waits to be killed.
func startTestBed() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM)
	if _, err := redistest.StartServer(); err != nil {
		return fail(err)
	}
	if _, err := testenv.Start(testenv.WithControllers()); err != nil {
		return fail(err)
	}
	dir, err := os.MkdirTemp("", "sluice-test-bed-")
	if err != nil {
		return fail(err)
	}
	addr, err := local.FreeAddr()
	if err != nil {
		return fail(err)
	}
	conf := "pid nginx.pid;\nerror_log error.log;\nevents {}\nhttp {\n  access_log off;\n  server { listen " + addr + "; return 200; }\n}\n"
	if _, err := local.Nginx(os.Stderr, dir, conf); err != nil {
		return fail(err)
	}
	traefik, err := local.Tool("traefik")
	if err != nil {
		return fail(err)
	}
	if addr, err = local.FreeAddr(); err != nil {
		return fail(err)
	}
	if _, err := local.Start("traefik", os.Stderr, traefik, "--entryPoints.web.address="+addr, "--log.level=ERROR"); err != nil {
		return fail(err)
	}
	fmt.Println("started")
	<-stop
	return 1
}

// A test binary killed mid-run (SIGKILL: a CI timeout, the OOM killer) can clean nothing up, so
// whatever it started must die with it: Redis, the control plane's etcd, kube-apiserver and
// kube-controller-manager, nginx and its workers, Traefik.
func TestChildrenWhenTheTestProcessIsKilledThenEveryOneDiesWithIt(t *testing.T) {
	tier.Needs(t, "the test control plane, redis-server, nginx and traefik")
	// Traefik first: on a fresh machine its build (or CI's, beside the tests) takes minutes,
	// which are not the test bed's start.
	traefik, err := local.Tool("traefik")
	if err != nil {
		t.Fatal(err)
	}
	bed := exec.Command(os.Args[0], "-test.run=^$")
	bed.Env = append(os.Environ(), childEnv+"=1", "TRAEFIK="+traefik)
	var stderr local.Output // written by the bed while it runs
	bed.Stderr = &stderr
	stdout, err := bed.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := bed.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = bed.Process.Kill(); _ = bed.Wait() })
	started := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "started" {
				started <- true
				return
			}
		}
		started <- false
	}()
	select {
	case ok := <-started:
		if !ok {
			_ = bed.Wait()
			t.Fatalf("the test bed ended before it started everything:\n%s", stderr.String())
		}
	case <-time.After(5 * time.Minute):
		t.Fatalf("the test bed did not start within 5 minutes:\n%s", stderr.String())
	}

	children := descendants(t, bed.Process.Pid)
	var names []string
	for _, c := range children {
		names = append(names, c.name)
	}
	for _, want := range []string{"redis-server", "etcd", "kube-apiserver", "kube-controller", "nginx", "traefik"} {
		if !slices.ContainsFunc(names, func(n string) bool { return strings.HasPrefix(n, want) }) {
			t.Fatalf("no %s among the test bed's processes %v", want, names)
		}
	}
	if err := bed.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = bed.Wait()
	poll.WaitFor(t, 30*time.Second, func() error {
		var alive []string
		for _, c := range children {
			if c.alive() {
				alive = append(alive, fmt.Sprintf("%s (pid %d)", c.name, c.pid))
			}
		}
		if len(alive) > 0 {
			return fmt.Errorf("still running after the test process was killed: %s", strings.Join(alive, ", "))
		}
		return nil
	})
	t.Logf("%d processes died with the test process: %v", len(children), names)
}

// process is one process as /proc shows it: its start time tells it from a later process that
// reuses its pid.
type process struct {
	pid, ppid int
	name      string
	state     string
	started   string
}

func readProcess(pid int) (process, error) {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return process{}, err
	}
	// pid (comm) state ppid ...; comm may hold spaces and parentheses, so split at the last ')'.
	s := string(stat)
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || end < open {
		return process{}, errors.New("unreadable stat")
	}
	f := strings.Fields(s[end+1:])
	if len(f) < 20 {
		return process{}, errors.New("short stat")
	}
	ppid, _ := strconv.Atoi(f[1])
	// Field 22 of stat, starttime, is the 20th after the command.
	return process{pid: pid, ppid: ppid, name: s[open+1 : end], state: f[0], started: f[19]}, nil
}

// alive reports whether the process still runs: neither gone, nor a zombie that only waits to be
// reaped, nor replaced by another with its pid.
func (p process) alive() bool {
	now, err := readProcess(p.pid)
	return err == nil && now.started == p.started && now.state != "Z"
}

// descendants are every process below root, from /proc.
func descendants(t *testing.T, root int) []process {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	children := map[int][]process{}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if p, err := readProcess(pid); err == nil {
			children[p.ppid] = append(children[p.ppid], p)
		}
	}
	var all []process
	for next := []int{root}; len(next) > 0; {
		pid := next[0]
		next = next[1:]
		for _, c := range children[pid] {
			all = append(all, c)
			next = append(next, c.pid)
		}
	}
	return all
}
