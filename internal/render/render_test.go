package render_test

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/render"
)

var update = flag.Bool("update", false, "rewrite the golden files")

var defaults = render.Defaults{EnforcerImage: "example.com/sluice-enforcer:test", RedisImage: "example.com/redis:test",
	NetworkPolicy: &render.NetworkPolicyDefaults{ManagerNamespace: "sluice-system", MonitoringNamespaces: []string{"monitoring"}}}

// poolOfOne renders the pool of one of a policy without poolRef, as the controllers do, with
// no target Service: the policy's config, and its pool's objects.
func poolOfOne(t *testing.T, p *v1alpha1.RateLimitPolicy) (*corev1.ConfigMap, *render.PoolObjects) {
	t.Helper()
	pool := render.OneOf(p, defaults)
	cm, _, err := pool.Config(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := pool.Objects(defaults, nil)
	if err != nil {
		t.Fatal(err)
	}
	return cm, objs
}

func readSample(t *testing.T, name string) *v1alpha1.RateLimitPolicy {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "config", "samples", name))
	if err != nil {
		t.Fatal(err)
	}
	// A sample may carry other objects, such as the Service it fronts.
	doc := string(data)
	for _, d := range strings.Split(doc, "\n---\n") {
		if strings.Contains(d, "\nkind: RateLimitPolicy\n") {
			doc = d
		}
	}
	p := &v1alpha1.RateLimitPolicy{}
	if err := yaml.UnmarshalStrict([]byte(doc), p); err != nil {
		t.Fatal(err)
	}
	p.Namespace, p.UID = "shop", "0f0e0d0c-0b0a-0908-0706-050403020100"
	return p
}

// Every sample renders to the objects pinned in testdata; run with -update after an intended
// change and review the diff.
func TestEnforcerWhenSamplesRenderThenObjectsMatchGoldenFiles(t *testing.T) {
	samples, _ := filepath.Glob(filepath.Join("..", "..", "config", "samples", "*.yaml"))
	for _, path := range samples {
		name := filepath.Base(path)
		t.Run(name, func(t *testing.T) {
			p := readSample(t, name)
			if p.Spec.Enforcer != nil && p.Spec.Enforcer.PoolRef != nil {
				return // a pool serves it: TestPoolWhenTheSampleRendersThenObjectsMatchTheGoldenFile
			}
			cm, objs := poolOfOne(t, p)
			// The controller generates the managed Redis's password; a fixed one here.
			objs.WithRedisPassword("golden-password")
			var docs []string
			for _, o := range append([]client.Object{cm}, objs.All()...) {
				out, err := yaml.Marshal(o)
				if err != nil {
					t.Fatal(err)
				}
				docs = append(docs, string(out))
			}
			got := strings.Join(docs, "---\n")
			golden := filepath.Join("testdata", strings.TrimSuffix(name, ".yaml")+".golden.yaml")
			if *update {
				if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test ./internal/render -update)", err)
			}
			if diff := cmp.Diff(string(want), got); diff != "" {
				t.Errorf("rendered objects differ from %s (-want +got):\n%s", golden, diff)
			}
			// The enforcer reads the ConfigMap with the loader it uses for standalone files.
			if _, warnings, err := enforcer.Load([]byte(cm.Data["policy.yaml"])); err != nil || len(warnings) > 0 {
				t.Errorf("the enforcer cannot load the rendered config cleanly: %v, warnings %q", err, warnings)
			}
		})
	}
}

func TestEnforcerWhenOnlyEnforcerShapeChangesThenConfigRevisionStays(t *testing.T) {
	p := readSample(t, "fixed-window.yaml")
	a, _ := poolOfOne(t, p)
	p.Spec.Enforcer.Replicas = new(int32(5))
	b, _ := poolOfOne(t, p)
	if a.Annotations[render.RevisionAnnotation] != b.Annotations[render.RevisionAnnotation] {
		t.Error("changing replicas changed the config revision: the enforcer's rules did not change")
	}
	p.Spec.Rules[0].FixedWindow.Limit++
	c, _ := poolOfOne(t, p)
	if c.Annotations[render.RevisionAnnotation] == b.Annotations[render.RevisionAnnotation] || c.Data["policy.yaml"] == b.Data["policy.yaml"] {
		t.Error("changing a limit did not change the config")
	}
}

func TestEnforcerWhenNameIsLongThenObjectNamesStayDNSLabels(t *testing.T) {
	p := readSample(t, "token-bucket.yaml")
	p.Name = strings.Repeat("a", 120)
	if n := render.Name(p); len(n) > 63 {
		t.Errorf("name %q has %d characters", n, len(n))
	}
	q := p.DeepCopy()
	q.Name = strings.Repeat("a", 119) + "b"
	if render.Name(p) == render.Name(q) {
		t.Error("two long names share their objects' name")
	}
}

// The kubelet kills a pod at the end of its grace period. The enforcer's stop takes up to
// --shutdown-delay plus --shutdown-timeout, so the grace period must be longer than both.
func TestEnforcerWhenRenderedThenTheGracePeriodCoversTheShutdownDelayAndDrain(t *testing.T) {
	_, objs := poolOfOne(t, readSample(t, "demo.yaml"))
	pod := objs.Deployment.Spec.Template.Spec
	var stop time.Duration
	for _, arg := range pod.Containers[0].Args {
		for _, flag := range []string{"--shutdown-delay=", "--shutdown-timeout="} {
			if v, ok := strings.CutPrefix(arg, flag); ok {
				d, err := time.ParseDuration(v)
				if err != nil {
					t.Fatalf("%s: %v", arg, err)
				}
				stop += d
			}
		}
	}
	if stop == 0 {
		t.Fatal("the enforcer's args set neither --shutdown-delay nor --shutdown-timeout")
	}
	if pod.TerminationGracePeriodSeconds == nil || time.Duration(*pod.TerminationGracePeriodSeconds)*time.Second <= stop {
		t.Errorf("terminationGracePeriodSeconds %v does not exceed the enforcer's stop of %v", pod.TerminationGracePeriodSeconds, stop)
	}
	if c := pod.Containers[0]; c.Lifecycle != nil && c.Lifecycle.PreStop != nil {
		t.Error("a preStop hook would delay SIGTERM and eat the grace period; the enforcer delays by itself")
	}
}

// Every policy name the API server admits (a DNS subdomain: dots, up to 253 characters) renders
// objects whose names are valid Service names, stay as they were for names that always worked,
// and differ between policies.
func TestEnforcerWhenAnyAdmittedNameThenEveryRenderedNameIsAValidUniqueLabel(t *testing.T) {
	names := []string{"api", "shop.v2", "shop-v2", "a.b.c", strings.Repeat("a", 56), strings.Repeat("a", 57),
		strings.Repeat("b", 100), strings.Repeat("c.", 126) + "c"}
	seen := map[string]string{}
	for _, name := range names {
		p := readSample(t, "demo.yaml")
		p.Name = name
		p.Spec.Storage = &v1alpha1.Storage{ManagedRedis: &v1alpha1.ManagedRedis{}}
		cm, objs := poolOfOne(t, p)
		for _, o := range append([]client.Object{cm}, objs.All()...) {
			if msgs := validation.IsDNS1035Label(o.GetName()); len(msgs) > 0 {
				t.Errorf("policy %q: %T name %q: %v", name, o, o.GetName(), msgs)
			}
			if other, ok := seen[o.GetName()]; ok && other != name {
				t.Errorf("policies %q and %q both render %q", other, name, o.GetName())
			}
			seen[o.GetName()] = name
		}
	}
	for name, want := range map[string]string{"api": "sluice-api", strings.Repeat("a", 60): "sluice-" + strings.Repeat("a", 47) + "-"} {
		p := readSample(t, "demo.yaml")
		p.Name = name
		if got := render.Name(p); !strings.HasPrefix(got, want) {
			t.Errorf("Name(%q) = %q, want it to start %q as before", name, got, want)
		}
	}
}

// Every label and selector value the objects carry is a valid label value for every admitted
// name, 63 characters at most; a name that fits one is the value itself, and the pods of a
// longer name carry it in an annotation, from which PolicyOfPod reads it.
func TestEnforcerWhenAnyAdmittedNameThenEveryLabelValueIsValidAndThePodsNameThePolicy(t *testing.T) {
	for _, name := range []string{"api", "shop.v2", strings.Repeat("a", 63), strings.Repeat("b", 64),
		strings.Repeat("c.", 99) + "c", strings.Repeat("d", 52) + ".-" + strings.Repeat("e", 199), strings.Repeat("f.", 126) + "f"} {
		p := readSample(t, "demo.yaml")
		p.Name = name
		p.Spec.Storage = &v1alpha1.Storage{ManagedRedis: &v1alpha1.ManagedRedis{}}
		p.Spec.Enforcer = &v1alpha1.EnforcerSpec{Replicas: new(int32(2))}
		cm, objs := poolOfOne(t, p)
		check := func(what string, labels map[string]string) {
			for k, v := range labels {
				if msgs := validation.IsValidLabelValue(v); len(msgs) > 0 {
					t.Errorf("policy of %d characters: %s label %s=%q: %v", len(name), what, k, v, msgs)
				}
			}
		}
		for _, o := range append([]client.Object{cm}, objs.All()...) {
			check(fmt.Sprintf("%T", o), o.GetLabels())
		}
		for _, d := range []*appsv1.Deployment{objs.Deployment, objs.RedisDeployment} {
			check("pod template", d.Spec.Template.Labels)
			check("selector", d.Spec.Selector.MatchLabels)
		}
		check("Service selector", objs.Service.Spec.Selector)
		check("PodDisruptionBudget selector", objs.PDB.Spec.Selector.MatchLabels)
		pod := &corev1.Pod{ObjectMeta: objs.Deployment.Spec.Template.ObjectMeta}
		if got := render.PolicyOfPod(pod); got != name {
			t.Errorf("PolicyOfPod of a pod of the policy of %d characters = %q", len(name), got)
		}
		if len(name) <= 63 && len(pod.Annotations) > 0 {
			t.Errorf("the pod template of a policy of %d characters has annotations %v: existing policies would roll out", len(name), pod.Annotations)
		}
	}
	if render.LabelValue(strings.Repeat("a", 64)) == render.LabelValue(strings.Repeat("a", 63)+"b") {
		t.Error("two long names share a label value")
	}
}

// The bypass protection keeps every other port of the target's pods open, at the edges of the
// port range too, and refuses a Service it cannot protect, naming the field.
func TestBypassWhenTheTargetPortIsAtAnEdgeOrCannotBeProtected(t *testing.T) {
	p := readSample(t, "token-bucket.yaml")
	p.Spec.TargetRef.BypassProtection = &v1alpha1.BypassProtection{}
	service := func(port corev1.ServicePort, selector map[string]string) *corev1.Service {
		return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: p.Spec.TargetRef.Name}, Spec: corev1.ServiceSpec{Selector: selector, Ports: []corev1.ServicePort{port}}}
	}
	app := map[string]string{"app": "api"}
	ranges := func(np *networkingv1.NetworkPolicy) []string {
		var out []string
		for _, r := range np.Spec.Ingress[1].Ports {
			out = append(out, fmt.Sprintf("%s %d-%d", *r.Protocol, r.Port.IntVal, *r.EndPort))
		}
		return out
	}
	for _, c := range []struct {
		name    string
		svc     *corev1.Service
		want    []string
		wantErr string
	}{
		{"when the target port is 1 then no range lies below it", service(corev1.ServicePort{Port: p.Spec.TargetRef.Port, TargetPort: intstr.FromInt32(1)}, app),
			[]string{"TCP 2-65535", "UDP 1-65535", "SCTP 1-65535"}, ""},
		{"when the target port is 65535 then no range lies above it", service(corev1.ServicePort{Port: p.Spec.TargetRef.Port, TargetPort: intstr.FromInt32(65535)}, app),
			[]string{"TCP 1-65534", "UDP 1-65535", "SCTP 1-65535"}, ""},
		{"when the targetPort is absent then the port is protected, on its protocol", service(corev1.ServicePort{Port: p.Spec.TargetRef.Port, Protocol: corev1.ProtocolUDP}, app),
			[]string{"TCP 1-65535", fmt.Sprintf("UDP 1-%d", p.Spec.TargetRef.Port-1), fmt.Sprintf("UDP %d-65535", p.Spec.TargetRef.Port+1), "SCTP 1-65535"}, ""},
		{"when the Service has no selector then it is refused", service(corev1.ServicePort{Port: p.Spec.TargetRef.Port}, nil), nil, "has no selector"},
		{"when the Service lacks the port then it is refused", service(corev1.ServicePort{Port: p.Spec.TargetRef.Port + 1}, app), nil, "has no port"},
		{"when the targetPort is named then it is refused", service(corev1.ServicePort{Port: p.Spec.TargetRef.Port, TargetPort: intstr.FromString("http")}, app), nil, `named targetPort "http"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			np, err := render.Bypass(p, c.svc)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) || !strings.HasPrefix(err.Error(), "spec.targetRef.bypassProtection: ") {
					t.Fatalf("error = %v, want one naming spec.targetRef.bypassProtection and saying %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(c.want, ranges(np)); diff != "" {
				t.Errorf("ports left open (-want +got):\n%s", diff)
			}
		})
	}
	if np, err := render.Bypass(p, nil); np != nil || err != nil {
		t.Errorf("without the Service: %v, %v; want nothing rendered", np, err)
	}
}
