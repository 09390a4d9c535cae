// Package testenv starts the real test control plane (kube-apiserver and etcd built from Go
// modules by hack/envtest.sh) with Sluice's CRDs installed.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/scheme"
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
	Webhook envtest.WebhookInstallOptions
	env     *envtest.Environment
}

// Option changes what Start starts.
type Option func(*envtest.Environment)

// WithWebhooks installs the webhook configurations of config/webhook, rewritten to call
// https://127.0.0.1:<port> with a CA that envtest makes; Env.Webhook has the port and the
// certificate directory to serve from.
func WithWebhooks() Option {
	return func(e *envtest.Environment) {
		e.WebhookInstallOptions.Paths = []string{filepath.Join(RepoRoot(), "config", "webhook", "manifests.yaml")}
	}
}

// RepoRoot is the root of the Sluice checkout.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
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
	env := &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join(RepoRoot(), "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		BinaryAssetsDirectory: assets,
	}
	// Room for thousands of Services: the default /24 holds 254 ClusterIPs, and every policy
	// has an enforcer Service.
	env.ControlPlane.GetAPIServer().Configure().Set("service-cluster-ip-range", "10.96.0.0/16")
	for _, o := range opts {
		o(env)
	}
	cfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("start the test control plane from %s: %w", assets, err)
	}
	if err := v1alpha1.AddToScheme(scheme.Scheme); err != nil {
		return nil, fmt.Errorf("register the API: %w", err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme.Scheme})
	if err != nil {
		_ = env.Stop()
		return nil, fmt.Errorf("create a client: %w", err)
	}
	return &Env{Config: cfg, Client: c, Webhook: env.WebhookInstallOptions, env: env}, nil
}

// Kubectl is the path of the kubectl that hack/envtest.sh built beside the control plane.
func (e *Env) Kubectl() string {
	return filepath.Join(e.env.BinaryAssetsDirectory, "kubectl")
}

// Stop stops the control plane.
func (e *Env) Stop() error { return e.env.Stop() }

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
