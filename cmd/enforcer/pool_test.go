package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// pooledPolicy is a one-rule policy of a pool: limit requests per X-Client an hour.
func pooledPolicy(ns, name string, limit int) string {
	return fmt.Sprintf(`apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: %s, namespace: %s}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: per-client
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: %d, window: 1h}
`, name, ns, limit)
}

// poolConfigMap is a ConfigMap as the manager writes it for a pooled policy.
func poolConfigMap(ns, pool, policy, data string) *corev1.ConfigMap {
	return &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sluice-pool-" + pool + "." + strings.ReplaceAll(policy, "/", "."),
			Labels:      map[string]string{report.PoolLabel: pool},
			Annotations: map[string]string{report.PolicyAnnotation: policy}},
		Data: map[string]string{report.PolicyFileKey: data},
	}
}

// poolIdentity makes the identity the manager renders for a pool's enforcers, a service account
// that may list and watch the ConfigMaps of the pool's namespace and nothing else, and
// writes a kubeconfig with a token of it.
func poolIdentity(t *testing.T, env *testenv.Env, ns string) string {
	t.Helper()
	ctx := context.Background()
	k8s := env.Client
	objs := []client.Object{
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pool"}},
		&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pool"}, Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"list", "watch"}}}},
		&rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pool"},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "pool"},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: ns, Name: "pool"}}},
	}
	for _, o := range objs {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)}}
	if err := k8s.SubResource("token").Create(ctx, objs[0], req); err != nil {
		t.Fatal(err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: env.Config.Host, CertificateAuthorityData: env.Config.CAData}
	cfg.AuthInfos["pool"] = &clientcmdapi.AuthInfo{Token: req.Status.Token}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "pool"}
	cfg.CurrentContext = "c"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// A pool's replica, the real binary with the identity the manager renders (list and watch
// on its namespace's ConfigMaps): it serves the policies of the ConfigMaps labelled with its
// pool, each loaded apart, through the check API's /policies/<namespace>/<name>/... paths and
// the rate limit service by domain or by a descriptor's sluice-policy entry; it refuses a
// request for a policy it does not serve, naming it; a policy whose config does not load is
// refused alone and reported, while the others are served; counters of two policies never share
// a Redis key; a change of one policy is served without a restart, and a deleted one is no
// longer served.
func TestEnforcerBinaryWhenItServesAPoolThenEachPolicyIsServedAndRefusedApart(t *testing.T) {
	ctx := context.Background()
	tier.Needs(t, "the test control plane, redis-server and the built enforcer binary")
	env, err := testenv.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	k8s := env.Client
	ns := testenv.Namespace(t, k8s, "pool")
	redis := redistest.NewServer(t)

	badPolicy := strings.Replace(pooledPolicy("shop", "bad", 1), "fixedWindow:", "fixedWindw:", 1)
	for _, cm := range []*corev1.ConfigMap{
		poolConfigMap(ns, "shared", "shop/a", pooledPolicy("shop", "a", 2)),
		poolConfigMap(ns, "shared", "team/b", pooledPolicy("team", "b", 3)),
		poolConfigMap(ns, "shared", "shop/bad", badPolicy),
		poolConfigMap(ns, "other", "shop/c", pooledPolicy("shop", "c", 9)), // another pool's
		poolConfigMap(ns, "shared", "shop/liar", pooledPolicy("shop", "d", 9)),
	} {
		if err := k8s.Create(ctx, cm); err != nil {
			t.Fatal(err)
		}
	}
	unlabelled := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "not-a-policy"}, Data: map[string]string{"x": "y"}}
	if err := k8s.Create(ctx, unlabelled); err != nil {
		t.Fatal(err)
	}

	check, _ := local.FreeAddr()
	rlsAddr, _ := local.FreeAddr()
	admin, _ := local.FreeAddr()
	log := &local.Output{}
	p, err := local.Start("enforcer", log, binary(t), "--pool="+ns+"/shared", "--kubeconfig="+poolIdentity(t, env, ns),
		"--check-listen="+check, "--rls-listen="+rlsAddr, "--admin-listen="+admin, "--shutdown-delay=0s",
		"--redis-url=redis://"+redis.Addr()+"/0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("enforcer log:\n%s", log.String())
		}
	})
	if err := local.WaitHTTP(p, "http://"+admin+"/readyz", 30*time.Second); err != nil {
		t.Fatal(err)
	}

	served := func(r report.Report) []string {
		var ids []string
		for _, s := range r.Policies {
			ids = append(ids, s.Policy+"@"+s.Revision)
		}
		return ids
	}
	rev := func(data string) string { return report.Revision([]byte(data)) }

	t.Run("when ready then the report names the pool and every policy served and refused", func(t *testing.T) {
		r := readReport(t, admin)
		want := []string{"shop/a@" + rev(pooledPolicy("shop", "a", 2)), "team/b@" + rev(pooledPolicy("team", "b", 3))}
		if r.Pool != ns+"/shared" || !r.Synced || !slices.Equal(served(r), want) {
			t.Errorf("pool %q synced %v served %v, want %s/shared true %v", r.Pool, r.Synced, served(r), ns, want)
		}
		refused := map[string]string{}
		for _, f := range r.Refused {
			refused[f.Policy] = f.Reason
		}
		if len(refused) != 2 || !strings.Contains(refused["shop/bad"], `unknown field "spec.rules[0].fixedWindw"`) ||
			!strings.Contains(refused["shop/liar"], "holds policy shop/d, but its ConfigMap is shop/liar's") {
			t.Errorf("refused %v, want shop/bad's unknown field and shop/liar's other policy", refused)
		}
	})

	ask := func(path, client string) int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, "http://"+check+path, nil)
		req.Header.Set("X-Forwarded-Method", "GET")
		req.Header.Set("X-Forwarded-Uri", "/orders")
		req.Header.Set("X-Original-Method", "GET")
		req.Header.Set("X-Original-Url", "http://shop.example/orders")
		req.Header.Set("X-Client", client)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	statuses := func(path, client string, n int) []int {
		var out []int
		for range n {
			out = append(out, ask(path, client))
		}
		return out
	}

	t.Run("when the check API is asked by path then each policy's own limit decides", func(t *testing.T) {
		if got := statuses("/policies/shop/a/forward-auth", "ann", 3); !slices.Equal(got, []int{200, 200, 429}) {
			t.Errorf("shop/a forward-auth: %v, want its limit of 2", got)
		}
		// The same client key in another policy is another counter.
		if got := statuses("/policies/team/b/auth-request", "ann", 4); !slices.Equal(got, []int{200, 200, 200, 403}) {
			t.Errorf("team/b auth-request: %v, want its limit of 3, refused as 403 for nginx", got)
		}
	})

	t.Run("when nginx asks by the policy's auth-request path, as ingress-nginx's auth-url, then its limit holds and a policy not served lets nothing through", func(t *testing.T) {
		var hits atomic.Int64
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { hits.Add(1); _, _ = io.WriteString(w, "ok") }))
		t.Cleanup(up.Close)
		served, unserved := freeAddr(t), freeAddr(t)
		conf := strings.NewReplacer("{{served}}", served, "{{unserved}}", unserved, "{{check}}", "http://"+check, "{{upstream}}", up.URL,
			"{{ns}}", "shop").Replace(poolNginx)
		startNginx(t, conf)
		send := func(addr, client string) int {
			t.Helper()
			status := 0
			poll.WaitFor(t, 10*time.Second, func() error {
				req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/orders", nil)
				req.Header.Set("X-Client", client)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return fmt.Errorf("nginx at %s does not answer: %w", addr, err)
				}
				_ = resp.Body.Close()
				status = resp.StatusCode
				return nil
			})
			return status
		}
		var got []int
		for range 3 {
			got = append(got, send(served, "gina"))
		}
		if !slices.Equal(got, []int{200, 200, 429}) || hits.Load() != 2 {
			t.Errorf("through nginx to shop/a: %v, the upstream saw %d; want 200, 200, 429 and 2", got, hits.Load())
		}
		if status := send(unserved, "hal"); status != http.StatusInternalServerError || hits.Load() != 2 {
			t.Errorf("through nginx to a policy the pool does not serve: %d, the upstream saw %d; want nginx's 500 and nothing through", status, hits.Load())
		}
	})

	t.Run("when a request names a policy not served then 404 names it, and a bare endpoint says how to name one", func(t *testing.T) {
		for path, want := range map[string]string{
			"/policies/shop/bad/forward-auth":  `policy \"shop/bad\" is not served here`,
			"/policies/shop/c/auth-request":    `policy \"shop/c\" is not served here`,
			"/policies/nowhere/x/forward-auth": `policy \"nowhere/x\" is not served here`,
			"/forward-auth":                    "a pool's check API decides for one policy at a time",
			"/policies/shop/a/forward-auth/x":  "the check API answers on",
			"/policies/shop/a/other":           "the check API answers on",
		} {
			req, _ := http.NewRequest(http.MethodGet, "http://"+check+path, nil)
			req.Header.Set("X-Forwarded-Method", "GET")
			req.Header.Set("X-Forwarded-Uri", "/")
			status, body := do(t, req)
			if status != http.StatusNotFound || !strings.Contains(body, want) {
				t.Errorf("%s: %d %s, want 404 with %q", path, status, body, want)
			}
		}
	})

	conn, err := grpc.NewClient(rlsAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	rls := rlsv3.NewRateLimitServiceClient(conn)
	call := func(domain string, entries ...string) (*rlsv3.RateLimitResponse, error) {
		d := &rlv3.RateLimitDescriptor{}
		for i := 0; i+1 < len(entries); i += 2 {
			d.Entries = append(d.Entries, &rlv3.RateLimitDescriptor_Entry{Key: entries[i], Value: entries[i+1]})
		}
		return rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: domain, Descriptors: []*rlv3.RateLimitDescriptor{d}})
	}

	t.Run("when Envoy asks by domain or by a descriptor's sluice-policy entry then that policy decides", func(t *testing.T) {
		var codes []rlsv3.RateLimitResponse_Code
		for range 3 {
			r, err := call("shop/a", "x-client", "bob")
			if err != nil {
				t.Fatal(err)
			}
			codes = append(codes, r.GetOverallCode())
		}
		if !slices.Equal(codes, []rlsv3.RateLimitResponse_Code{rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT}) {
			t.Errorf("domain shop/a: %v, want its limit of 2", codes)
		}
		// One domain for every route, as Contour's rate limit service has: the entry names the policy.
		codes = nil
		for range 4 {
			r, err := call("contour", enforcer.EntryPolicy, "team/b", "x-client", "bob")
			if err != nil {
				t.Fatal(err)
			}
			codes = append(codes, r.GetOverallCode())
		}
		if !slices.Equal(codes, []rlsv3.RateLimitResponse_Code{rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT}) {
			t.Errorf("sluice-policy team/b: %v, want its limit of 3", codes)
		}
	})

	t.Run("when Envoy asks for a policy not served then OVER_LIMIT names it, whatever Envoy's failure mode", func(t *testing.T) {
		refused := func(r *rlsv3.RateLimitResponse, err error) string {
			t.Helper()
			if err != nil || r.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
				// An error would pass unlimited under Envoy's default failure_mode_deny: false.
				t.Errorf("%v, %v; want OVER_LIMIT", r.GetOverallCode(), err)
				return ""
			}
			var p struct{ Status int }
			if err := json.Unmarshal(r.GetRawBody(), &p); err != nil || p.Status != http.StatusTooManyRequests {
				t.Errorf("body %q: %v, want a problem of status 429", r.GetRawBody(), err)
			}
			return string(r.GetRawBody())
		}
		for _, c := range []struct {
			domain  string
			entries []string
			want    string
		}{
			{"shop/bad", []string{"x-client", "bob"}, `domain \"shop/bad\": no policy of that name is served here`},
			{"contour", []string{"x-client", "bob"}, `domain \"contour\": no policy of that name is served here; the domain is the policy's \u003cnamespace\u003e/\u003cname\u003e, or each descriptor names its policy with an entry \"sluice-policy\"`},
			{"contour", []string{enforcer.EntryPolicy, "shop/c", "x-client", "bob"}, `descriptor 0: policy \"shop/c\" is not served here`},
			{"shop/a", []string{enforcer.EntryPolicy, "team/b", "x-client", "bob"}, `descriptor 0 names policy \"team/b\", the domain \"shop/a\"`},
		} {
			if body := refused(call(c.domain, c.entries...)); !strings.Contains(body, c.want) {
				t.Errorf("domain %s %v: body %q, want %q in it", c.domain, c.entries, body, c.want)
			}
		}
		// Of two descriptors under one global domain, the one that names no policy is refused,
		// and with it the call: nothing is charged.
		both := func() (*rlsv3.RateLimitResponse, error) {
			return rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "contour", Descriptors: []*rlv3.RateLimitDescriptor{
				{Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: enforcer.EntryPolicy, Value: "shop/a"}, {Key: "x-client", Value: "fay"}}},
				{Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: "x-client", Value: "fay"}}},
			}})
		}
		for range 5 {
			if want, body := `descriptor 1 names no policy: the domain \"contour\" is no policy served here`, refused(both()); !strings.Contains(body, want) {
				t.Errorf("two descriptors, the second naming no policy: body %q, want %q in it", body, want)
			}
		}
		if r, err := call("shop/a", "x-client", "fay"); err != nil || r.GetOverallCode() != rlsv3.RateLimitResponse_OK {
			t.Errorf("fay on shop/a after five refused calls: %v, %v; want OK, nothing charged by them", r.GetOverallCode(), err)
		}
	})

	t.Run("when two policies count the same client then their Redis keys are apart", func(t *testing.T) {
		patterns := map[string]string{}
		for _, id := range []string{"shop/a", "team/b"} {
			req, _ := http.NewRequest(http.MethodGet, "http://"+admin+enforcer.KeysPath+"?policy="+id, nil)
			status, body := do(t, req)
			i := strings.Index(body, `"pattern":"`)
			if status != http.StatusOK || i < 0 {
				t.Fatalf("/keys for %s: %d %s", id, status, body)
			}
			patterns[id] = strings.SplitN(body[i+len(`"pattern":"`):], `"`, 2)[0]
		}
		rc := redis.Client(t)
		for id, pattern := range patterns {
			keys, err := rc.Keys(ctx, pattern).Result()
			if err != nil {
				t.Fatal(err)
			}
			if len(keys) == 0 {
				t.Errorf("no Redis key of %s (pattern %s) after its decisions", id, pattern)
			}
			for other, op := range patterns {
				if other == id {
					continue
				}
				if shared, _ := rc.Keys(ctx, op).Result(); slices.ContainsFunc(keys, func(k string) bool { return slices.Contains(shared, k) }) {
					t.Errorf("%s and %s share a key", id, other)
				}
			}
		}
	})

	setData := func(name, data string) {
		t.Helper()
		if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			cm := &corev1.ConfigMap{}
			if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, cm); err != nil {
				return err
			}
			cm.Data[report.PolicyFileKey] = data
			return k8s.Update(ctx, cm)
		}); err != nil {
			t.Fatal(err)
		}
	}
	waitReport := func(what string, ok func(report.Report) bool) report.Report {
		t.Helper()
		var r report.Report
		poll.WaitFor(t, 10*time.Second, func() error {
			if r = readReport(t, admin); !ok(r) {
				return fmt.Errorf("%s: served %v, refused %+v", what, served(r), r.Refused)
			}
			return nil
		})
		return r
	}

	t.Run("when one policy's change does not load then it alone is refused and keeps its last good config", func(t *testing.T) {
		a := poolConfigMap(ns, "shared", "shop/a", "").Name
		broken := strings.Replace(pooledPolicy("shop", "a", 5), "limit: 5", "limit: 0", 1)
		setData(a, broken)
		waitReport("shop/a's broken change refused", func(r report.Report) bool {
			return slices.ContainsFunc(r.Refused, func(f report.PolicyRefused) bool { return f.Policy == "shop/a" && f.Revision == rev(broken) })
		})
		r := readReport(t, admin)
		if !slices.Contains(served(r), "shop/a@"+rev(pooledPolicy("shop", "a", 2))) || !slices.Contains(served(r), "team/b@"+rev(pooledPolicy("team", "b", 3))) {
			t.Errorf("served %v, want shop/a at its last good revision and team/b", served(r))
		}
		if got := statuses("/policies/shop/a/forward-auth", "carl", 3); !slices.Equal(got, []int{200, 200, 429}) {
			t.Errorf("shop/a after its refused change: %v, want its last good limit of 2", got)
		}

		// Fixed, it is served at once, without a restart.
		start := time.Now()
		setData(a, pooledPolicy("shop", "a", 4))
		waitReport("shop/a's fix served", func(r report.Report) bool {
			return slices.Contains(served(r), "shop/a@"+rev(pooledPolicy("shop", "a", 4))) && !slices.ContainsFunc(r.Refused, func(f report.PolicyRefused) bool { return f.Policy == "shop/a" })
		})
		t.Logf("a changed policy was served %v after the update", time.Since(start).Round(time.Millisecond))
		if got := statuses("/policies/shop/a/forward-auth", "dora", 5); !slices.Equal(got, []int{200, 200, 200, 200, 429}) {
			t.Errorf("shop/a after its fix: %v, want its new limit of 4", got)
		}
	})

	t.Run("when a policy's ConfigMap is deleted then it is no longer served", func(t *testing.T) {
		if err := k8s.Delete(ctx, poolConfigMap(ns, "shared", "team/b", "")); err != nil {
			t.Fatal(err)
		}
		waitReport("team/b gone", func(r report.Report) bool {
			return !slices.ContainsFunc(r.Policies, func(s report.PolicyServed) bool { return s.Policy == "team/b" })
		})
		if status := ask("/policies/team/b/forward-auth", "erin"); status != http.StatusNotFound {
			t.Errorf("team/b after its deletion: %d, want 404", status)
		}
	})
}

// A replica that cannot reach the API server has loaded nothing: it is not ready, so that no
// Service sends it requests it would refuse.
func TestEnforcerBinaryWhenAPoolReplicaCannotListItsConfigMapsThenItIsNotReady(t *testing.T) {
	closed, _ := local.FreeAddr()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://" + closed, InsecureSkipTLSVerify: true}
	cfg.AuthInfos["u"] = &clientcmdapi.AuthInfo{Token: "t"}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	cfg.CurrentContext = "c"
	if err := clientcmd.WriteToFile(*cfg, kubeconfig); err != nil {
		t.Fatal(err)
	}
	check, _ := local.FreeAddr()
	admin, _ := local.FreeAddr()
	p, err := local.Start("enforcer", &local.Output{}, binary(t), "--pool=gateways/shared", "--kubeconfig="+kubeconfig,
		"--check-listen="+check, "--admin-listen="+admin, "--shutdown-delay=0s")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	if err := local.WaitHTTP(p, "http://"+admin+"/healthz", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	// Live, and for as long as the API server stays away, not ready: a second is ten of the
	// loop's rounds that would notice a sync.
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		req, _ := http.NewRequest(http.MethodGet, "http://"+admin+"/readyz", nil)
		status, body := do(t, req)
		if status != http.StatusServiceUnavailable || !strings.Contains(body, "loading the pool's policies") {
			t.Fatalf("/readyz: %d %s, want 503 while the pool's policies are not loaded", status, body)
		}
	}
	if r := readReport(t, admin); r.Synced || len(r.Policies) != 0 {
		t.Errorf("report synced %v with %d policies, want neither", r.Synced, len(r.Policies))
	}
}

// do sends req and returns the response's status and body.
func do(t *testing.T, req *http.Request) (int, string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(data)
}

// poolNginx is nginx as ingress-nginx renders an Ingress whose auth-url is a pool's check API at
// a policy's auth-request path, with the snippets of docs/enforcer.md: one server for a policy
// the pool serves, one for a policy it does not.
const poolNginx = `
worker_processes 1;
error_log {{dir}}/error.log;
pid {{dir}}/nginx.pid;
events { worker_connections 64; }
http {
  access_log off;
  client_body_temp_path {{dir}}/body;
  proxy_temp_path {{dir}}/proxy;
  fastcgi_temp_path {{dir}}/fastcgi;
  uwsgi_temp_path {{dir}}/uwsgi;
  scgi_temp_path {{dir}}/scgi;
  server {
    listen {{served}};
    location @sluice_429 {
      add_header Retry-After $sluice_retry_after always;
      default_type application/problem+json;
      return 429 '{"type":"https://sluice.dev/problems/rate-limited","title":"Too Many Requests","status":429}\n';
    }
    location = /_external-auth {
      internal;
      proxy_pass_request_body off;
      proxy_set_header Content-Length "";
      proxy_set_header X-Original-URL $scheme://$http_host$request_uri;
      proxy_set_header X-Original-Method $request_method;
      proxy_http_version 1.1;
      proxy_pass {{check}}/policies/{{ns}}/a/auth-request;
    }
    location / {
      auth_request /_external-auth;
      auth_request_set $sluice_retry_after $upstream_http_retry_after;
      error_page 403 = @sluice_429;
      proxy_pass {{upstream}};
    }
  }
  server {
    listen {{unserved}};
    location = /_external-auth {
      internal;
      proxy_pass_request_body off;
      proxy_set_header Content-Length "";
      proxy_set_header X-Original-URL $scheme://$http_host$request_uri;
      proxy_set_header X-Original-Method $request_method;
      proxy_http_version 1.1;
      proxy_pass {{check}}/policies/{{ns}}/nope/auth-request;
    }
    location / {
      auth_request /_external-auth;
      proxy_pass {{upstream}};
    }
  }
}
`

// startNginx runs the real nginx with a configuration until the test ends.
func startNginx(t *testing.T, conf string) {
	t.Helper()
	tier.Needs(t, "nginx")
	bin, err := exec.LookPath("nginx")
	if err != nil {
		t.Fatalf("the tests need nginx (hack/ensure-packages.sh): %v", err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "nginx.conf"), []byte(strings.ReplaceAll(conf, "{{dir}}", dir)), 0o644); err != nil {
		t.Fatal(err)
	}
	out := &local.Output{}
	p, err := local.Start("nginx", out, bin, "-p", dir, "-c", "nginx.conf", "-g", "daemon off;")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			log, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			t.Logf("nginx: %s\nerror.log:\n%s", out, log)
		}
	})
}

func freeAddr(t *testing.T) string {
	t.Helper()
	addr, err := local.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}
