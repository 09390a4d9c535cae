package e2e_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// cluster is a control plane with the webhook configurations, its kubeconfig, and the binaries.
type cluster struct {
	env                     *testenv.Env
	dir, kubeconfig         string
	managerBin, enforcerBin string
	// caBundles are the webhook configuration's CAs as envtest installed them, by webhook.
	caBundles map[string][]byte
}

// The package's one control plane and one build of the binaries, made by the first test that
// needs them and shared by the others in turn: each starts its own manager, and what it leaves
// is reset when it ends.
var (
	shared     *cluster
	sharedErr  error
	sharedOnce sync.Once
)

func TestMain(m *testing.M) {
	flag.Parse()
	tier.RunFast(m)
	code := m.Run()
	if shared != nil {
		if err := shared.env.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
		_ = os.RemoveAll(shared.dir)
	}
	os.Exit(code)
}

// startCluster returns the package's control plane, started on first use with the webhook
// configurations and kube-controller-manager, and the manager and enforcer binaries, built on
// first use. When the test ends, the control plane is reset for the next one (reset).
func startCluster(t testing.TB) *cluster {
	t.Helper()
	tier.Needs(t, "the test control plane and the built binaries")
	sharedOnce.Do(func() { shared, sharedErr = newCluster() })
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	// Registered first, so run last: after the test's manager and pods have stopped.
	t.Cleanup(func() {
		if err := shared.reset(); err != nil {
			t.Errorf("reset the control plane for the next test: %v", err)
		}
	})
	return shared
}

func newCluster() (*cluster, error) {
	dir, err := os.MkdirTemp("", "sluice-e2e-")
	if err != nil {
		return nil, err
	}
	c := &cluster{dir: dir, kubeconfig: filepath.Join(dir, "kubeconfig")}
	if c.managerBin, c.enforcerBin, err = local.Build(context.Background(), dir); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if c.env, err = testenv.Start(testenv.WithWebhooks(), testenv.WithControllers()); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := c.env.WriteKubeconfig(c.kubeconfig); err != nil {
		return nil, errors.Join(err, c.env.Stop(), os.RemoveAll(dir))
	}
	var cfg admissionregistrationv1.ValidatingWebhookConfiguration
	if err := c.env.Client.Get(context.Background(), client.ObjectKey{Name: webhookConfiguration}, &cfg); err != nil {
		return nil, errors.Join(err, c.env.Stop(), os.RemoveAll(dir))
	}
	c.caBundles = map[string][]byte{}
	for _, w := range cfg.Webhooks {
		c.caBundles[w.Name] = slices.Clone(w.ClientConfig.CABundle)
	}
	return c, nil
}

// webhookConfiguration is the name of the webhook configuration of config/webhook.
const webhookConfiguration = "validating-webhook-configuration"

// reset removes what a test leaves that the next test's manager would see: the policies and,
// once the garbage collector has taken them, their objects; the manager's certificate Secret and leader Lease, and the
// CA that its certificate rotator put into the webhook configuration in place of envtest's.
func (c *cluster) reset() error {
	ctx := context.Background()
	k8s := c.env.Client
	var policies v1alpha1.RateLimitPolicyList
	if err := k8s.List(ctx, &policies); err != nil {
		return err
	}
	for i := range policies.Items {
		if err := k8s.Delete(ctx, &policies.Items[i]); client.IgnoreNotFound(err) != nil {
			return err
		}
	}
	err := poll.Until(time.Minute, func() error {
		if err := k8s.List(ctx, &policies); err != nil {
			return err
		}
		if n := len(policies.Items); n > 0 {
			return fmt.Errorf("%d policies still there", n)
		}
		return nil
	})
	if err != nil {
		return err
	}
	// And the garbage collector has taken their Deployments: the next test starts on a quiet
	// control plane.
	err = poll.Until(time.Minute, func() error {
		var deployments appsv1.DeploymentList
		if err := k8s.List(ctx, &deployments); err != nil {
			return err
		}
		owned := 0
		for _, d := range deployments.Items {
			if ref := metav1.GetControllerOf(&d); ref != nil && ref.Kind == "RateLimitPolicy" {
				owned++
			}
		}
		if owned > 0 {
			return fmt.Errorf("%d Deployments of deleted policies still there", owned)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, o := range []client.Object{&corev1.Secret{}, &coordinationv1.Lease{}} {
		if err := k8s.DeleteAllOf(ctx, o, client.InNamespace(local.Namespace)); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var cfg admissionregistrationv1.ValidatingWebhookConfiguration
		if err := k8s.Get(ctx, client.ObjectKey{Name: webhookConfiguration}, &cfg); err != nil {
			return err
		}
		for i, w := range cfg.Webhooks {
			cfg.Webhooks[i].ClientConfig.CABundle = c.caBundles[w.Name]
		}
		return k8s.Update(ctx, &cfg)
	})
}
