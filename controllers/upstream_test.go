package controllers_test

import (
	"context"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// A policy that names no appProtocol speaks the target Service port's, as Gateway API
// implementations read it, and follows it when it changes; the policy's own wins.
func TestReconcileWhenTheServicePortNamesAnAppProtocolThenTheEnforcerSpeaksIt(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "grpc"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 8080, AppProtocol: ptr.To("kubernetes.io/h2c")}}}}
	if err := k8s.Create(ctx, svc); err != nil {
		t.Fatal(err)
	}
	p := newPolicy(ns, "grpc", "grpc")
	p.Spec.TargetRef.TLS = &v1alpha1.TargetTLS{ServerName: "grpc.internal"}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	upstream := func(want ...string) {
		t.Helper()
		eventually(t, "the enforcer's upstream flags "+strings.Join(want, " "), func() (bool, string) {
			dep := &appsv1.Deployment{}
			if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: render.Name(p)}, dep); err != nil {
				return false, err.Error()
			}
			var got []string
			for _, a := range dep.Spec.Template.Spec.Containers[0].Args {
				if strings.HasPrefix(a, "--upstream") {
					got = append(got, a)
				}
			}
			return strings.Join(got, " ") == strings.Join(want, " "), strings.Join(got, " ")
		})
	}
	// h2c from the Service; the TLS block waits for https.
	upstream("--upstream=h2c://grpc." + ns + ".svc:8080")

	svc.Spec.Ports[0].AppProtocol = ptr.To("https")
	if err := k8s.Update(ctx, svc); err != nil {
		t.Fatal(err)
	}
	upstream("--upstream=https://grpc."+ns+".svc:8080", "--upstream-server-name=grpc.internal")

	updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) {
		p.Spec.TargetRef.AppProtocol = v1alpha1.AppProtocolHTTP
		p.Spec.TargetRef.TLS = nil
	})
	upstream("--upstream=http://grpc." + ns + ".svc:8080")
}
