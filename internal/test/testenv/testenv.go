// Package testenv starts the real test control plane (kube-apiserver and etcd built from Go
// modules by hack/envtest.sh) with Sluice's CRDs installed.
package testenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// Env is a running control plane.
type Env struct {
	Config *rest.Config
	Client client.Client
	// Webhook says where the webhook server must listen, with WithWebhooks.
	Webhook     envtest.WebhookInstallOptions
	env         *envtest.Environment
	controllers *exec.Cmd
	dir         string
	// wrappers holds the scripts that start kube-apiserver and etcd (dieWithTest).
	wrappers string
}

// Option changes what Start starts.
type Option func(*options)

type options struct {
	webhooks, controllers, noCRDs bool
	extraControllers, extraCRDs   []string
	advertiseAddress              string
}

// WithAdvertiseAddress gives the API server the address it advertises to the cluster's
// members. It finds one from the default route by itself, so a test in a network namespace with
// no route out (local.RunInPodNetwork) must name one.
func WithAdvertiseAddress(ip string) Option {
	return func(o *options) { o.advertiseAddress = ip }
}

// WithoutCRDs leaves the CRDs out, for a test that installs them itself (the Helm chart does).
func WithoutCRDs() Option { return func(o *options) { o.noCRDs = true } }

// WithCRDsFrom installs the CRDs of these files or directories too, such as the Gateway API's.
func WithCRDsFrom(paths ...string) Option {
	return func(o *options) { o.extraCRDs = append(o.extraCRDs, paths...) }
}

// WithControllers runs the real kube-controller-manager beside the API server, with the
// controllers Sluice's objects meet in a cluster: Deployment, ReplicaSet, garbage collector and
// PodDisruptionBudget (disruption). Pods are created but nothing runs them; test/local's Kubelet
// does. extra names further controllers of kube-controller-manager to run, such as
// "endpointslice-controller" for a test whose gateway routes to the pods of a Service.
func WithControllers(extra ...string) Option {
	return func(o *options) { o.controllers, o.extraControllers = true, append(o.extraControllers, extra...) }
}

// controllers are the kube-controller-manager controllers WithControllers runs.
var controllers = []string{"deployment-controller", "replicaset-controller", "garbage-collector-controller", "disruption-controller"}

// WithWebhooks installs the webhook configurations of config/webhook, rewritten to call
// https://127.0.0.1:<port> with a CA that envtest makes; Env.Webhook has the port and the
// certificate directory to serve from.
func WithWebhooks() Option { return func(o *options) { o.webhooks = true } }

// RepoRoot is the root of the Sluice checkout.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// Start starts kube-apiserver and etcd and installs the CRDs from config/crd/bases. Without
// KUBEBUILDER_ASSETS it asks hack/envtest.sh for the binaries, which builds them on first use.
func Start(opts ...Option) (*Env, error) {
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		out, err := exec.Command(filepath.Join(RepoRoot(), "hack", "envtest.sh")).Output()
		if err != nil {
			return nil, fmt.Errorf("find the test control plane with hack/envtest.sh: %w", err)
		}
		assets = strings.TrimSpace(string(out))
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	env := &envtest.Environment{BinaryAssetsDirectory: assets}
	wrappers, err := dieWithTest(env, assets)
	if err != nil {
		return nil, err
	}
	if !o.noCRDs {
		env.CRDDirectoryPaths, env.ErrorIfCRDPathMissing = []string{filepath.Join(RepoRoot(), "config", "crd", "bases")}, true
	}
	if len(o.extraCRDs) > 0 {
		env.CRDDirectoryPaths, env.ErrorIfCRDPathMissing = append(env.CRDDirectoryPaths, o.extraCRDs...), true
	}
	// Room for thousands of Services: the default /24 holds 254 ClusterIPs, and every policy
	// has an enforcer Service.
	env.ControlPlane.GetAPIServer().Configure().Set("service-cluster-ip-range", "10.96.0.0/16")
	if o.advertiseAddress != "" {
		env.ControlPlane.GetAPIServer().Configure().Set("advertise-address", o.advertiseAddress)
	}
	if o.webhooks {
		env.WebhookInstallOptions.Paths = []string{filepath.Join(RepoRoot(), "config", "webhook", "manifests.yaml")}
	}
	cfg, err := env.Start()
	if err != nil {
		_ = os.RemoveAll(wrappers)
		return nil, fmt.Errorf("start the test control plane from %s: %w", assets, err)
	}
	e := &Env{Config: cfg, Webhook: env.WebhookInstallOptions, env: env, wrappers: wrappers}
	if o.controllers {
		if err := e.startControllers(append(slices.Clone(controllers), o.extraControllers...)); err != nil {
			_ = env.Stop()
			return nil, err
		}
	}
	if err := v1alpha1.AddToScheme(clientgoscheme.Scheme); err != nil {
		return nil, fmt.Errorf("register the API: %w", err)
	}
	e.Client, err = client.New(cfg, client.Options{Scheme: clientgoscheme.Scheme})
	if err != nil {
		_ = e.Stop()
		return nil, fmt.Errorf("create a client: %w", err)
	}
	return e, nil
}

// dieWithTest makes kube-apiserver and etcd die with the test process, even one killed with
// SIGKILL, which can clean nothing up: envtest starts each in a process group of its own, which
// no signal for the test reaches, and sets no parent-death signal. So each is started through a
// script that execs it under setpriv (util-linux) with one: the kernel kills it when its parent,
// the test process, dies. It returns the scripts' directory, for Stop to remove.
func dieWithTest(env *envtest.Environment, assets string) (string, error) {
	if _, err := exec.LookPath("setpriv"); err != nil {
		return "", fmt.Errorf("the test control plane needs setpriv (util-linux) to die with the tests: %w", err)
	}
	dir, err := os.MkdirTemp("", "sluice-envtest-")
	if err != nil {
		return "", err
	}
	wrap := func(name string) (string, error) {
		script := filepath.Join(dir, name)
		body := fmt.Sprintf("#!/bin/sh\nexec setpriv --pdeathsig KILL -- '%s' \"$@\"\n", filepath.Join(assets, name))
		return script, os.WriteFile(script, []byte(body), 0o755) //nolint:gosec // a script to run
	}
	if env.ControlPlane.Etcd == nil {
		env.ControlPlane.Etcd = &envtest.Etcd{}
	}
	var errAPI, errEtcd error
	env.ControlPlane.GetAPIServer().Path, errAPI = wrap("kube-apiserver")
	env.ControlPlane.Etcd.Path, errEtcd = wrap("etcd")
	if err := errors.Join(errAPI, errEtcd); err != nil {
		_ = os.RemoveAll(dir)
		return "", err
	}
	return dir, nil
}

// startControllers starts kube-controller-manager as a cluster administrator. Its output goes to
// kube-controller-manager.log in a temporary directory, named if it fails to start.
func (e *Env) startControllers(controllers []string) error {
	dir, err := os.MkdirTemp("", "sluice-kcm-")
	if err != nil {
		return err
	}
	e.dir = dir
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := e.WriteKubeconfig(kubeconfig); err != nil {
		return err
	}
	logFile, err := os.Create(filepath.Join(dir, "kube-controller-manager.log"))
	if err != nil {
		return err
	}
	defer func() { _ = logFile.Close() }()
	cmd := exec.Command(filepath.Join(e.env.BinaryAssetsDirectory, "kube-controller-manager"),
		"--kubeconfig="+kubeconfig,
		"--controllers="+strings.Join(controllers, ","),
		"--leader-elect=false",
		"--secure-port=0",
		"--use-service-account-credentials=false",
		// A test creates a thousand Deployments at once; the default 20 requests per second
		// would take minutes to give them their ReplicaSets and pods.
		"--kube-api-qps=200", "--kube-api-burst=400",
		// Collect the objects of a deleted policy at once rather than after discovery's resync.
		"--concurrent-gc-syncs=5",
		"-v=1",
	)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// Killed with the test process, however it ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start kube-controller-manager from %s (run hack/envtest.sh): %w", e.env.BinaryAssetsDirectory, err)
	}
	e.controllers = cmd
	return nil
}

// Kubectl is the path of the kubectl that hack/envtest.sh built beside the control plane.
func (e *Env) Kubectl() string {
	return filepath.Join(e.env.BinaryAssetsDirectory, "kubectl")
}

// Stop stops the control plane.
func (e *Env) Stop() error {
	if e.controllers != nil {
		// kube-controller-manager can hang in its graceful shutdown after a run of a thousand
		// policies (seen on 2026-12-04: still running six minutes after SIGINT); it holds no state worth
		// waiting for.
		exited := make(chan struct{})
		go func() { _ = e.controllers.Wait(); close(exited) }()
		_ = e.controllers.Process.Signal(os.Interrupt)
		select {
		case <-exited:
		case <-time.After(controllersStopTimeout):
			_ = e.controllers.Process.Kill()
			<-exited
		}
	}
	if e.dir != "" {
		_ = os.RemoveAll(e.dir)
	}
	err := e.env.Stop()
	_ = os.RemoveAll(e.wrappers)
	return err
}

// controllersStopTimeout is how long Stop waits for kube-controller-manager after SIGINT.
const controllersStopTimeout = 20 * time.Second

// GVK is the group, version and kind of RateLimitPolicy.
var GVK = schema.GroupVersionKind{Group: v1alpha1.GroupVersion.Group, Version: v1alpha1.GroupVersion.Version, Kind: "RateLimitPolicy"}

// WriteKubeconfig writes a kubeconfig of a cluster administrator, for kubectl, to path.
func (e *Env) WriteKubeconfig(path string) error {
	u, err := e.env.AddUser(envtest.User{Name: "sluice-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return err
	}
	data, err := u.KubeConfig()
	if err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o600)
}
