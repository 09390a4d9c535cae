// Package gateway_test runs the real Traefik, built from Go modules by hack/tool.sh, as a Gateway
// API implementation in front of Sluice: against the test API server with the Gateway API CRDs
// (sigs.k8s.io/gateway-api) and Traefik's own, the manager binary, the enforcer pods the real
// Deployment controller creates (run by test/local's Kubelet) and the EndpointSlices the real
// EndpointSlice controller writes for them, so Traefik routes to the enforcer processes exactly
// as it routes to pods in a cluster.
//
// The API server refuses loopback addresses in EndpointSlices, so the tests run in a network
// namespace of their own whose every address of local.PodNetwork is local: the pods get
// addresses of it (see local.RunInPodNetwork).
package gateway_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// Where the CRDs come from, found before the tests enter their network namespace (which reaches
// no module proxy) and handed to them in these variables.
const (
	gatewayAPIDirEnv = "SLUICE_GATEWAY_API_DIR"
	traefikDirEnv    = "SLUICE_TRAEFIK_MODULE_DIR"
)

func TestMain(m *testing.M) {
	flag.Parse()
	tier.RunFast(m)
	if !local.InPodNetwork() {
		env, err := prepare()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		code, err := local.RunInPodNetwork(env...)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// prepare builds (once per machine) or finds what needs the network: the control plane, Traefik
// and the modules whose CRDs the tests install; it returns them as environment variables.
func prepare() ([]string, error) {
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		out, err := exec.Command(filepath.Join(testenv.RepoRoot(), "hack", "envtest.sh")).Output()
		if err != nil {
			return nil, fmt.Errorf("hack/envtest.sh: %w", err)
		}
		assets = strings.TrimSpace(string(out))
	}
	traefik, err := local.Tool("traefik")
	if err != nil {
		return nil, err
	}
	// The modules Traefik was built from hold the CRDs that fit it: Traefik v3.6 implements
	// Gateway API v1.4.
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api", "github.com/traefik/traefik/v3")
	cmd.Dir = filepath.Join(testenv.RepoRoot(), "hack", "tools", "traefik")
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("find the Gateway API and Traefik modules: %w", err)
	}
	dirs := strings.Fields(string(out))
	if len(dirs) != 2 {
		return nil, fmt.Errorf("go list -m: %q, want two module directories", out)
	}
	return []string{"KUBEBUILDER_ASSETS=" + assets, "TRAEFIK=" + traefik, gatewayAPIDirEnv + "=" + dirs[0], traefikDirEnv + "=" + dirs[1]}, nil
}

// traefikConfig is Traefik's static configuration: one entry point for the Gateway's listener,
// the Gateway API and CRD providers (the CRD provider serves the Middleware an ExtensionRef
// names), reading the cluster from $KUBECONFIG.
const traefikConfig = `
global: {checkNewVersion: false, sendAnonymousUsage: false}
entryPoints:
  web: {address: "{{web}}"}
  traefik: {address: "{{ping}}"}
ping: {}
log: {level: INFO}
providers:
  kubernetesGateway: {}
  kubernetesCRD: {}
`

// gatewayManifests are the Gateway API objects, as docs/enforcer.md gives them: the Gateway,
// an HTTPRoute to the enforcer's Service (the proxy), and an HTTPRoute to the application's
// Service with a ForwardAuth Middleware on the check API. There is no cluster DNS here, so the
// Middleware's address is a pod's check port rather than the Service's name.
const gatewayManifests = `
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {name: traefik}
spec: {controllerName: traefik.io/gateway-controller}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: web, namespace: {{ns}}}
spec:
  gatewayClassName: traefik
  listeners:
    - {name: web, protocol: HTTP, port: {{port}}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: public-api, namespace: {{ns}}}
spec:
  parentRefs: [{name: web}]
  rules:
    - matches: [{path: {type: PathPrefix, value: /proxy}}]
      backendRefs: [{name: sluice-public-api, port: 8080}]
---
apiVersion: traefik.io/v1alpha1
kind: Middleware
metadata: {name: sluice, namespace: {{ns}}}
spec:
  forwardAuth:
    address: {{check}}/forward-auth
    authResponseHeaders: [RateLimit-Policy, RateLimit, Retry-After]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: public-api-auth, namespace: {{ns}}}
spec:
  parentRefs: [{name: web}]
  rules:
    - matches: [{path: {type: PathPrefix, value: /auth}}]
      filters:
        - type: ExtensionRef
          extensionRef: {group: traefik.io, kind: Middleware, name: sluice}
      backendRefs: [{name: public-api, port: 8080}]
---
apiVersion: traefik.io/v1alpha1
kind: Middleware
metadata: {name: sluice-pool, namespace: {{ns}}}
spec:
  forwardAuth:
    address: {{pool}}/policies/{{ns}}/pooled-api/forward-auth
    authResponseHeaders: [RateLimit-Policy, RateLimit, Retry-After]
---
apiVersion: traefik.io/v1alpha1
kind: Middleware
metadata: {name: sluice-pool-typo, namespace: {{ns}}}
spec:
  forwardAuth:
    address: {{pool}}/policies/{{ns}}/pooled-apj/forward-auth
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: public-api-pool, namespace: {{ns}}}
spec:
  parentRefs: [{name: web}]
  rules:
    - matches: [{path: {type: PathPrefix, value: /pooled}}]
      filters:
        - type: ExtensionRef
          extensionRef: {group: traefik.io, kind: Middleware, name: sluice-pool}
      backendRefs: [{name: public-api, port: 8080}]
    - matches: [{path: {type: PathPrefix, value: /typo}}]
      filters:
        - type: ExtensionRef
          extensionRef: {group: traefik.io, kind: Middleware, name: sluice-pool-typo}
      backendRefs: [{name: public-api, port: 8080}]
`

func TestTraefikWhenGatewayAPIRoutesThroughSluiceThenRefusalsReachClientsAs429(t *testing.T) {
	tier.Needs(t, "the test control plane, the built binaries and Traefik")
	ctx := context.Background()
	env, err := testenv.Start(testenv.WithWebhooks(), testenv.WithControllers("endpointslice-controller"),
		testenv.WithAdvertiseAddress(local.PodNetwork.Addr().Next().String()),
		testenv.WithCRDsFrom(filepath.Join(os.Getenv(gatewayAPIDirEnv), "config", "crd", "standard"),
			filepath.Join(os.Getenv(traefikDirEnv), "docs", "content", "reference", "dynamic-configuration", "kubernetes-crd-definition-v1.yml")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	k8s := env.Client
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig); err != nil {
		t.Fatal(err)
	}
	managerBin, enforcerBin, err := local.Build(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	logs := &local.Output{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("manager, enforcer and Traefik output:\n%s", logs.String())
		}
	})
	mgr, err := local.StartManager(ctx, env, managerBin, kubeconfig, logs, "--enforcer-image=sluice-enforcer:gateway", "--report-interval=500ms")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mgr.Stop)
	redis := redistest.NewServer(t)

	// The application: it records the headers of every request it serves, and runs at an address
	// of the pod network, behind a Service whose EndpointSlice names it (a Service without a
	// selector, as for a backend outside the cluster's pods).
	up := newUpstream(t)
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "gateway-"}}
	if err := k8s.Create(ctx, ns); err != nil {
		t.Fatal(err)
	}
	kubelet, err := local.StartKubelet(ctx, k8s, env.Config, enforcerBin, local.KubeletOptions{
		Namespace: ns.Name, Upstream: up.url, Dir: t.TempDir(), Log: logs, PodNetwork: local.PodNetwork})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kubelet.Stop)
	for _, o := range []client.Object{
		&corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: "public-api"},
			Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 8080, TargetPort: intstr.FromInt32(up.port)}}}},
		&discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Namespace: ns.Name, Name: "public-api", Labels: map[string]string{discoveryv1.LabelServiceName: "public-api"}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{up.ip}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
			Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To(up.port)}},
		},
	} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}

	byClient := []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("X-Client")}}
	prefix := func(p string) *v1alpha1.Match {
		return &v1alpha1.Match{Path: &v1alpha1.PathMatch{Type: v1alpha1.PathMatchPrefix, Value: p}}
	}
	policy := &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: "public-api"},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "public-api", Port: 8080},
			Rules: []v1alpha1.Rule{
				{Name: "proxied", Match: prefix("/proxy"), Key: byClient, FailureMode: v1alpha1.FailClosed,
					FixedWindow: &v1alpha1.Window{Limit: 4, Window: "1h"}},
				{Name: "checked", Match: prefix("/auth"), Key: byClient, FailureMode: v1alpha1.FailClosed,
					FixedWindow: &v1alpha1.Window{Limit: 3, Window: "1h"}},
			},
			Storage: &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redis.Addr())}}},
		},
	}
	// A pool of two enforcers beside the policy's own, and a policy that joins it: Traefik asks
	// the pool's check API for it by path.
	pool := &v1alpha1.EnforcerPool{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: "shared"},
		Spec: v1alpha1.EnforcerPoolSpec{Replicas: ptr.To[int32](2),
			Storage: &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redis.Addr())}}}},
	}
	pooledPolicy := &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: "pooled-api"},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "pooled-api", Port: 8080},
			Rules:     []v1alpha1.Rule{{Name: "pooled", Match: prefix("/pooled"), Key: byClient, FixedWindow: &v1alpha1.Window{Limit: 2, Window: "1h"}}},
			Enforcer:  &v1alpha1.EnforcerSpec{PoolRef: &v1alpha1.PoolRef{Name: "shared"}},
		},
	}
	pooledService := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: "pooled-api"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 8080, TargetPort: intstr.FromInt32(up.port)}}}}
	for _, o := range []client.Object{policy, pool, pooledService, pooledPolicy} {
		if err := k8s.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	created := time.Now()
	poll.WaitFor(t, 90*time.Second, func() error {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(policy), policy); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(policy.Status.Conditions, v1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("policy not Ready: %+v", c)
		}
		return nil
	})
	t.Logf("policy Ready %v after it was created", time.Since(created).Round(time.Millisecond))
	poll.WaitFor(t, 90*time.Second, func() error {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(pooledPolicy), pooledPolicy); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(pooledPolicy.Status.Conditions, v1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("pooled policy not Ready: %+v", c)
		}
		return nil
	})
	var poolPods corev1.PodList
	if err := k8s.List(ctx, &poolPods, client.InNamespace(ns.Name), client.MatchingLabels(render.PoolPodLabels(pool))); err != nil || len(poolPods.Items) != 2 {
		t.Fatalf("pool pods: %d, %v; want 2", len(poolPods.Items), err)
	}
	pods, err := local.EnforcerPods(ctx, k8s, ns.Name, "public-api")
	if err != nil || len(pods) != 2 {
		t.Fatalf("enforcer pods: %d, %v; want 2", len(pods), err)
	}
	// The EndpointSlice controller has written both pods' addresses, ready, for the enforcer's Service.
	poll.WaitFor(t, 30*time.Second, func() error {
		var slices discoveryv1.EndpointSliceList
		if err := k8s.List(ctx, &slices, client.InNamespace(ns.Name), client.MatchingLabels{discoveryv1.LabelServiceName: "sluice-public-api"}); err != nil {
			return err
		}
		ready := map[string]bool{}
		for _, s := range slices.Items {
			for _, e := range s.Endpoints {
				if ptr.Deref(e.Conditions.Ready, false) {
					ready[e.Addresses[0]] = true
				}
			}
		}
		for _, p := range pods {
			if !ready[p.Status.PodIP] {
				return fmt.Errorf("EndpointSlices of sluice-public-api have %v ready, not pod %s at %s", ready, p.Name, p.Status.PodIP)
			}
		}
		return nil
	})

	web, err := local.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(web)
	applyYAML(t, k8s, strings.NewReplacer("{{ns}}", ns.Name, "{{port}}", port, "{{check}}", local.PodURL(&pods[0], "check"),
		"{{pool}}", local.PodURL(&poolPods.Items[0], "check")).Replace(gatewayManifests))
	started := time.Now()
	startTraefik(t, kubeconfig, web, logs)
	for _, route := range []string{"public-api", "public-api-auth", "public-api-pool"} {
		waitRouteAccepted(t, k8s, ns.Name, route)
	}
	gateway := "http://" + web
	// Traefik loads routes a moment after it reports them: wait until each answers a client of
	// its own, from the application.
	for _, path := range []string{"/proxy/ready", "/auth/ready"} {
		poll.WaitFor(t, 30*time.Second, func() error {
			r, err := tryGet(gateway+path, "ready"+path)
			if err != nil {
				return err
			}
			if r.status != http.StatusOK || r.body != "ok" {
				return fmt.Errorf("GET %s through Traefik: %d %q", path, r.status, r.body)
			}
			return nil
		})
	}

	t.Logf("Traefik started and both routes answered within %v", time.Since(started).Round(time.Millisecond))

	t.Run("when routed to the enforcer's Service then requests reach the application through both pods and refusals are 429 with every field", func(t *testing.T) {
		before, decidedBefore := up.count(), map[string]uint64{}
		for _, pod := range pods {
			decidedBefore[pod.Name] = decided(t, &pod, "proxied")
		}
		for i := range 4 {
			r := get(t, gateway+"/proxy/a", "alice")
			if r.status != http.StatusOK || r.body != "ok" {
				t.Fatalf("request %d: %d %q, want 200 from the application", i, r.status, r.body)
			}
			if r.header.Get("RateLimit") == "" || r.header.Get("RateLimit-Policy") == "" {
				t.Errorf("request %d: an allowed response without RateLimit fields: %v", i, r.header)
			}
		}
		requireRefusal(t, get(t, gateway+"/proxy/a", "alice"), "proxied")
		if got := up.count() - before; got != 4 {
			t.Errorf("the application served %d requests, want the 4 allowed", got)
		}
		// Traefik balanced over the EndpointSlices' addresses: each enforcer pod decided some.
		for _, pod := range pods {
			if n := decided(t, &pod, "proxied") - decidedBefore[pod.Name]; n == 0 {
				t.Errorf("pod %s decided no request of the proxied rule; Traefik did not route to it", pod.Name)
			}
		}
	})

	t.Run("when a ForwardAuth Middleware asks the check API then allowed requests pass and refusals are 429 with every field", func(t *testing.T) {
		before := up.count()
		for i := range 3 {
			r := get(t, gateway+"/auth/a", "bob")
			if r.status != http.StatusOK || r.body != "ok" {
				t.Fatalf("request %d: %d %q, want 200 from the application", i, r.status, r.body)
			}
			// authResponseHeaders copies the fields into the application's request; the
			// client's response does not carry them.
			got := up.last()
			if got.Get("RateLimit") == "" || got.Get("RateLimit-Policy") == "" {
				t.Errorf("request %d: the application's request has no RateLimit fields: %v", i, got)
			}
			if r.header.Get("RateLimit") != "" || r.header.Get("RateLimit-Policy") != "" {
				t.Errorf("request %d: the client's response carries RateLimit fields %q %q; docs/enforcer.md says ForwardAuth does not give them",
					i, r.header.Get("RateLimit"), r.header.Get("RateLimit-Policy"))
			}
		}
		requireRefusal(t, get(t, gateway+"/auth/a", "bob"), "checked")
		if got := up.count() - before; got != 3 {
			t.Errorf("the application served %d requests, want the 3 allowed", got)
		}
	})

	t.Run("when a ForwardAuth Middleware asks a pool by the policy's path then its limit holds, and a path of no policy served lets nothing through", func(t *testing.T) {
		before := up.count()
		for i := range 2 {
			if r := get(t, gateway+"/pooled/a", "dave"); r.status != http.StatusOK || r.body != "ok" {
				t.Fatalf("request %d: %d %q, want 200 from the application", i, r.status, r.body)
			}
			if got := up.last(); got.Get("RateLimit-Policy") == "" {
				t.Errorf("request %d: the application's request has no RateLimit-Policy: %v", i, got)
			}
		}
		requireRefusal(t, get(t, gateway+"/pooled/a", "dave"), "pooled")
		r := get(t, gateway+"/typo/a", "erin")
		if r.status != http.StatusNotFound || !strings.Contains(r.body, `is not served here`) {
			t.Errorf("a Middleware naming a policy the pool does not serve: %d %q, want its 404 passed on", r.status, r.body)
		}
		if got := up.count() - before; got != 2 {
			t.Errorf("the application served %d requests, want the 2 allowed", got)
		}
	})

	t.Run("when Redis is down then fail-closed rules answer 503 through Traefik on both routes", func(t *testing.T) {
		redis.Kill()
		before := up.count()
		for _, path := range []string{"/auth/b", "/proxy/b"} {
			r := get(t, gateway+path, "carol")
			if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") != "1" ||
				r.header.Get("Content-Type") != "application/problem+json" || !strings.Contains(r.body, "store-unavailable") {
				t.Errorf("GET %s: %d, Retry-After %q; want 503 with Retry-After 1 and the problem document: %v %s",
					path, r.status, r.header.Get("Retry-After"), r.header, r.body)
			}
		}
		if got := up.count() - before; got != 0 {
			t.Errorf("the application served %d requests while the fail-closed rules could not decide", got)
		}
	})
}

// requireRefusal checks a refusal as the proxy and the check API give it: 429, Retry-After, both
// RateLimit fields, and the problem document naming the rule.
func requireRefusal(t *testing.T, r answer, rule string) {
	t.Helper()
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("status %d %q, want 429", r.status, r.body)
	}
	for _, f := range []string{"Retry-After", "RateLimit", "RateLimit-Policy"} {
		if r.header.Get(f) == "" {
			t.Errorf("429 without %s: %v", f, r.header)
		}
	}
	if !strings.HasPrefix(r.header.Get("RateLimit"), `"`+rule+`";r=0;`) {
		t.Errorf("RateLimit %q, want rule %s with nothing left", r.header.Get("RateLimit"), rule)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("Content-Type %q, want application/problem+json", ct)
	}
	var problem struct {
		Status     int    `json:"status"`
		Rule       string `json:"rule"`
		RetryAfter int    `json:"retryAfter"`
	}
	if err := json.Unmarshal([]byte(r.body), &problem); err != nil || problem.Status != 429 || problem.Rule != rule || problem.RetryAfter < 1 {
		t.Errorf("body %q (%v), want the problem document of rule %s", r.body, err, rule)
	}
}

// decided is how many requests of a rule a pod has decided, by its report.
func decided(t *testing.T, pod *corev1.Pod, rule string) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := controllers.FetchReport(http.DefaultClient)(ctx, pod)
	if err != nil {
		t.Fatal(err)
	}
	for _, rr := range r.Rules {
		if rr.Name == rule {
			return rr.Allowed + rr.Limited + rr.FailedClosed + rr.FailedOpen
		}
	}
	return 0
}

// startTraefik runs Traefik with traefikConfig, its entry point at web, until the test ends.
func startTraefik(t *testing.T, kubeconfig, web string, logs io.Writer) {
	t.Helper()
	bin, err := local.Tool("traefik")
	if err != nil {
		t.Fatal(err)
	}
	ping, err := local.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(t.TempDir(), "traefik.yaml")
	if err := os.WriteFile(cfg, []byte(strings.NewReplacer("{{web}}", web, "{{ping}}", ping).Replace(traefikConfig)), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := local.StartWithEnv("traefik", logs, []string{"KUBECONFIG=" + kubeconfig}, bin, "--configFile="+cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	if err := local.WaitHTTP(p, "http://"+ping+"/ping", 60*time.Second); err != nil {
		t.Fatal(err)
	}
}

// applyYAML creates every object of a multi-document manifest.
func applyYAML(t *testing.T, k8s client.Client, manifests string) {
	t.Helper()
	dec := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(manifests), 4096)
	for {
		var o unstructured.Unstructured
		if err := dec.Decode(&o.Object); errors.Is(err, io.EOF) {
			return
		} else if err != nil {
			t.Fatal(err)
		}
		if len(o.Object) == 0 {
			continue
		}
		if err := k8s.Create(context.Background(), &o); err != nil {
			t.Fatalf("create %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
}

// waitRouteAccepted waits until Traefik has accepted an HTTPRoute and resolved its references,
// as its status says.
func waitRouteAccepted(t *testing.T, k8s client.Client, namespace, name string) {
	t.Helper()
	poll.WaitFor(t, 60*time.Second, func() error {
		var route unstructured.Unstructured
		route.SetAPIVersion("gateway.networking.k8s.io/v1")
		route.SetKind("HTTPRoute")
		if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: namespace, Name: name}, &route); err != nil {
			return err
		}
		parents, _, _ := unstructured.NestedSlice(route.Object, "status", "parents")
		for _, p := range parents {
			conds, _, _ := unstructured.NestedSlice(p.(map[string]any), "conditions")
			ok := 0
			for _, c := range conds {
				c := c.(map[string]any)
				if (c["type"] == "Accepted" || c["type"] == "ResolvedRefs") && c["status"] == "True" {
					ok++
				}
			}
			if ok == 2 {
				return nil
			}
		}
		return fmt.Errorf("HTTPRoute %s not Accepted with ResolvedRefs: %v", name, parents)
	})
}

// upstream is the application: it answers "ok" and keeps the header of the last request.
type upstream struct {
	ip, url string
	port    int32
	mu      sync.Mutex
	n       int
	header  http.Header
}

func newUpstream(t *testing.T) *upstream {
	t.Helper()
	ip := local.PodNetwork.Addr().Next().Next().String()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	u := &upstream{ip: ip, port: int32(l.Addr().(*net.TCPAddr).Port)}
	u.url = "http://" + l.Addr().String()
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		u.n++
		u.header = r.Header.Clone()
		u.mu.Unlock()
		_, _ = w.Write([]byte("ok"))
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	return u
}

func (u *upstream) count() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.n
}

func (u *upstream) last() http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.header
}

type answer struct {
	status int
	header http.Header
	body   string
}

// get sends GET url as client (X-Client).
func get(t *testing.T, url, clientKey string) answer {
	t.Helper()
	r, err := tryGet(url, clientKey)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func tryGet(url, clientKey string) (answer, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("X-Client", clientKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer func() { _ = resp.Body.Close() }()
	var body bytes.Buffer
	_, _ = io.Copy(&body, io.LimitReader(resp.Body, 1<<16))
	return answer{resp.StatusCode, resp.Header, strings.TrimSpace(body.String())}, nil
}
