// Package local runs Sluice on one machine with no kubelet: the manager binary against the test
// control plane, and the enforcer that the controller rendered, as a local process fed from the
// rendered ConfigMap the way a kubelet would mount it. `make demo` and the end-to-end suite share
// it, so the demo shows exactly what the suite proves.
package local

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers/render"
	"github.com/sluice-dev/sluice/test/testenv"
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
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/"+name)
	cmd.Dir = testenv.RepoRoot()
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/%s: %w\n%s", name, err, out)
	}
	return bin, nil
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
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
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
	deadline := time.Now().Add(timeout)
	for {
		resp, err := http.Get(url) //nolint:gosec // loopback address we chose
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("%s answered %s", url, resp.Status)
		}
		if p.Exited() {
			return fmt.Errorf("%s exited: %w", p.Name, p.err)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %v: %w", p.Name, timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
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
		"--webhook-cert-hosts=localhost," + env.Webhook.LocalServingHost,
		"--validating-webhook-configuration=validating-webhook-configuration",
	}, extra...)
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

// Enforcer is the enforcer of one policy, run from its rendered Deployment and ConfigMap.
type Enforcer struct {
	*Process
	// ProxyURL, CheckURL and AdminURL are where it listens.
	ProxyURL, CheckURL, AdminURL string
	// Args are the arguments it runs with: the rendered ones, with local paths and addresses.
	Args   []string
	stop   context.CancelFunc
	synced chan struct{}
}

// RunEnforcer waits for the policy's rendered Deployment and ConfigMap, writes the ConfigMap's
// files into dir, and runs the enforcer binary with the Deployment's arguments, its listen
// addresses moved to free loopback ports and its upstream replaced by upstream (there is no
// cluster DNS here). Like a kubelet, it keeps the files in step with the ConfigMap; the enforcer
// reloads them every 200ms.
func RunEnforcer(ctx context.Context, k8s client.Client, bin string, policy types.NamespacedName, upstream, dir string, log io.Writer) (*Enforcer, error) {
	key := types.NamespacedName{Namespace: policy.Namespace, Name: render.Name(&v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Name: policy.Name}})}
	dep := &appsv1.Deployment{}
	if err := poll(ctx, 30*time.Second, func() error { return k8s.Get(ctx, key, dep) }); err != nil {
		return nil, fmt.Errorf("the controller rendered no Deployment %s: %w", key, err)
	}
	if err := syncConfigMap(ctx, k8s, key, dir); err != nil {
		return nil, err
	}
	e := &Enforcer{}
	addrs := map[string]*string{"--listen": &e.ProxyURL, "--check-listen": &e.CheckURL, "--admin-listen": &e.AdminURL}
	var c corev1.Container
	for _, c = range dep.Spec.Template.Spec.Containers {
		if c.Name == "enforcer" {
			break
		}
	}
	for _, env := range c.Env {
		if env.ValueFrom != nil {
			return nil, fmt.Errorf("the enforcer reads %s from a Secret; running it locally does not support that", env.Name)
		}
	}
	for _, arg := range c.Args {
		name, value, _ := strings.Cut(arg, "=")
		switch {
		case name == "--policy":
			value = filepath.Join(dir, filepath.Base(value))
		case name == "--upstream":
			value = upstream
		case addrs[name] != nil:
			addr, err := FreeAddr()
			if err != nil {
				return nil, err
			}
			value, *addrs[name] = addr, "http://"+addr
		}
		e.Args = append(e.Args, name+"="+value)
	}
	e.Args = append(e.Args, "--reload-interval=200ms", "--shutdown-timeout=2s")
	p, err := Start("enforcer "+policy.String(), log, bin, e.Args...)
	if err != nil {
		return nil, err
	}
	e.Process = p
	if err := WaitHTTP(p, e.AdminURL+"/readyz", 30*time.Second); err != nil {
		p.Stop()
		return nil, err
	}
	syncCtx, cancel := context.WithCancel(ctx)
	e.stop, e.synced = cancel, make(chan struct{})
	go func() {
		defer close(e.synced)
		for syncCtx.Err() == nil {
			_ = syncConfigMap(syncCtx, k8s, key, dir)
			select {
			case <-syncCtx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	return e, nil
}

// Stop stops keeping the files in step and stops the enforcer.
func (e *Enforcer) Stop() {
	if e == nil {
		return
	}
	e.stop()
	<-e.synced
	e.Process.Stop()
}

// syncConfigMap writes each key of the ConfigMap into dir, replacing files atomically.
func syncConfigMap(ctx context.Context, k8s client.Client, key types.NamespacedName, dir string) error {
	cm := &corev1.ConfigMap{}
	if err := poll(ctx, 30*time.Second, func() error { return k8s.Get(ctx, key, cm) }); err != nil {
		return fmt.Errorf("the controller rendered no ConfigMap %s: %w", key, err)
	}
	for name, data := range cm.Data {
		path := filepath.Join(dir, name)
		if old, err := os.ReadFile(path); err == nil && string(old) == data {
			continue
		}
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(data), 0o600); err != nil {
			return err
		}
		if err := os.Rename(tmp, path); err != nil {
			return err
		}
	}
	return nil
}

func poll(ctx context.Context, timeout time.Duration, f func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := f()
		if err == nil || !apierrors.IsNotFound(err) || time.Now().After(deadline) || ctx.Err() != nil {
			return errors.Join(err, ctx.Err())
		}
		time.Sleep(100 * time.Millisecond)
	}
}
