package e2e_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
)

// A policy managed GitOps-style: one manifest, changed and applied again and again with the real
// kubectl, client-side and server-side, through the webhook, reconciled by the manager binary.
func TestGitOpsWhenAManifestIsAppliedAgainAndAgainThenEveryChangeLandsAndNothingElseMoves(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	logs := newProcessLog(t)
	mgr, err := local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, logs, "--enforcer-image=sluice-enforcer:a", "--redis-probe-interval=0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mgr.Stop() })
	upstream := okUpstream(t)

	for _, mode := range []string{"client-side", "server-side"} {
		t.Run("when applied "+mode, func(t *testing.T) {
			g := &gitops{t: t, c: c, mode: mode, ns: "gitops-" + mode, file: filepath.Join(t.TempDir(), "policy.yaml")}
			g.kubectl("create", "namespace", g.ns)
			c.runPods(t, g.ns, upstream.URL, logs)
			g.kubectl("create", "service", "clusterip", "api", "--tcp=8080", "-n", g.ns)

			// memory storage: one replica, no PodDisruptionBudget.
			g.apply(g.manifest("Open", "memory: {}"), "created")
			g.waitReplicas(1)
			g.proxy(1) // settled: the pod runs and the status says so
			// The same manifest again changes nothing: no write, no new generation.
			before := g.versions()
			want := "unchanged"
			if mode == "server-side" {
				want = "serverside-applied"
			}
			g.apply(g.manifest("Open", "memory: {}"), want)
			time.Sleep(time.Second) // real time passes for a write that must not come: an unchanged apply makes no event

			if after := g.versions(); fmt.Sprint(after) != fmt.Sprint(before) {
				t.Errorf("re-applying the unchanged manifest moved resourceVersions or generation:\nbefore %v\nafter  %v", before, after)
			}

			// redis storage: two replicas and a PodDisruptionBudget, without writing replicas.
			// The Redis does not answer, so the rules' failure mode decides every request.
			redis := `redis: {addresses: ["127.0.0.1:1"]}`
			g.apply(g.manifest("Open", redis), "configured")
			g.waitReplicas(2)
			g.waitObject(&policyv1.PodDisruptionBudget{}, g.name(), true)
			proxy := g.proxy(2)
			g.waitStatus(proxy, http.StatusOK)
			// defaultFailureMode Open -> Closed -> Open: the rule without its own failureMode
			// follows, in the rendered config and in the enforcer's decisions.
			g.apply(g.manifest("Closed", redis), "configured")
			g.waitStatus(proxy, http.StatusServiceUnavailable)
			g.apply(g.manifest("Open", redis), "configured")
			g.waitStatus(proxy, http.StatusOK)

			// managedRedis: its Deployment and Service appear; back to memory: they, and the
			// PodDisruptionBudget, are deleted, and one replica runs again.
			g.apply(g.manifest("Open", "managedRedis: {}"), "configured")
			g.waitReplicas(2)
			g.waitObject(&appsv1.Deployment{}, render.RedisName(g.name()), true)
			g.apply(g.manifest("Open", "memory: {}"), "configured")
			g.waitReplicas(1)
			g.waitObject(&appsv1.Deployment{}, render.RedisName(g.name()), false)
			g.waitObject(&corev1.Service{}, render.RedisName(g.name()), false)
			g.waitObject(&policyv1.PodDisruptionBudget{}, g.name(), false)
		})
	}

	// A manager restarted with another --enforcer-image rolls the policies that set none.
	mgr.Stop()
	mgr, err = local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, logs, "--enforcer-image=sluice-enforcer:b", "--redis-probe-interval=0")
	if err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{"gitops-client-side", "gitops-server-side"} {
		poll.WaitFor(t, 30*time.Second, func() error {
			d := &appsv1.Deployment{}
			if err := c.env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "sluice-shop"}, d); err != nil {
				return err
			}
			p := &v1alpha1.RateLimitPolicy{}
			if err := c.env.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "shop"}, p); err != nil {
				return err
			}
			if img := d.Spec.Template.Spec.Containers[0].Image; img != "sluice-enforcer:b" || p.Status.Enforcer == nil || p.Status.Enforcer.Image != img {
				return fmt.Errorf("%s: Deployment image %s, status %+v; want sluice-enforcer:b in both", ns, img, p.Status.Enforcer)
			}
			return nil
		})
	}
}

// gitops applies versions of one manifest with kubectl and watches what follows.
type gitops struct {
	t              *testing.T
	c              *cluster
	mode, ns, file string
}

func (g *gitops) manifest(defaultFailureMode, storage string) string {
	return fmt.Sprintf(`apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: shop, namespace: %s}
spec:
  targetRef: {name: api, port: 8080}
  defaultFailureMode: %s
  storage: {%s}
  rules:
    - name: per-client
      key: [{type: Header, name: X-Client}]
      match: {path: {value: /}}
      fixedWindow: {limit: 100, window: 1h}
`, g.ns, defaultFailureMode, storage)
}

func (g *gitops) name() string { return "sluice-shop" }

// kubectl runs kubectl against the test cluster and returns its output; it fails the test on an
// error.
func (g *gitops) kubectl(args ...string) string {
	g.t.Helper()
	cmd := exec.Command(g.c.env.Kubectl(), append([]string{"--kubeconfig", g.c.kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		g.t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// apply writes the manifest and applies it in the test's mode; kubectl must report want.
func (g *gitops) apply(manifest, want string) {
	g.t.Helper()
	if err := os.WriteFile(g.file, []byte(manifest), 0o600); err != nil {
		g.t.Fatal(err)
	}
	args := []string{"apply", "-f", g.file}
	if g.mode == "server-side" {
		args = append(args, "--server-side")
		want = "serverside-applied" // on creation too; versions() tells a change from none

	}
	if out := g.kubectl(args...); !strings.Contains(out, want) {
		g.t.Errorf("kubectl %s: %q, want %q", strings.Join(args, " "), strings.TrimSpace(out), want)
	}
}

// versions are the policy's generation and the resourceVersions of it and every owned object.
func (g *gitops) versions() map[string]string {
	g.t.Helper()
	out := map[string]string{}
	p := &v1alpha1.RateLimitPolicy{}
	if err := g.c.env.Client.Get(context.Background(), types.NamespacedName{Namespace: g.ns, Name: "shop"}, p); err != nil {
		g.t.Fatal(err)
	}
	out["generation"] = fmt.Sprint(p.Generation)
	out["policy"] = p.ResourceVersion
	for _, o := range []client.Object{&corev1.ConfigMap{}, &appsv1.Deployment{}, &corev1.Service{}} {
		if err := g.c.env.Client.Get(context.Background(), types.NamespacedName{Namespace: g.ns, Name: g.name()}, o); err != nil {
			g.t.Fatal(err)
		}
		out[fmt.Sprintf("%T", o)] = o.GetResourceVersion()
	}
	return out
}

// proxy waits until the policy is Ready with n replicas and returns the proxy URL of one.
func (g *gitops) proxy(n int) string {
	g.t.Helper()
	waitReady(g.t, g.c.env.Client, types.NamespacedName{Namespace: g.ns, Name: "shop"}, 30*time.Second)
	pods, err := local.EnforcerPods(context.Background(), g.c.env.Client, g.ns, "shop")
	if err != nil || len(pods) != n {
		g.t.Fatalf("%d enforcer pods run (%v), want %d", len(pods), err, n)
	}
	return local.PodURL(&pods[0], "proxy")
}

// waitReplicas waits until the enforcer Deployment and status.enforcer both say n replicas, while
// the spec still says none.
func (g *gitops) waitReplicas(n int32) {
	g.t.Helper()
	poll.WaitFor(g.t, 20*time.Second, func() error {
		p := &v1alpha1.RateLimitPolicy{}
		if err := g.c.env.Client.Get(context.Background(), types.NamespacedName{Namespace: g.ns, Name: "shop"}, p); err != nil {
			return err
		}
		d := &appsv1.Deployment{}
		if err := g.c.env.Client.Get(context.Background(), types.NamespacedName{Namespace: g.ns, Name: g.name()}, d); err != nil {
			return err
		}
		switch {
		case p.Spec.Enforcer != nil:
			return fmt.Errorf("spec.enforcer was written: %+v", p.Spec.Enforcer)
		case d.Spec.Replicas == nil || *d.Spec.Replicas != n || p.Status.Enforcer == nil || p.Status.Enforcer.Replicas != n:
			return fmt.Errorf("Deployment replicas %v, status %+v; want %d", d.Spec.Replicas, p.Status.Enforcer, n)
		}
		return nil
	})
}

// waitObject waits until the object of the policy's namespace named name exists, or is gone.
func (g *gitops) waitObject(o client.Object, name string, exists bool) {
	g.t.Helper()
	poll.WaitFor(g.t, 20*time.Second, func() error {
		err := g.c.env.Client.Get(context.Background(), types.NamespacedName{Namespace: g.ns, Name: name}, o)
		switch {
		case exists && err != nil:
			return err
		case !exists && err == nil && o.GetDeletionTimestamp() == nil:
			return fmt.Errorf("%T %s still exists", o, name)
		case !exists && err != nil && !apierrors.IsNotFound(err):
			return err
		}
		return nil
	})
}

// waitStatus waits until a request through the enforcer gets status.
func (g *gitops) waitStatus(proxy string, status int) {
	g.t.Helper()
	poll.WaitFor(g.t, 20*time.Second, func() error {
		req, _ := http.NewRequest(http.MethodGet, proxy+"/", nil)
		req.Header.Set("X-Client", "c")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		_ = resp.Body.Close()
		if resp.StatusCode != status {
			return fmt.Errorf("status %d, want %d", resp.StatusCode, status)
		}
		return nil
	})
}
