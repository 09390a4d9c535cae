package e2e_test

import (
	"context"
	"fmt"
	"net/http"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// Status is read from the enforcers themselves: the revision each replica serves, its store's
// health in its own words, and its counters. Real API server, kube-controller-manager, manager
// and enforcer processes; the manager reads reports at its default interval.
func TestStatusWhenEnforcersReportThenStatusTellsWhatTheDataPlaneDoes(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	k8s := c.env.Client
	logs := newProcessLog(t)
	mgr, err := local.StartManager(ctx, c.env, c.managerBin, c.kubeconfig, logs, "--enforcer-image=sluice-enforcer:status", "--redis-probe-interval=0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mgr.Stop)
	upstream := okUpstream(t)
	const interval = 10 * time.Second // the manager's default --report-interval

	// namespace makes a namespace whose enforcer pods run, with the Service api to front.
	namespace := func(t *testing.T, opts local.KubeletOptions) (string, *local.Kubelet) {
		t.Helper()
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "status-"}}
		if err := k8s.Create(ctx, ns); err != nil {
			t.Fatal(err)
		}
		opts.Namespace, opts.Upstream, opts.Dir, opts.Log = ns.Name, upstream.URL, t.TempDir(), logs
		kubelet, err := local.StartKubelet(ctx, k8s, c.env.Config, c.enforcerBin, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(kubelet.Stop)
		svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: "api"},
			Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 8080}}}}
		if err := k8s.Create(ctx, svc); err != nil {
			t.Fatal(err)
		}
		return ns.Name, kubelet
	}
	policy := func(ns string, limit int64, storage *v1alpha1.Storage) *v1alpha1.RateLimitPolicy {
		return &v1alpha1.RateLimitPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "api"},
			Spec: v1alpha1.RateLimitPolicySpec{
				TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080},
				Rules: []v1alpha1.Rule{{Name: "per-client", Key: []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("X-Client")}},
					FixedWindow: &v1alpha1.Window{Limit: limit, Window: "1h"}}},
				Storage: storage,
			},
		}
	}
	readyCondition := func(t *testing.T, key types.NamespacedName) (*v1alpha1.RateLimitPolicy, *metav1.Condition) {
		t.Helper()
		p := &v1alpha1.RateLimitPolicy{}
		if err := k8s.Get(ctx, key, p); err != nil {
			t.Fatal(err)
		}
		return p, meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
	}

	t.Run("when a change reaches one replica of two then Ready waits for the other", func(t *testing.T) {
		ns, kubelet := namespace(t, local.KubeletOptions{})
		redis := redistest.NewServer(t)
		p := policy(ns, 5, &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redis.Addr())}}})
		if err := k8s.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		key := client.ObjectKeyFromObject(p)
		old := waitReady(t, k8s, key, 60*time.Second).Status.Enforcer.ConfigRevision
		pods, err := local.EnforcerPods(ctx, k8s, ns, "api")
		if err != nil || len(pods) != 2 {
			t.Fatalf("%d enforcer pods (%v), want 2", len(pods), err)
		}
		// One replica stops, as a stuck process would, and misses the change.
		stuck := pods[1]
		if err := kubelet.Signal(stuck.Name, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		update(t, k8s, key, func(p *v1alpha1.RateLimitPolicy) { p.Spec.Rules[0].FixedWindow.Limit = 9 })
		var cur string
		poll.WaitFor(t, 2*interval, func() error {
			p, c := readyCondition(t, key)
			cur = p.Status.Enforcer.ConfigRevision
			want := "1/2 replicas serve revision " + cur
			if cur == old || c.Status != metav1.ConditionFalse || !strings.HasPrefix(c.Message, want) || !strings.Contains(c.Message, stuck.Name) {
				return fmt.Errorf("Ready %s %s %q, want False and %q naming %s", c.Status, c.Reason, c.Message, want, stuck.Name)
			}
			if p.Status.Enforcer.Ready != "1/2" || p.Status.Reason != c.Reason {
				return fmt.Errorf("status.enforcer.ready %q, status.reason %q; want 1/2 and %s", p.Status.Enforcer.Ready, p.Status.Reason, c.Reason)
			}
			return nil
		})
		if r := fetchReport(t, &pods[0]); r.Revision != cur || r.ConfigSource != "api" {
			t.Errorf("the running replica reports revision %s from %s, want %s from the API", r.Revision, r.ConfigSource, cur)
		}
		if err := kubelet.Signal(stuck.Name, syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		p = waitReady(t, k8s, key, 2*interval)
		if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady); c.Message != "2/2 replicas serve revision "+cur {
			t.Errorf("Ready message %q, want 2/2 replicas serving %s", c.Message, cur)
		}
		for _, pod := range pods {
			if r := fetchReport(t, &pod); r.Revision != cur {
				t.Errorf("pod %s reports revision %s, want %s", pod.Name, r.Revision, cur)
			}
		}
	})

	t.Run("when the Redis password is wrong then Degraded says so in Redis's words, and clears once the Secret is fixed", func(t *testing.T) {
		// The kubelet refreshes mounted Secrets about once a minute; this one every 2 seconds.
		ns, _ := namespace(t, local.KubeletOptions{FileRefresh: 2 * time.Second})
		redis := redistest.NewServer(t)
		if err := redis.Client(t).ConfigSet(ctx, "requirepass", "right").Err(); err != nil {
			t.Fatal(err)
		}
		secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "redis-creds"}, StringData: map[string]string{"password": "wrong"}}
		if err := k8s.Create(ctx, secret); err != nil {
			t.Fatal(err)
		}
		created := time.Now()
		p := policy(ns, 5, &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redis.Addr())},
			CredentialsSecretRef: &v1alpha1.CredentialsSecretRef{Name: "redis-creds"}}})
		if err := k8s.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		key := client.ObjectKeyFromObject(p)
		cond := waitDegraded(t, k8s, key, metav1.ConditionTrue, v1alpha1.ReasonRedisAuthenticationFailed)
		t.Logf("Degraded %s %v after the policy was created: %s", cond.Reason, time.Since(created).Round(100*time.Millisecond), cond.Message)
		if !strings.HasPrefix(cond.Message, "replica sluice-api-") || !strings.Contains(cond.Message, "WRONGPASS") {
			t.Errorf("Degraded message %q, want a replica's name and Redis's WRONGPASS", cond.Message)
		}
		secret.StringData = map[string]string{"password": "right"}
		if err := k8s.Update(ctx, secret); err != nil {
			t.Fatal(err)
		}
		fixed := time.Now()
		poll.WaitFor(t, 2*interval+10*time.Second, func() error {
			p := &v1alpha1.RateLimitPolicy{}
			if err := k8s.Get(ctx, key, p); err != nil {
				return err
			}
			if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionDegraded); c.Status != metav1.ConditionFalse {
				return fmt.Errorf("Degraded %s %s: %s", c.Status, c.Reason, c.Message)
			}
			return nil
		})
		t.Logf("Degraded cleared %v after the Secret was fixed", time.Since(fixed).Round(100*time.Millisecond))
	})

	t.Run("when a burst ends then status counts its decisions exactly", func(t *testing.T) {
		ns, _ := namespace(t, local.KubeletOptions{})
		p := policy(ns, 5, nil)
		if err := k8s.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		key := client.ObjectKeyFromObject(p)
		waitReady(t, k8s, key, 60*time.Second)
		pods, err := local.EnforcerPods(ctx, k8s, ns, "api")
		if err != nil || len(pods) != 1 {
			t.Fatalf("%d enforcer pods (%v), want 1", len(pods), err)
		}
		passed := 0
		for range 8 {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, local.PodURL(&pods[0], "proxy")+"/", nil)
			req.Header.Set("X-Client", "alice")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				passed++
			}
		}
		if passed != 5 {
			t.Fatalf("%d of 8 passed, want 5", passed)
		}
		ended := time.Now()
		want := []v1alpha1.RuleStatus{{Name: "per-client", Allowed: 5, Limited: 3, LimitedShare: "37.5%"}}
		poll.WaitFor(t, interval+3*time.Second, func() error {
			p := &v1alpha1.RateLimitPolicy{}
			if err := k8s.Get(ctx, key, p); err != nil {
				return err
			}
			if fmt.Sprint(p.Status.Rules) != fmt.Sprint(want) || p.Status.Limited != "37.5%" {
				return fmt.Errorf("status.rules %+v, limited %q; want %+v, 37.5%%", p.Status.Rules, p.Status.Limited, want)
			}
			return nil
		})
		t.Logf("the burst's counts were in status %v after it ended", time.Since(ended).Round(100*time.Millisecond))

		// kubectl get shows them, with the replicas serving the revision and the store's health.
		out, err := exec.Command(c.env.Kubectl(), "--kubeconfig", c.kubeconfig, "get", "rlp", "-n", ns, "-o", "wide").CombinedOutput()
		if err != nil {
			t.Fatalf("kubectl get rlp: %v\n%s", err, out)
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		header, row := strings.Fields(lines[0]), strings.Fields(lines[len(lines)-1])
		if strings.Join(header, " ") != "NAME TARGET RULES READY LIMITED REASON STORE AGE STORAGE REVISION" ||
			len(row) != 9 || strings.Join(row[:6], " ") != "api api per-client 1/1 37.5% Connected" || row[7] != "memory" {
			t.Errorf("kubectl get rlp -o wide:\n%s", out)
		}
	})

	t.Run("the enforcer's service account reads its own ConfigMap and nothing else", func(t *testing.T) {
		ns, _ := namespace(t, local.KubeletOptions{})
		p := policy(ns, 5, nil)
		if err := k8s.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		waitReady(t, k8s, client.ObjectKeyFromObject(p), 60*time.Second)
		other := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "other"}}
		if err := k8s.Create(ctx, other); err != nil {
			t.Fatal(err)
		}
		cfg := rest.CopyConfig(c.env.Config)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:" + ns + ":sluice-api"}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		cms := cs.CoreV1().ConfigMaps(ns)
		own := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", "sluice-api").String()}
		if _, err := cms.Get(ctx, "sluice-api", metav1.GetOptions{}); err != nil {
			t.Errorf("get its own ConfigMap: %v", err)
		}
		if _, err := cms.List(ctx, own); err != nil {
			t.Errorf("list its own ConfigMap by name: %v", err)
		}
		w, err := cms.Watch(ctx, own)
		if err != nil {
			t.Errorf("watch its own ConfigMap by name: %v", err)
		} else {
			w.Stop()
		}
		if _, err := cms.Get(ctx, "other", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
			t.Errorf("get another ConfigMap: %v, want Forbidden", err)
		}
		if _, err := cms.List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
			t.Errorf("list every ConfigMap: %v, want Forbidden", err)
		}
		if _, err := cs.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
			t.Errorf("list Secrets: %v, want Forbidden", err)
		}
	})
}
