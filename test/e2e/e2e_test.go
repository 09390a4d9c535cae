// Package e2e_test proves the whole loop on one machine: a policy applied through the real API
// server and the webhook, reconciled by the manager binary, enforced by the enforcer binary that
// the controller rendered, on real HTTP traffic with a real Redis.
package e2e_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

func TestEndToEnd(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	env, k8s := c.env, c.env.Client
	redis := redistest.NewServer(t)
	logs := newProcessLog(t)
	mgr, err := local.StartManager(ctx, env, c.managerBin, c.kubeconfig, logs, "--enforcer-image=sluice-enforcer:e2e",
		"--redis-probe-interval=300ms", "--report-interval=500ms")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mgr.Stop)
	upstream := okUpstream(t)

	// A Service to front, and a policy with one fail-open and one fail-closed rule.
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "e2e-"}}
	if err := k8s.Create(ctx, ns); err != nil {
		t.Fatal(err)
	}
	c.runPods(t, ns.Name, upstream.URL, logs)
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: "api"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 8080}}}}
	if err := k8s.Create(ctx, svc); err != nil {
		t.Fatal(err)
	}
	byClient := []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("X-Client")}}
	policy := &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: "api"},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080},
			Rules: []v1alpha1.Rule{
				{Name: "open", FailureMode: v1alpha1.FailOpen, Key: byClient,
					Match:       &v1alpha1.Match{Path: &v1alpha1.PathMatch{Type: v1alpha1.PathMatchPrefix, Value: "/open"}},
					FixedWindow: &v1alpha1.Window{Limit: 5, Window: "1h"}},
				{Name: "closed", FailureMode: v1alpha1.FailClosed, Key: byClient,
					Match:       &v1alpha1.Match{Path: &v1alpha1.PathMatch{Type: v1alpha1.PathMatchPrefix, Value: "/closed"}},
					FixedWindow: &v1alpha1.Window{Limit: 3, Window: "1h"}},
			},
			Storage: &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redis.Addr())}}},
		},
	}
	if err := k8s.Create(ctx, policy); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKeyFromObject(policy)

	t.Run("when applied then Accepted and Programmed", func(t *testing.T) {
		poll.WaitFor(t, 30*time.Second, func() error {
			if err := k8s.Get(ctx, key, policy); err != nil {
				return err
			}
			for _, c := range []string{v1alpha1.ConditionAccepted, v1alpha1.ConditionProgrammed} {
				if !meta.IsStatusConditionTrue(policy.Status.Conditions, c) {
					return fmt.Errorf("%s is not True: %+v", c, policy.Status.Conditions)
				}
			}
			return nil
		})
	})

	var pods []corev1.Pod
	t.Run("when the Deployment's pods run then Ready says every replica serves the revision", func(t *testing.T) {
		p := waitReady(t, k8s, key, 60*time.Second)
		if p.Status.Enforcer.Ready != "2/2" || p.Status.Enforcer.ReadyReplicas != 2 {
			t.Errorf("status.enforcer = %+v, want ready 2/2", p.Status.Enforcer)
		}
		var err error
		if pods, err = local.EnforcerPods(ctx, k8s, ns.Name, "api"); err != nil || len(pods) != 2 {
			t.Fatalf("enforcer pods: %d, %v; want 2", len(pods), err)
		}
		for _, pod := range pods {
			if r := fetchReport(t, &pod); r.Revision != p.Status.Enforcer.ConfigRevision {
				t.Errorf("pod %s reports revision %s, status says %s", pod.Name, r.Revision, p.Status.Enforcer.ConfigRevision)
			}
		}
	})
	if len(pods) != 2 {
		t.FailNow()
	}
	proxy := local.PodURL(&pods[0], "proxy")
	// send makes one request and returns its status and header; the body is read and closed.
	send := func(base, path, client string) reply {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+path, nil)
		req.Header.Set("X-Client", client)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return reply{resp.StatusCode, resp.Header}
	}
	// passes sends n requests for one client and counts those that reach the upstream.
	passes := func(path, client string, n int) int {
		t.Helper()
		ok := 0
		for range n {
			switch resp := send(proxy, path, client); resp.StatusCode {
			case http.StatusOK:
				ok++
			case http.StatusTooManyRequests:
				if resp.Header.Get("Retry-After") == "" || resp.Header.Get("RateLimit") == "" || resp.Header.Get("RateLimit-Policy") == "" {
					t.Errorf("429 without Retry-After, RateLimit or RateLimit-Policy: %v", resp.Header)
				}
			default:
				t.Errorf("%s: status %d", path, resp.StatusCode)
			}
		}
		return ok
	}

	t.Run("when the rendered enforcer runs then traffic is limited exactly", func(t *testing.T) {
		if got := passes("/open/a", "alice", 8); got != 5 {
			t.Errorf("%d of 8 passed, want exactly the limit of 5", got)
		}
		if got := passes("/closed/a", "alice", 6); got != 3 {
			t.Errorf("%d of 6 passed, want exactly the limit of 3", got)
		}
	})

	t.Run("when the limit changes then every replica enforces it within 2 seconds", func(t *testing.T) {
		updated := time.Now()
		update(t, k8s, key, func(p *v1alpha1.RateLimitPolicy) { p.Spec.Rules[0].FixedWindow.Limit = 7 })
		for _, pod := range pods {
			i := 0
			poll.WaitFor(t, time.Until(updated.Add(2*time.Second)), func() error {
				i++
				resp := send(local.PodURL(&pod, "proxy"), "/open/probe", fmt.Sprintf("probe-%s-%d", pod.Name, i))
				if p := resp.Header.Get("RateLimit-Policy"); !strings.Contains(p, `"open";q=7;`) {
					return fmt.Errorf("pod %s does not enforce the new limit; RateLimit-Policy: %s", pod.Name, p)
				}
				return nil
			})
		}
		t.Logf("every replica enforced the new limit %v after the update", time.Since(updated).Round(time.Millisecond))
		if got := passes("/open/b", "bob", 9); got != 7 {
			t.Errorf("%d of 9 passed, want exactly the new limit of 7", got)
		}
		p := waitReady(t, k8s, key, 10*time.Second)
		if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady); !strings.HasPrefix(c.Message, "2/2 replicas serve revision "+p.Status.Enforcer.ConfigRevision) {
			t.Errorf("Ready message %q, want 2/2 replicas serving %s", c.Message, p.Status.Enforcer.ConfigRevision)
		}
	})

	t.Run("when an update is invalid then the webhook rejects it and the old limit holds", func(t *testing.T) {
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			p := &v1alpha1.RateLimitPolicy{}
			if err := k8s.Get(ctx, key, p); err != nil {
				return err
			}
			p.Spec.Rules[0].Match.Path = &v1alpha1.PathMatch{Type: v1alpha1.PathMatchRegularExpression, Value: "/open/(["}
			return k8s.Update(ctx, p)
		})
		testenv.RequireInvalid(t, err, "spec.rules[0].match.path.value", "must be a valid RE2 regular expression")
		if got := passes("/open/c", "carol", 9); got != 7 {
			t.Errorf("%d of 9 passed, want the old limit of 7", got)
		}
	})

	t.Run("when Redis dies then fail-open rules pass, fail-closed rules refuse, and the replicas say why", func(t *testing.T) {
		redis.Kill()
		for i := range 5 {
			if resp := send(proxy, "/open/d", "dave"); resp.StatusCode != http.StatusOK {
				t.Errorf("fail-open request %d: status %d, want 200", i, resp.StatusCode)
			}
			if resp := send(proxy, "/closed/d", "dave"); resp.StatusCode != http.StatusServiceUnavailable {
				t.Errorf("fail-closed request %d: status %d, want 503", i, resp.StatusCode)
			}
		}
		c := waitDegraded(t, k8s, key, metav1.ConditionTrue, v1alpha1.ReasonRedisUnreachable)
		if !strings.HasPrefix(c.Message, "replica "+pods[0].Name+": ") && !strings.HasPrefix(c.Message, "replica "+pods[1].Name+": ") ||
			!strings.Contains(c.Message, "connection refused") {
			t.Errorf("Degraded message %q, want a replica's own error", c.Message)
		}
	})

	t.Run("when Redis comes back then rules are decided again", func(t *testing.T) {
		if err := redis.Start(); err != nil {
			t.Fatal(err)
		}
		poll.WaitFor(t, 5*time.Second, func() error {
			if resp := send(proxy, "/closed/probe", "recovery"); resp.StatusCode != http.StatusOK {
				return fmt.Errorf("status %d", resp.StatusCode)
			}
			return nil
		})
		if got := passes("/closed/e", "erin", 5); got != 3 {
			t.Errorf("%d of 5 passed, want exactly the limit of 3", got)
		}
		waitDegraded(t, k8s, key, metav1.ConditionFalse, v1alpha1.ReasonAsExpected)
	})

	t.Run("when the policy is deleted then the garbage collector removes every owned object", func(t *testing.T) {
		if err := k8s.Get(ctx, key, policy); err != nil {
			t.Fatal(err)
		}
		name := types.NamespacedName{Namespace: ns.Name, Name: "sluice-api"}
		owned := []client.Object{&corev1.ConfigMap{}, &appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{},
			&corev1.ServiceAccount{}, &rbacv1.Role{}, &rbacv1.RoleBinding{}}
		for _, o := range owned {
			if err := k8s.Get(ctx, name, o); err != nil {
				t.Fatal(err)
			}
		}
		if err := k8s.Delete(ctx, policy); err != nil {
			t.Fatal(err)
		}
		poll.WaitFor(t, 60*time.Second, func() error {
			for _, o := range owned {
				if err := k8s.Get(ctx, name, o); !apierrors.IsNotFound(err) {
					return fmt.Errorf("%T %s not collected: %w", o, name, err)
				}
			}
			left, err := local.EnforcerPods(ctx, k8s, ns.Name, "api")
			if err != nil {
				return err
			}
			if len(left) > 0 {
				return fmt.Errorf("%d enforcer pods left", len(left))
			}
			return nil
		})
	})
}

// waitReady waits until the policy is Ready and returns it.
func waitReady(t *testing.T, k8s client.Client, key types.NamespacedName, timeout time.Duration) *v1alpha1.RateLimitPolicy {
	t.Helper()
	p := &v1alpha1.RateLimitPolicy{}
	poll.WaitFor(t, timeout, func() error {
		if err := k8s.Get(context.Background(), key, p); err != nil {
			return err
		}
		c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || c.Status != metav1.ConditionTrue || c.ObservedGeneration != p.Generation {
			return fmt.Errorf("not Ready: %+v", c)
		}
		return nil
	})
	return p
}

// fetchReport reads an enforcer pod's report.
func fetchReport(t *testing.T, pod *corev1.Pod) *report.Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := controllers.FetchReport(http.DefaultClient)(ctx, pod)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// waitDegraded waits until the policy's Degraded condition has the status and reason, and
// returns it.
func waitDegraded(t *testing.T, k8s client.Client, key types.NamespacedName, want metav1.ConditionStatus, reason string) *metav1.Condition {
	t.Helper()
	var c *metav1.Condition
	poll.WaitFor(t, 15*time.Second, func() error {
		p := &v1alpha1.RateLimitPolicy{}
		if err := k8s.Get(context.Background(), key, p); err != nil {
			return err
		}
		c = meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionDegraded)
		if c == nil || c.Status != want || c.Reason != reason {
			return fmt.Errorf("Degraded = %+v, want %s %s", c, want, reason)
		}
		return nil
	})
	return c
}

type reply struct {
	StatusCode int
	Header     http.Header
}

// okUpstream serves "ok" to every request until the test ends.
func okUpstream(t testing.TB) *httptest.Server {
	t.Helper()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }))
	t.Cleanup(up.Close)
	return up
}

// unthrottled is a client of the control plane that can watch and is not rate-limited, for
// tests that create objects by the thousand.
func (c *cluster) unthrottled(t testing.TB) client.WithWatch {
	t.Helper()
	cfg := rest.CopyConfig(c.env.Config)
	cfg.QPS, cfg.Burst = -1, 0
	k8s, err := client.NewWithWatch(cfg, client.Options{Scheme: clientgoscheme.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	return k8s
}

// runPods runs the enforcer pods of a namespace, with upstream for their --upstream, until the
// test ends.
func (c *cluster) runPods(t testing.TB, namespace, upstream string, logs io.Writer) *local.Kubelet {
	t.Helper()
	k, err := local.StartKubelet(context.Background(), c.env.Client, c.env.Config, c.enforcerBin,
		local.KubeletOptions{Namespace: namespace, Upstream: upstream, Dir: t.TempDir(), Log: logs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	return k
}

func update(t *testing.T, k8s client.Client, key types.NamespacedName, change func(*v1alpha1.RateLimitPolicy)) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		p := &v1alpha1.RateLimitPolicy{}
		if err := k8s.Get(context.Background(), key, p); err != nil {
			return err
		}
		change(p)
		return k8s.Update(context.Background(), p)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// processLog keeps the processes' output; the test prints it when it fails.
type processLog = local.Output

func newProcessLog(t *testing.T) *processLog {
	t.Helper()
	l := &processLog{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("manager and enforcer output:\n%s", l.String())
		}
	})
	return l
}

// With cert-manager, the manager serves the certificate it finds in a directory (the mounted
// Secret) and leaves the caBundle to cert-manager's injector. Here envtest plays cert-manager: it
// wrote a certificate into a directory and its CA into the webhook configurations.
func TestManagerWhenCertificatesComeFromADirectoryThenTheWebhookServesThem(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	env := c.env
	logs := newProcessLog(t)
	mgr, err := local.StartManager(ctx, env, c.managerBin, c.kubeconfig, logs,
		"--webhook-cert-dir="+env.Webhook.LocalServingCertDir, "--enforcer-image=sluice-enforcer:from-dir")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mgr.Stop)

	p := &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "from-dir"},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080},
			Rules:     []v1alpha1.Rule{{Name: "all", Key: []v1alpha1.KeySource{{Type: v1alpha1.KeyRemoteAddress}}, FixedWindow: &v1alpha1.Window{Limit: 1, Window: "1s"}}},
		},
	}
	// The webhook fails closed: a create that passes reached it, and one that only it refuses
	// is refused by it.
	if err := env.Client.Create(ctx, p, client.DryRunAll); err != nil {
		t.Fatal(err)
	}
	p.Spec.Rules[0].Key = append(p.Spec.Rules[0].Key, p.Spec.Rules[0].Key[0])
	if err := env.Client.Create(ctx, p, client.DryRunAll); err == nil || !strings.Contains(err.Error(), "denied the request") {
		t.Errorf("a repeated key part: %v, want the webhook's denial", err)
	}
	var secrets corev1.SecretList
	if err := env.Client.List(ctx, &secrets, client.InNamespace(local.Namespace)); err != nil {
		t.Fatal(err)
	}
	if len(secrets.Items) != 0 {
		t.Errorf("the manager made %d Secrets; with a certificate directory it must make none", len(secrets.Items))
	}
}
