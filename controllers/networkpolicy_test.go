package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/mattfenwick/cyclonus/pkg/matcher"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// The namespaces of the NetworkPolicy defaults the manager of these tests runs with, as its
// --namespace, --monitoring-namespaces and --check-namespaces would give them.
const (
	managerNamespace    = "np-sluice-system"
	monitoringNamespace = "np-monitoring"
	gatewayNamespace    = "np-gateways"
)

// peer is a pod that sends traffic, as the NetworkPolicy analyzer sees it: a namespace with the
// labels the API server gave it, and the pod's labels.
type peer struct {
	name string
	from *matcher.TrafficPeer
}

// namespacePeer creates (or finds) namespace ns and a pod in it labelled podLabels, and returns
// them as the analyzer's peer, with the labels the API server holds.
func namespacePeer(t *testing.T, name, ns string, podLabels map[string]string) peer {
	t.Helper()
	ctx := context.Background()
	if err := k8s.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	nsObj := &corev1.Namespace{}
	if err := k8s.Get(ctx, client.ObjectKey{Name: ns}, nsObj); err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, GenerateName: "client-", Labels: podLabels},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "example.com/client:test"}}},
	}
	if err := k8s.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), pod) })
	return peer{name, &matcher.TrafficPeer{IP: "10.0.0.1", Internal: &matcher.InternalPeer{
		Namespace: ns, NamespaceLabels: nsObj.Labels, PodLabels: pod.Labels,
	}}}
}

// podPeer is a real pod's peer: its labels and its namespace's, as the API server holds them.
func podPeer(t *testing.T, pod *corev1.Pod) *matcher.TrafficPeer {
	t.Helper()
	nsObj := &corev1.Namespace{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: pod.Namespace}, nsObj); err != nil {
		t.Fatal(err)
	}
	return &matcher.TrafficPeer{IP: "10.0.0.2", Internal: &matcher.InternalPeer{
		Namespace: pod.Namespace, NamespaceLabels: nsObj.Labels, PodLabels: pod.Labels,
	}}
}

// analyze gives every NetworkPolicy of ns, as the API server holds them, to cyclonus's policy
// engine, the one SIG Network's policy-assistant grew from.
func analyze(t *testing.T, ns string) (*matcher.Policy, []networkingv1.NetworkPolicy) {
	t.Helper()
	var list networkingv1.NetworkPolicyList
	if err := k8s.List(context.Background(), &list, client.InNamespace(ns)); err != nil {
		t.Fatal(err)
	}
	pols := make([]*networkingv1.NetworkPolicy, len(list.Items))
	for i := range list.Items {
		pols[i] = &list.Items[i]
	}
	return matcher.BuildNetworkPolicies(false, pols), list.Items
}

// enforcerPod waits for a pod of the policy's enforcer, made by the real ReplicaSet controller.
func enforcerPod(t *testing.T, p *v1alpha1.RateLimitPolicy) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	poll.WaitFor(t, 30*time.Second, func() error {
		var pods corev1.PodList
		if err := k8s.List(context.Background(), &pods, client.InNamespace(p.Namespace), client.MatchingLabels(render.PodLabels(p))); err != nil {
			return err
		}
		if len(pods.Items) == 0 {
			return errors.New("no enforcer pod yet")
		}
		pod = &pods.Items[0]
		return nil
	})
	return pod
}

// The rendered NetworkPolicy, read back from the API server and evaluated by a NetworkPolicy
// engine, admits each port of the enforcer pods from exactly the peers it should: the admin port
// from the manager's and the monitoring namespaces, the check and RLS ports from the policy's
// namespace and the gateways' namespace, the proxy port from anywhere.
func TestNetworkPolicyWhenRenderedThenEachEnforcerPortAdmitsOnlyItsPeers(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "netpol")
	targetService(t, ns, "api")
	p := newPolicy(ns, "np", "api")
	p.Spec.Enforcer = &v1alpha1.EnforcerSpec{Replicas: ptr.To[int32](1), RateLimitService: &v1alpha1.RateLimitService{Enabled: true}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	dst := podPeer(t, enforcerPod(t, p))

	peers := []peer{
		namespacePeer(t, "the manager's namespace", managerNamespace, map[string]string{"app": "sluice-manager"}),
		namespacePeer(t, "a monitoring namespace", monitoringNamespace, map[string]string{"app": "prometheus"}),
		namespacePeer(t, "a gateway namespace", gatewayNamespace, map[string]string{"app": "traefik"}),
		namespacePeer(t, "the policy's namespace", ns, map[string]string{"app": "frontend"}),
		namespacePeer(t, "another namespace", testenv.Namespace(t, k8s, "netpol-other"), map[string]string{"app": "sluice-manager"}),
		{"an address outside the cluster", &matcher.TrafficPeer{IP: "192.0.2.7"}},
	}
	ports := []struct {
		name string
		port int
	}{{"proxy", render.ProxyPort}, {"check", render.CheckPort}, {"rls", render.RLSPort}, {"admin", render.AdminPort}}
	// want[peer][port]
	want := map[string]map[string]bool{
		"the manager's namespace":        {"proxy": true, "admin": true},
		"a monitoring namespace":         {"proxy": true, "admin": true},
		"a gateway namespace":            {"proxy": true, "check": true, "rls": true},
		"the policy's namespace":         {"proxy": true, "check": true, "rls": true},
		"another namespace":              {"proxy": true},
		"an address outside the cluster": {"proxy": true},
	}
	engine, pols := analyze(t, ns)
	if len(pols) != 1 || pols[0].Name != "sluice-np" || !metav1.IsControlledBy(&pols[0], p) {
		t.Fatalf("NetworkPolicies of the namespace: %+v, want sluice-np controlled by the policy", pols)
	}
	for _, src := range peers {
		for _, port := range ports {
			t.Run(fmt.Sprintf("when %s sends to the %s port", src.name, port.name), func(t *testing.T) {
				got := engine.IsTrafficAllowed(&matcher.Traffic{
					Source: src.from, Destination: dst, ResolvedPort: port.port, ResolvedPortName: port.name, Protocol: corev1.ProtocolTCP,
				})
				if got.IsAllowed() != want[src.name][port.name] {
					t.Errorf("allowed = %v, want %v\n%s", got.IsAllowed(), want[src.name][port.name], got.Table())
				}
			})
		}
	}
}

// traffic asks the engine whether src may reach dst on a port.
func traffic(engine *matcher.Policy, src, dst *matcher.TrafficPeer, port int, protocol corev1.Protocol) *matcher.AllowedResult {
	return engine.IsTrafficAllowed(&matcher.Traffic{Source: src, Destination: dst, ResolvedPort: port, Protocol: protocol})
}

// With bypass protection, the target Service's pods admit its target port only from the
// enforcer pods and the listed sources, and keep their other ports open; the NetworkPolicy
// follows the Service when its port changes, is refused with the field named when the Service
// cannot be protected, and goes away with the protection.
func TestBypassProtectionWhenSetThenTheTargetPortAdmitsOnlyTheEnforcerAndTheListedSources(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "bypass")
	jobs := testenv.Namespace(t, k8s, "bypass-jobs")
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "shop"}, Spec: corev1.ServiceSpec{
		Selector: map[string]string{"app": "shop"},
		Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}},
	}}
	if err := k8s.Create(ctx, svc); err != nil {
		t.Fatal(err)
	}
	p := newPolicy(ns, "shop", "shop")
	p.Spec.TargetRef.Port = 80
	p.Spec.Storage, p.Spec.Enforcer = nil, nil
	p.Spec.TargetRef.BypassProtection = &v1alpha1.BypassProtection{AllowedSources: []v1alpha1.BypassSource{
		{Namespace: jobs, PodLabels: map[string]string{"role": "batch"}},
		{PodLabels: map[string]string{"role": "debugger"}},
		{CIDR: "192.0.2.1/24"},
	}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	enforcer := podPeer(t, enforcerPod(t, p))
	shop := namespacePeer(t, "a target pod", ns, map[string]string{"app": "shop"}).from

	peers := []struct {
		name string
		from *matcher.TrafficPeer
		want bool
	}{
		{"the enforcer pods", enforcer, true},
		{"a listed pod of a listed namespace", namespacePeer(t, "", jobs, map[string]string{"role": "batch"}).from, true},
		{"an unlisted pod of a listed namespace", namespacePeer(t, "", jobs, map[string]string{"role": "web"}).from, false},
		{"a pod with listed labels in another namespace", namespacePeer(t, "", testenv.Namespace(t, k8s, "bypass-other"), map[string]string{"role": "batch"}).from, false},
		{"a listed pod of the policy's namespace", namespacePeer(t, "", ns, map[string]string{"role": "debugger"}).from, true},
		{"an unlisted pod of the policy's namespace", namespacePeer(t, "", ns, map[string]string{"app": "frontend"}).from, false},
		{"an address of the listed CIDR", &matcher.TrafficPeer{IP: "192.0.2.200"}, true},
		{"an address outside it", &matcher.TrafficPeer{IP: "198.51.100.1"}, false},
	}
	engine, pols := analyze(t, ns)
	if len(pols) != 2 {
		t.Fatalf("%d NetworkPolicies in the namespace, want the enforcer's and the bypass protection", len(pols))
	}
	for _, src := range peers {
		t.Run("when "+src.name+" sends to the target port", func(t *testing.T) {
			if got := traffic(engine, src.from, shop, 8080, corev1.ProtocolTCP); got.IsAllowed() != src.want {
				t.Errorf("allowed = %v, want %v\n%s", got.IsAllowed(), src.want, got.Table())
			}
		})
	}
	unlisted := peers[5].from
	for _, other := range []struct {
		port     int
		protocol corev1.Protocol
	}{{1, corev1.ProtocolTCP}, {8079, corev1.ProtocolTCP}, {8081, corev1.ProtocolTCP}, {65535, corev1.ProtocolTCP}, {8080, corev1.ProtocolUDP}, {8080, corev1.ProtocolSCTP}} {
		t.Run(fmt.Sprintf("when an unlisted pod sends to %s port %d then it passes as before", other.protocol, other.port), func(t *testing.T) {
			if got := traffic(engine, unlisted, shop, other.port, other.protocol); !got.IsAllowed() {
				t.Errorf("refused\n%s", got.Table())
			}
		})
	}
	t.Run("when an unlisted pod sends to the enforcer's proxy port then it passes", func(t *testing.T) {
		if got := traffic(engine, unlisted, enforcer, render.ProxyPort, corev1.ProtocolTCP); !got.IsAllowed() {
			t.Errorf("refused\n%s", got.Table())
		}
	})

	setTargetPort := func(port intstr.IntOrString) {
		t.Helper()
		if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			if err := k8s.Get(ctx, client.ObjectKeyFromObject(svc), svc); err != nil {
				return err
			}
			svc.Spec.Ports[0].TargetPort = port
			return k8s.Update(ctx, svc)
		}); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("when the Service's targetPort changes then the new port is protected and the old one open", func(t *testing.T) {
		setTargetPort(intstr.FromInt32(8443))
		poll.WaitFor(t, 10*time.Second, func() error {
			engine, _ := analyze(t, ns)
			if traffic(engine, unlisted, shop, 8443, corev1.ProtocolTCP).IsAllowed() || !traffic(engine, unlisted, shop, 8080, corev1.ProtocolTCP).IsAllowed() {
				return errors.New("8443 not yet protected, or 8080 still")
			}
			return nil
		})
	})
	t.Run("when the targetPort is named then Programmed is False naming the field", func(t *testing.T) {
		setTargetPort(intstr.FromString("http"))
		poll.WaitFor(t, 10*time.Second, func() error {
			c := condition(t, p, v1alpha1.ConditionProgrammed)
			if c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "spec.targetRef.bypassProtection") || !strings.Contains(c.Message, `"http"`) {
				return fmt.Errorf("Programmed %+v", c)
			}
			return nil
		})
		setTargetPort(intstr.FromInt32(8080))
		waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	})
	t.Run("when the protection is removed then its NetworkPolicy is deleted", func(t *testing.T) {
		updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) { p.Spec.TargetRef.BypassProtection = nil })
		poll.WaitFor(t, 10*time.Second, func() error {
			err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: render.BypassName(render.Name(p))}, &networkingv1.NetworkPolicy{})
			if !apierrors.IsNotFound(err) {
				return fmt.Errorf("the bypass NetworkPolicy is still there (%w)", err)
			}
			return nil
		})
		engine, _ := analyze(t, ns)
		if got := traffic(engine, unlisted, shop, 8080, corev1.ProtocolTCP); !got.IsAllowed() {
			t.Errorf("the target port still refuses an unlisted pod\n%s", got.Table())
		}
	})
}
