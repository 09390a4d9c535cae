// Package local runs Sluice on one machine with no nodes: the manager binary against the test
// control plane, and a kubelet stand-in (Kubelet) that runs the enforcer pods the ReplicaSet
// controller creates as local processes. `make demo` and the end-to-end suite share it, so the
// demo shows exactly what the suite proves.
package local

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// Namespace is where the manager keeps its webhook certificate.
const Namespace = "sluice-system"

// Build compiles the manager and the enforcer into dir.
func Build(ctx context.Context, dir string) (manager, enforcer string, err error) {
	if manager, err = BuildCmd(ctx, dir, "manager"); err != nil {
		return "", "", err
	}
	if enforcer, err = BuildCmd(ctx, dir, "enforcer"); err != nil {
		return "", "", err
	}
	return manager, enforcer, nil
}

// BuildCmd compiles the binary ./cmd/<name> into dir and returns its path.
func BuildCmd(ctx context.Context, dir, name string) (string, error) {
	bin := filepath.Join(dir, name)
	cmd := GoBuild(ctx, testenv.RepoRoot(), "-o", bin, "./cmd/"+name)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/%s: %w\n%s", name, err, out)
	}
	return bin, nil
}

// GoBuild is `go build args...` in dir as the Dockerfile builds (static, -trimpath): every test
// that builds a binary builds it so, and all share the compiled packages in Go's build cache
// rather than compile each dependency once per way of building (a cold CI run pays each).
func GoBuild(ctx context.Context, dir string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "go", append([]string{"build", "-trimpath"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	return cmd
}

// Process is a running binary.
type Process struct {
	Name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Start starts bin with args; its output goes to log.
func Start(name string, log io.Writer, bin string, args ...string) (*Process, error) {
	return StartWithEnv(name, log, nil, bin, args...)
}

// StartWithEnv starts bin with args and, beside this process's environment, env.
func StartWithEnv(name string, log io.Writer, env []string, bin string, args ...string) (*Process, error) {
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	// Its own process group keeps a Ctrl-C for the caller from reaching it first; it dies with
	// the caller.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Process{Name: name, cmd: cmd, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

// Nginx runs the nginx on PATH in the foreground, with dir as its prefix (where its logs go) and
// the configuration conf, written to dir/nginx.conf. Like every process Start starts, it dies
// with the test process: its master gets SIGTERM and takes its workers down with it.
func Nginx(log io.Writer, dir, conf string) (*Process, error) {
	bin, err := exec.LookPath("nginx")
	if err != nil {
		return nil, fmt.Errorf("the tests need nginx (hack/ensure-packages.sh): %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "nginx.conf"), []byte(conf), 0o600); err != nil {
		return nil, err
	}
	return Start("nginx", log, bin, "-p", dir, "-c", "nginx.conf", "-g", "daemon off;")
}

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Output collects the output of processes: safe for their concurrent writes and for reads.
type Output struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (o *Output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.Write(p)
}

// String is everything written so far.
func (o *Output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String()
}

// Usage is the CPU time the process has used and its peak resident memory in bytes, from
// /proc (Linux).
func (p *Process) Usage() (cpu time.Duration, peakRSS float64) {
	pid := strconv.Itoa(p.cmd.Process.Pid)
	if stat, err := os.ReadFile("/proc/" + pid + "/stat"); err == nil {
		// After the command name in parentheses: state is field 3, utime and stime 14 and 15.
		if i := bytes.LastIndexByte(stat, ')'); i > 0 {
			f := strings.Fields(string(stat[i+1:]))
			if len(f) > 12 {
				utime, _ := strconv.ParseFloat(f[11], 64)
				stime, _ := strconv.ParseFloat(f[12], 64)
				cpu = time.Duration((utime + stime) / 100 * float64(time.Second)) // USER_HZ is 100 on Linux
			}
		}
	}
	if status, err := os.ReadFile("/proc/" + pid + "/status"); err == nil {
		for _, line := range strings.Split(string(status), "\n") {
			if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
				kb, _ := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 64)
				peakRSS = kb * 1024
			}
		}
	}
	return cpu, peakRSS
}

// RSS is the process's resident memory now, in bytes, from /proc (Linux).
func (p *Process) RSS() float64 {
	status, err := os.ReadFile("/proc/" + strconv.Itoa(p.cmd.Process.Pid) + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 64)
			return kb * 1024
		}
	}
	return 0
}

// Signal sends sig to the process.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Wait waits for the process to end and returns how it ended: nil for exit status 0.
func (p *Process) Wait() error {
	<-p.done
	return p.err
}

// Stop asks the process to end with SIGTERM, and kills it after 10 seconds.
func (p *Process) Stop() {
	if p == nil || p.Exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// FreeAddr returns a loopback address with a port that was free a moment ago.
func FreeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().String(), nil
}

// WaitHTTP waits until url answers 200, or the process ends, or timeout passes.
func WaitHTTP(p *Process, url string, timeout time.Duration) error {
	var exited error
	err := poll.Until(timeout, func() error {
		resp, err := http.Get(url) //nolint:gosec // loopback address we chose
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("%s answered %s", url, resp.Status)
		}
		if p.Exited() {
			exited = fmt.Errorf("%s exited: %w", p.Name, p.err)
			return nil // no use waiting on
		}
		return err
	})
	if exited != nil {
		return exited
	}
	if err != nil {
		return fmt.Errorf("%s not ready: %w", p.Name, err)
	}
	return nil
}

// StartManager runs the manager binary against env with the webhook where env's webhook
// configurations point and built-in certificates, and waits until it is ready.
func StartManager(ctx context.Context, env *testenv.Env, bin, kubeconfig string, log io.Writer, extra ...string) (*Process, error) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}}
	if err := env.Client.Create(ctx, ns); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, err
	}
	probe, err := FreeAddr()
	if err != nil {
		return nil, err
	}
	args := append([]string{
		"--kubeconfig=" + kubeconfig,
		"--metrics-bind-address=0",
		"--health-probe-bind-address=" + probe,
		"--webhook-host=" + env.Webhook.LocalServingHost,
		"--webhook-port=" + strconv.Itoa(env.Webhook.LocalServingPort),
		"--namespace=" + Namespace,
	}, extra...)
	// The built-in certificates' flags, unless the certificates come from a directory: the
	// manager refuses them beside --webhook-cert-dir, which they would not shape.
	if !slices.ContainsFunc(extra, func(a string) bool { return strings.HasPrefix(a, "--webhook-cert-dir=") }) {
		args = append(args, "--webhook-cert-hosts=localhost,"+env.Webhook.LocalServingHost,
			"--validating-webhook-configuration=validating-webhook-configuration")
	}
	p, err := Start("manager", log, bin, args...)
	if err != nil {
		return nil, err
	}
	if err := WaitHTTP(p, "http://"+probe+"/readyz", 60*time.Second); err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}

// Tool is the path of a tool that Sluice's users run and the tests run too: helm or promtool.
// $HELM or $PROMTOOL when set (make test sets them), or else hack/tool.sh, which builds the tool
// from the module pinned in hack/tools/<name> once per machine.
func Tool(name string) (string, error) {
	if p := os.Getenv(strings.ToUpper(name)); p != "" {
		return p, nil
	}
	cmd := exec.Command(filepath.Join(testenv.RepoRoot(), "hack", "tool.sh"), name)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/tool.sh %s: %w: %s", name, err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}

// RawStatus sends one request, byte for byte as given, on a connection of its own and returns the
// status of the response: for requests no client library would send.
func RawStatus(addr, request string) (int, error) {
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, request); err != nil {
		return 0, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0, fmt.Errorf("%.40q: %w", request, err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}
