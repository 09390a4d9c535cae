// Package chart_test checks the Helm chart with the tools its users run: the real helm (lint,
// template, install, upgrade, uninstall) against the real API server, with the real CRDs of
// cert-manager and the Prometheus Operator for the objects of theirs the chart makes.
package chart_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// The versions of the third-party CRDs the chart's objects are checked against: the newest
// releases the module proxy serves. cert-manager ships its CRDs in its module; the Prometheus
// Operator's are generated from its API types with controller-gen, as its own build does.
const (
	certManagerModule = "github.com/cert-manager/cert-manager@v1.19.1"
	monitoringModule  = "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring@v0.95.2"
)

const namespace = "sluice-system"

var (
	env        *testenv.Env
	k8s        client.Client
	helm       string
	kubeconfig string
)

func TestMain(m *testing.M) {
	flag.Parse()
	tier.RunFast(m)
	os.Exit(run(m))
}

func run(m *testing.M) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var err error
	if helm, err = local.Tool("helm"); err != nil {
		return fail(err)
	}
	// No CRDs: the chart installs Sluice's.
	if env, err = testenv.Start(testenv.WithoutCRDs()); err != nil {
		return fail(err)
	}
	defer func() { _ = env.Stop() }()
	dir, err := os.MkdirTemp("", "sluice-chart-")
	if err != nil {
		return fail(err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	kubeconfig = filepath.Join(dir, "kubeconfig")
	if err := env.WriteKubeconfig(kubeconfig); err != nil {
		return fail(err)
	}
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = apiextensionsv1.AddToScheme(scheme)
	_ = v1alpha1.AddToScheme(scheme)
	if k8s, err = client.New(env.Config, client.Options{Scheme: scheme}); err != nil {
		return fail(err)
	}
	if err := installThirdPartyCRDs(dir); err != nil {
		return fail(err)
	}
	return m.Run()
}

// installThirdPartyCRDs installs cert-manager's and the Prometheus Operator's CRDs.
func installThirdPartyCRDs(dir string) error {
	cm, err := moduleDir(certManagerModule)
	if err != nil {
		return err
	}
	mon, err := moduleDir(monitoringModule)
	if err != nil {
		return err
	}
	gen := filepath.Join(dir, "monitoring-crds")
	cmd := exec.Command("go", "tool", "-modfile="+filepath.Join(testenv.RepoRoot(), "hack", "tools", "go.mod"),
		"controller-gen", "crd:allowDangerousTypes=true", "paths=./v1", "output:crd:dir="+gen)
	cmd.Dir = mon
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("generate the Prometheus Operator's CRDs: %w: %s", err, out)
	}
	_, err = envtest.InstallCRDs(env.Config, envtest.CRDInstallOptions{
		Paths:              []string{filepath.Join(cm, "deploy", "crds"), gen},
		ErrorIfPathMissing: true,
	})
	return err
}

// moduleDir downloads a module through the Go module proxy and returns its directory.
func moduleDir(module string) (string, error) {
	out, err := exec.Command("go", "mod", "download", "-json", module).Output()
	if err != nil {
		return "", fmt.Errorf("go mod download %s: %w", module, err)
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal(out, &m); err != nil {
		return "", fmt.Errorf("go mod download %s: %w", module, err)
	}
	if m.Error != "" {
		return "", fmt.Errorf("go mod download %s: %s", module, m.Error)
	}
	return m.Dir, nil
}

// Value sets every test renders: the defaults, cert-manager, and everything on.
var valueSets = map[string][]string{
	"defaults":     nil,
	"cert-manager": {"--set", "webhook.certManager.enabled=true"},
	"everything": {"--set", "webhook.certManager.enabled=true,serviceMonitor.enabled=true,prometheusRule.enabled=true,dashboard.enabled=true",
		"--set", "manager.replicas=2,manager.logLevel=debug", "--set-json", "prometheusRule.refusedShareThreshold=0.25",
		"--set-json", `manager.nodeSelector={"kubernetes.io/os":"linux"}`,
		"--set-json", `webhook.certManager.issuerRef={"kind":"ClusterIssuer","name":"corp-ca"}`},
	"pool": {"--set", "defaultPool.enabled=true,defaultPool.allowedPolicies.from=Selector", "--set-json",
		`defaultPool.allowedPolicies.selector={"matchLabels":{"sluice-pool":"default"}}`, "--set-json", `defaultPool.storage={"redis":{"addresses":["redis:6379"]}}`},
}

// runHelm runs helm with args and returns its stdout, or its stderr as the error.
func runHelm(args ...string) (string, error) {
	cmd := exec.Command(helm, append(args, "--kubeconfig", kubeconfig)...)
	cmd.Dir = testenv.RepoRoot()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %w\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String(), nil
}

// render is `helm template` of the chart into sluice-system.
func render(t *testing.T, values ...string) []*unstructured.Unstructured {
	t.Helper()
	out, err := runHelm(append([]string{"template", "sluice", "charts/sluice", "--namespace", namespace}, values...)...)
	if err != nil {
		t.Fatal(err)
	}
	return decode(t, []byte(out))
}

func decode(t *testing.T, data []byte) []*unstructured.Unstructured {
	t.Helper()
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var objs []*unstructured.Unstructured
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return objs
			}
			t.Fatal(err)
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
}

func TestChartWhenLintedStrictlyThenHelmFindsNothing(t *testing.T) {
	tier.Needs(t, "helm and the test control plane")
	for name, values := range valueSets {
		t.Run(name, func(t *testing.T) {
			out, err := runHelm(append([]string{"lint", "--strict", "charts/sluice"}, values...)...)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out, "1 chart(s) linted, 0 chart(s) failed") || strings.Contains(out, "[WARNING]") {
				t.Errorf("helm lint --strict:\n%s", out)
			}
		})
	}
}

// Every object the chart renders, in every value set, is accepted by the API server with the
// real schemas (server-side apply, dry run), cert-manager's and the Prometheus Operator's kinds
// included; Sluice's own CRD is applied for real first, as Helm would.
func TestChartWhenRenderedThenTheAPIServerAcceptsEveryObject(t *testing.T) {
	tier.Needs(t, "helm and the test control plane")
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "sluice-render"}}
	if err := k8s.Create(ctx, ns); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for name, values := range valueSets {
		t.Run(name, func(t *testing.T) {
			out, err := runHelm(append([]string{"template", "sluice", "charts/sluice", "--namespace", ns.Name}, values...)...)
			if err != nil {
				t.Fatal(err)
			}
			kinds := map[string]int{}
			objs := decode(t, []byte(out))
			// The CRDs for real, as Helm installs them before what they define, and gone again
			// after, for the installs of the tests below, which Helm would not let adopt them.
			t.Cleanup(func() { removeCRDs(t) })
			for _, u := range objs {
				if u.GetKind() == "CustomResourceDefinition" {
					if err := k8s.Patch(ctx, u.DeepCopy(), client.Apply, client.FieldOwner("chart-test"), client.ForceOwnership); err != nil { //nolint:staticcheck // unstructured apply
						t.Fatalf("CRD %s: %v", u.GetName(), err)
					}
					waitEstablishedNamed(t, u.GetName(), &apiextensionsv1.CustomResourceDefinition{})
				}
			}
			for _, u := range objs {
				kinds[u.GetKind()]++
				if storage, _, _ := unstructured.NestedMap(u.Object, "spec", "storage"); u.GetKind() == "EnforcerPool" && !jsonEqual(storage, map[string]any{"redis": map[string]any{"addresses": []any{"redis:6379"}}}) {
					t.Errorf("the pool's storage %v, want the values' redis alone", storage)
				}
				if u.GetNamespace() == "" && u.GetKind() != "CustomResourceDefinition" && u.GetKind() != "ClusterRole" &&
					u.GetKind() != "ClusterRoleBinding" && u.GetKind() != "ValidatingWebhookConfiguration" {
					t.Errorf("%s %s has no namespace", u.GetKind(), u.GetName())
				}
				if err := k8s.Patch(ctx, u, client.Apply, client.FieldOwner("chart-test"), client.DryRunAll, client.ForceOwnership); err != nil { //nolint:staticcheck // unstructured apply
					t.Errorf("%s %s: %v", u.GetKind(), u.GetName(), err)
				}
			}
			// ClusterRoles: the manager's, and the users' editor and viewer of policies and of pools.
			want := map[string]int{"CustomResourceDefinition": 2, "Deployment": 1, "ClusterRole": 5, "Role": 2, "ValidatingWebhookConfiguration": 1}
			if name != "defaults" && name != "pool" {
				want["Certificate"] = 1
			}
			if name == "pool" {
				want["EnforcerPool"] = 1
			}
			if name == "everything" {
				want["ServiceMonitor"], want["PodMonitor"], want["PrometheusRule"], want["ConfigMap"] = 1, 1, 1, 1
			}
			for k, n := range want {
				if kinds[k] != n {
					t.Errorf("%d %s, want %d (all: %v)", kinds[k], k, n, kinds)
				}
			}
			if kinds["MutatingWebhookConfiguration"] > 0 {
				t.Error("the chart installs a MutatingWebhookConfiguration: the spec must stay as the user wrote it")
			}
		})
	}
}

func TestChartWhenAValueIsWrongThenHelmRefusesItNamingTheValue(t *testing.T) {
	tier.Needs(t, "helm and the test control plane")
	for _, c := range []struct {
		values []string
		want   string
	}{
		{[]string{"--set", "manager.replicas=0"}, "/manager/replicas"},
		{[]string{"--set", "manager.logLevel=verbose"}, "/manager/logLevel"},
		{[]string{"--set", "manager.imag.tag=v1"}, "imag"},
		{[]string{"--set", "manager.reportInterval=often"}, "/manager/reportInterval"},
		{[]string{"--set", "manager.extraArgs[0]=kube-api-qps=100"}, "/manager/extraArgs/0"},
		{[]string{"--set-json", "prometheusRule.refusedShareThreshold=2"}, "/prometheusRule/refusedShareThreshold"},
		{[]string{"--set", "webhook.certManager.issuerRef.kind=Vault"}, "/webhook/certManager/issuerRef/kind"},
		{[]string{"--set", "enforcer.image.repository="}, "/enforcer/image/repository"},
		{[]string{"--set", "enforcer.image=registry.example/sluice-enforcer:v1"}, "/enforcer/image"},
		{[]string{"--set", "enforcer.networkPolicy.checkNamespaces={Traefik}"}, "/enforcer/networkPolicy/checkNamespaces/0"},
		{[]string{"--set", "enforcer.networkPolicy.monitoringNamespaces={" + strings.Repeat("a", 64) + "}"}, "/enforcer/networkPolicy/monitoringNamespaces/0"},
		{[]string{"--set", "enforcer.networkPolicy.proxyNamespaces={edge,edge}"}, "/enforcer/networkPolicy/proxyNamespaces"},
		{[]string{"--set", "defaultPool.replicas=0"}, "/defaultPool/replicas"},
		{[]string{"--set", "defaultPool.allowedPolicies.from=Any"}, "/defaultPool/allowedPolicies/from"},
		{[]string{"--set", "defaultPool.name=Default_Pool"}, "/defaultPool/name"},
		{[]string{"--set-json", `defaultPool.storage={"memory":{},"redis":{}}`}, "/defaultPool/storage"},
	} {
		_, err := runHelm(append([]string{"template", "sluice", "charts/sluice"}, c.values...)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("helm template %v: %v; want a refusal naming %s", c.values, err, c.want)
		}
	}
}

// The chart's NetworkPolicy values reach the manager as its flags; a 63-character namespace, at
// the bound, is taken.
func TestChartWhenNetworkPolicyValuesAreSetThenTheManagerGetsThemAsFlags(t *testing.T) {
	tier.Needs(t, "helm and the test control plane")
	long := strings.Repeat("a", 63)
	for _, c := range []struct {
		name   string
		values []string
		want   []string
	}{
		{"when nothing is set then every enforcer gets a NetworkPolicy with the release's namespace alone", nil,
			[]string{"--enforcer-network-policy=true", "--monitoring-namespaces=", "--check-namespaces=", "--proxy-namespaces="}},
		{"when lists are set then they are joined", []string{"--set", "enforcer.networkPolicy.monitoringNamespaces={monitoring," + long + "}",
			"--set", "enforcer.networkPolicy.checkNamespaces={traefik,envoy-gateway-system}", "--set", "enforcer.networkPolicy.proxyNamespaces={edge}"},
			[]string{"--monitoring-namespaces=monitoring," + long, "--check-namespaces=traefik,envoy-gateway-system", "--proxy-namespaces=edge"}},
		{"when disabled then the manager is told so", []string{"--set", "enforcer.networkPolicy.enabled=false"}, []string{"--enforcer-network-policy=false"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var args []string
			for _, u := range render(t, c.values...) {
				if u.GetKind() == "Deployment" {
					containers, _, _ := unstructured.NestedSlice(u.Object, "spec", "template", "spec", "containers")
					a, _, _ := unstructured.NestedStringSlice(containers[0].(map[string]any), "args")
					args = append(args, a...)
				}
			}
			for _, w := range c.want {
				if !slices.Contains(args, w) {
					t.Errorf("manager args %q lack %q", args, w)
				}
			}
		})
	}
}

// The chart installs config/'s objects: the CRD, the manager's RBAC rules and the webhook
// configuration that controller-gen generates, the alerts and the dashboard. Rendered side by
// side, they must not differ.
func TestChartWhenRenderedBesideConfigThenTheGeneratedObjectsAreTheSame(t *testing.T) {
	tier.Needs(t, "helm and the test control plane")
	chart := byKindName(render(t, "--set", "serviceMonitor.enabled=true,prometheusRule.enabled=true,dashboard.enabled=true"))
	kustomized := byKindName(kustomize(t, "config/default"))
	for k, v := range byKindName(kustomize(t, "config/prometheus")) {
		kustomized[k] = v
	}
	compared := 0
	for key, want := range kustomized {
		got, ok := chart[key]
		kind := want.GetKind()
		if !ok {
			if kind != "Namespace" {
				t.Errorf("the chart has no %s, which config/ installs", key)
			}
			continue
		}
		var field string
		switch kind {
		case "CustomResourceDefinition", "Service", "ServiceMonitor", "PodMonitor", "PrometheusRule":
			field = "spec"
		case "ClusterRole", "Role":
			field = "rules"
		case "ValidatingWebhookConfiguration":
			field = "webhooks"
		case "ClusterRoleBinding", "RoleBinding":
			field = "roleRef"
		default:
			continue
		}
		compared++
		if !jsonEqual(got.Object[field], want.Object[field]) {
			t.Errorf("%s: the chart's %s differs from config/'s:\nchart:  %s\nconfig: %s", key, field, mustJSON(got.Object[field]), mustJSON(want.Object[field]))
		}
		// A ClusterRole's aggregation labels decide which built-in roles grant it.
		if g, w := aggregationLabels(got), aggregationLabels(want); kind == "ClusterRole" && !jsonEqual(g, w) {
			t.Errorf("%s: the chart's aggregation labels %v differ from config/'s %v", key, g, w)
		}
	}
	if compared < 12 {
		t.Errorf("compared %d objects; the comparison lost its objects", compared)
	}
	dashboard, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "grafana", "sluice.json"))
	if err != nil {
		t.Fatal(err)
	}
	cm := chart["ConfigMap/sluice-dashboard"]
	if cm == nil {
		t.Fatal("no dashboard ConfigMap")
	}
	if got, _, _ := unstructured.NestedString(cm.Object, "data", "sluice.json"); strings.TrimSpace(got) != strings.TrimSpace(string(dashboard)) {
		t.Error("the chart's dashboard differs from config/grafana/sluice.json")
	}
}

// aggregationLabels are an object's rbac.authorization.k8s.io/aggregate-to-* labels.
func aggregationLabels(u *unstructured.Unstructured) map[string]string {
	m := map[string]string{}
	for k, v := range u.GetLabels() {
		if strings.HasPrefix(k, "rbac.authorization.k8s.io/aggregate-to-") {
			m[k] = v
		}
	}
	return m
}

func byKindName(objs []*unstructured.Unstructured) map[string]*unstructured.Unstructured {
	m := map[string]*unstructured.Unstructured{}
	for _, u := range objs {
		m[u.GetKind()+"/"+u.GetName()] = u
	}
	return m
}

func kustomize(t *testing.T, overlay string) []*unstructured.Unstructured {
	t.Helper()
	cmd := exec.Command("go", "tool", "-modfile=hack/tools/go.mod", "kustomize", "build", overlay)
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kustomize build %s: %v", overlay, err)
	}
	return decode(t, out)
}

func jsonEqual(a, b any) bool { return mustJSON(a) == mustJSON(b) }

func mustJSON(v any) string {
	b, _ := json.Marshal(v) // maps from YAML: cannot fail
	return string(b)
}

// A real helm install, upgrade and uninstall against the API server: the upgrade changes the
// manager and keeps the CRD (the same object) and a policy; the uninstall removes the manager
// and keeps both.
func TestChartWhenInstalledUpgradedAndUninstalledThenTheCRDAndPoliciesStay(t *testing.T) {
	tier.Needs(t, "helm and the test control plane")
	ctx := context.Background()
	const release, ns = "sluice", "sluice-helm"
	// README's install and upgrade commands, in a namespace of the test's own: the manager's
	// image tagged the chart's appVersion, the enforcer's from another registry.
	managerImage, enforcerImage := "ghcr.io/sluice-dev/sluice-manager:"+chartAppVersion(t), "registry.example/sluice-enforcer:"+chartAppVersion(t)
	removeCRDs(t)
	installed, err := runHelm("install", release, "charts/sluice", "--namespace", ns, "--create-namespace",
		"--set", "enforcer.image.repository=registry.example/sluice-enforcer")
	if err != nil {
		t.Fatal(err)
	}
	notes := notesCommands(t, installed, ns)
	crd := &apiextensionsv1.CustomResourceDefinition{}
	waitEstablished(t, crd)
	// No manager runs here to answer the webhook: take its configuration away, as the test
	// cannot serve it, and create a policy.
	vwc := &unstructured.Unstructured{}
	vwc.SetAPIVersion("admissionregistration.k8s.io/v1")
	vwc.SetKind("ValidatingWebhookConfiguration")
	vwc.SetName("sluice-validating-webhook-configuration")
	if err := k8s.Delete(ctx, vwc); err != nil {
		t.Fatal(err)
	}
	app := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}
	if err := k8s.Create(ctx, app); err != nil {
		t.Fatal(err)
	}
	p := testenv.ReadObjects(t, filepath.Join(testenv.RepoRoot(), "config", "samples", "fixed-window.yaml"))[0]
	p.SetNamespace(app.Name)
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	// The NOTES' commands: the manager's rollout (no Deployment controller or kubelet runs here,
	// so the command can only be seen waiting, where a wrong name would be NotFound), then a
	// sample applied and listed.
	if out, _ := kubectl(notes["rollout"], "--timeout=1s"); !strings.Contains(out, "Waiting for deployment") {
		t.Errorf("NOTES' %v: %s; want it waiting for the manager's Deployment", notes["rollout"], out)
	}
	if out, err := kubectl(notes["apply"]); err != nil {
		t.Errorf("NOTES' %v: %v\n%s", notes["apply"], err, out)
	} else if out, err := kubectl(notes["get"]); err != nil || !strings.Contains(out, "public-api") {
		t.Errorf("NOTES' %v: %s %v; want the applied sample listed", notes["get"], out, err)
	}

	if _, err := runHelm("upgrade", release, "charts/sluice", "--namespace", ns, "--reuse-values", "--set", "manager.replicas=2,manager.logLevel=debug"); err != nil {
		t.Fatal(err)
	}
	after := &apiextensionsv1.CustomResourceDefinition{}
	waitEstablished(t, after)
	if after.UID != crd.UID {
		t.Errorf("the upgrade replaced the CRD (uid %s, was %s): every policy would have gone with it", after.UID, crd.UID)
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(p), p); err != nil {
		t.Errorf("the policy after the upgrade: %v", err)
	}
	dep := &unstructured.Unstructured{}
	dep.SetAPIVersion("apps/v1")
	dep.SetKind("Deployment")
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sluice-manager"}, dep); err != nil {
		t.Fatal(err)
	}
	replicas, _, _ := unstructured.NestedInt64(dep.Object, "spec", "replicas")
	containers, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
	if replicas != 2 || !strings.Contains(fmt.Sprint(containers), "--zap-log-level=debug") {
		t.Errorf("after the upgrade: %d replicas, containers %v; want 2 and debug logs", replicas, containers)
	}
	// --reuse-values kept what the install set.
	if c := fmt.Sprint(containers); !strings.Contains(c, "image:"+managerImage) || !strings.Contains(c, "--enforcer-image="+enforcerImage) {
		t.Errorf("after the upgrade: containers %v; want the installed images, %s and %s, kept", containers, managerImage, enforcerImage)
	}

	if _, err := runHelm("uninstall", release, "--namespace", ns); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sluice-manager"}, dep); !apierrors.IsNotFound(err) {
		t.Errorf("the manager after uninstall: %v, want gone", err)
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(after), after); err != nil || after.DeletionTimestamp != nil {
		t.Errorf("the CRD after uninstall: %v (deleting: %v), want kept", err, after.DeletionTimestamp)
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(p), p); err != nil || p.GetDeletionTimestamp() != nil {
		t.Errorf("the policy after uninstall: %v, want kept", err)
	}
	if names := releaseNames(t, ns); slices.Contains(names, release) {
		t.Errorf("helm still lists the release: %v", names)
	}
	// The NOTES say how to remove the CRD and every policy too.
	if _, err := kubectl(notes["delete"]); err != nil {
		t.Fatalf("NOTES' %v: %v", notes["delete"], err)
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(after), after); !apierrors.IsNotFound(err) && after.DeletionTimestamp == nil {
		t.Errorf("the CRD after the NOTES' delete: %v, want it gone or going", err)
	}
}

// README's `kubectl apply -k config/prometheus`, as a server-side dry run with the real kubectl
// against the Prometheus Operator's CRDs: the API server accepts every object.
func TestPrometheusKustomizationWhenAppliedWithKubectlThenTheAPIServerAcceptsEveryObject(t *testing.T) {
	tier.Needs(t, "the test control plane and kubectl")
	sys := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}
	if err := k8s.Create(context.Background(), sys); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	out, err := kubectl([]string{"apply", "-k", filepath.Join(testenv.RepoRoot(), "config", "prometheus"), "--dry-run=server"})
	if err != nil {
		t.Fatalf("kubectl apply -k config/prometheus: %v\n%s", err, out)
	}
	for _, want := range []string{"servicemonitor.monitoring.coreos.com/", "podmonitor.monitoring.coreos.com/", "prometheusrule.monitoring.coreos.com/"} {
		if !strings.Contains(out, want) {
			t.Errorf("kubectl applied no %s...:\n%s", want, out)
		}
	}
}

// notesCommands are the kubectl commands of the NOTES that helm install printed, by their verb
// (rollout, apply, get, delete), made runnable here: the namespace placeholder is the test's
// shop, a sample's URL is its file in this checkout, and get does not watch.
func notesCommands(t *testing.T, installed, ns string) map[string][]string {
	t.Helper()
	_, notes, ok := strings.Cut(installed, "NOTES:")
	if !ok {
		t.Fatalf("helm install printed no NOTES:\n%s", installed)
	}
	if !strings.Contains(notes, "port 8080, the proxy") || !strings.Contains(notes, "check API (port 8081)") {
		t.Errorf("NOTES do not give the proxy port 8080 and the check port 8081:\n%s", notes)
	}
	const samples = "https://raw.githubusercontent.com/sluice-dev/sluice/main/"
	cmds := map[string][]string{}
	for line := range strings.Lines(notes) {
		args := strings.Fields(line)
		if len(args) < 2 || args[0] != "kubectl" {
			continue
		}
		args = slices.DeleteFunc(args[1:], func(a string) bool { return a == "-w" })
		for i, a := range args {
			a = strings.ReplaceAll(a, "<namespace>", "shop")
			if rest, ok := strings.CutPrefix(a, samples); ok {
				a = filepath.Join(testenv.RepoRoot(), filepath.FromSlash(rest))
			}
			args[i] = a
		}
		verb := args[0]
		if verb == "-n" && len(args) > 2 {
			verb = args[2]
		}
		cmds[verb] = args
	}
	for _, verb := range []string{"rollout", "apply", "get", "delete"} {
		if cmds[verb] == nil {
			t.Fatalf("the NOTES have no kubectl %s; the test runs each of them:\n%s", verb, notes)
		}
	}
	if !slices.Contains(cmds["rollout"], ns) {
		t.Errorf("NOTES' %v: want the release namespace %s", cmds["rollout"], ns)
	}
	return cmds
}

// kubectl runs the real kubectl against the test control plane.
func kubectl(args []string, extra ...string) (string, error) {
	out, err := exec.Command(env.Kubectl(), append(append([]string{"--kubeconfig", kubeconfig}, args...), extra...)...).CombinedOutput()
	return string(out), err
}

func waitEstablished(t *testing.T, crd *apiextensionsv1.CustomResourceDefinition) {
	t.Helper()
	waitEstablishedNamed(t, "ratelimitpolicies.ratelimit.sluice.dev", crd)
}

func waitEstablishedNamed(t *testing.T, name string, crd *apiextensionsv1.CustomResourceDefinition) {
	t.Helper()
	poll.WaitFor(t, 30*time.Second, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKey{Name: name}, crd); err != nil {
			return err
		}
		for _, c := range crd.Status.Conditions {
			if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
				return nil
			}
		}
		return fmt.Errorf("the CRD %s is not established: %+v", name, crd.Status.Conditions)
	})
}

func releaseNames(t *testing.T, ns string) []string {
	t.Helper()
	out, err := runHelm("list", "--namespace", ns, "--short")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(out)
}

// Both installations run a highly available manager by default: two replicas with leader
// election, spread over nodes, and a PodDisruptionBudget that keeps one through a drain, so the
// webhook, whose failurePolicy is Fail, always has a replica to answer.
func TestChartAndConfigWhenRenderedByDefaultThenTheManagerIsHighlyAvailable(t *testing.T) {
	tier.Needs(t, "helm and the test control plane")
	for name, objs := range map[string][]*unstructured.Unstructured{"the chart": render(t), "config/default": kustomize(t, "config/default")} {
		t.Run(name, func(t *testing.T) {
			byKind := byKindName(objs)
			dep := byKind["Deployment/sluice-manager"]
			if dep == nil {
				t.Fatal("no Deployment sluice-manager")
			}
			replicas, _, _ := unstructured.NestedFieldNoCopy(dep.Object, "spec", "replicas")
			containers, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
			if fmt.Sprint(replicas) != "2" || !strings.Contains(fmt.Sprint(containers), "--leader-elect") {
				t.Errorf("%v replicas, containers %v; want 2 with --leader-elect", replicas, containers)
			}
			spread, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "topologySpreadConstraints")
			if !strings.Contains(fmt.Sprint(spread), "kubernetes.io/hostname") {
				t.Errorf("topologySpreadConstraints %v, want a spread over nodes", spread)
			}
			pdb := byKind["PodDisruptionBudget/sluice-manager"]
			if pdb == nil {
				t.Fatal("no PodDisruptionBudget sluice-manager")
			}
			if ns := pdb.GetNamespace(); ns != dep.GetNamespace() {
				t.Errorf("the budget is in namespace %q, the manager in %q", ns, dep.GetNamespace())
			}
			minAvailable, _, _ := unstructured.NestedFieldNoCopy(pdb.Object, "spec", "minAvailable")
			selector, _, _ := unstructured.NestedStringMap(pdb.Object, "spec", "selector", "matchLabels")
			podLabels, _, _ := unstructured.NestedStringMap(dep.Object, "spec", "template", "metadata", "labels")
			if fmt.Sprint(minAvailable) != "1" || len(selector) == 0 || !labels.SelectorFromSet(selector).Matches(labels.Set(podLabels)) {
				t.Errorf("budget minAvailable %v selecting %v, pods labelled %v; want 1 manager pod kept", minAvailable, selector, podLabels)
			}
		})
	}
	if _, ok := byKindName(render(t, "--set", "manager.replicas=1"))["PodDisruptionBudget/sluice-manager"]; ok {
		t.Error("with one replica the chart renders a budget that would block every drain")
	}
}

// With defaultPool.enabled, a real helm install creates the pool after the CRD (a hook after
// install), the API server accepts it, an upgrade changes it in place (the same object: its
// policies' configs, which it controls, stay), and an uninstall leaves it, as it leaves policies.
func TestChartWhenADefaultPoolIsEnabledThenInstallCreatesItAndUpgradeChangesItInPlace(t *testing.T) {
	tier.Needs(t, "helm and the test control plane")
	ctx := context.Background()
	const release, ns = "sluice-pool", "sluice-pool-helm"
	removeCRDs(t)
	installed, err := runHelm("install", release, "charts/sluice", "--namespace", ns, "--create-namespace", "--set", "defaultPool.enabled=true")
	if err != nil {
		t.Fatal(err)
	}
	if want := "the EnforcerPool default serves every policy\n   that joins it with spec.enforcer.poolRef {name: default, namespace: " + ns + "}"; !strings.Contains(installed, want) ||
		!strings.Contains(installed, "Service sluice-pool-default in "+ns) {
		t.Errorf("the NOTES do not say how to join and reach the default pool:\n%s", installed)
	}
	pool := &v1alpha1.EnforcerPool{}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "default"}, pool); err != nil {
		t.Fatalf("the default pool after install: %v", err)
	}
	if pool.Spec.Replicas == nil || *pool.Spec.Replicas != 2 || pool.Spec.Storage == nil || pool.Spec.Storage.ManagedRedis == nil ||
		pool.Spec.AllowedPolicies.Namespaces.From != v1alpha1.NamespacesFromAll {
		t.Errorf("the default pool's spec %+v, want the values' defaults", pool.Spec)
	}
	if _, err := runHelm("upgrade", release, "charts/sluice", "--namespace", ns, "--reuse-values", "--set", "defaultPool.replicas=3"); err != nil {
		t.Fatal(err)
	}
	after := &v1alpha1.EnforcerPool{}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(pool), after); err != nil {
		t.Fatal(err)
	}
	if after.UID != pool.UID || after.Spec.Replicas == nil || *after.Spec.Replicas != 3 {
		t.Errorf("after the upgrade: uid %s (was %s), replicas %v; want the same pool with 3", after.UID, pool.UID, after.Spec.Replicas)
	}
	if _, err := runHelm("uninstall", release, "--namespace", ns); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(pool), after); err != nil || after.DeletionTimestamp != nil || after.UID != pool.UID {
		t.Errorf("the default pool after uninstall: %v, want kept", err)
	}
}

// removeCRDs deletes Sluice's CRDs, and with them every policy and pool, and waits until they
// are gone.
func removeCRDs(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	names := []string{"ratelimitpolicies.ratelimit.sluice.dev", "enforcerpools.ratelimit.sluice.dev"}
	// A CRD deleted while the API server still initializes its storage stays Terminating: its
	// finalizer cannot list the instances ("storage is (re)initializing") and backs off for
	// minutes. A list that succeeds first says the storage is up.
	for _, kind := range []string{"RateLimitPolicyList", "EnforcerPoolList"} {
		poll.WaitFor(t, 30*time.Second, func() error {
			list := &unstructured.UnstructuredList{}
			list.SetGroupVersionKind(schema.GroupVersionKind{Group: "ratelimit.sluice.dev", Version: "v1alpha1", Kind: kind})
			err := k8s.List(ctx, list)
			if meta.IsNoMatchError(err) || apierrors.IsNotFound(err) {
				return nil // not installed: nothing to wait for
			}
			return err
		})
	}
	for _, name := range names {
		crd := &apiextensionsv1.CustomResourceDefinition{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if err := k8s.Delete(ctx, crd); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
	}
	// The API server removes a CRD once its finalizer has listed and deleted its objects and its
	// storage has drained, which takes seconds, and more than 30 under CI's load.
	poll.WaitFor(t, 2*time.Minute, func() error {
		for _, name := range names {
			crd := &apiextensionsv1.CustomResourceDefinition{}
			switch err := k8s.Get(ctx, client.ObjectKey{Name: name}, crd); {
			case err == nil:
				return fmt.Errorf("the CRD %s is not gone yet (conditions %v)", name, crd.Status.Conditions)
			case !apierrors.IsNotFound(err):
				return err
			}
		}
		return nil
	})
}

// chartAppVersion is the chart's appVersion, which tags the images it installs by default.
func chartAppVersion(t *testing.T) string {
	t.Helper()
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	data, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "charts", "sluice", "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, &chart); err != nil {
		t.Fatal(err)
	}
	if chart.AppVersion == "" || chart.AppVersion == "latest" {
		t.Fatalf("Chart.yaml's appVersion %q: want the release the chart installs, which tags its images", chart.AppVersion)
	}
	return chart.AppVersion
}
