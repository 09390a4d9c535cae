package controllers_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// An enforcer that cannot start, here because the CA Secret of its https target holds no
// certificate, exits with 2, as it does on a flag it refuses; its pod waits in CrashLoopBackOff as the kubelet stand-in writes it, and
// Ready says so, naming the pod and the container's last exit, with the reason CrashLooping that
// kubectl's REASON column shows.
func TestStatusWhenAnEnforcerKeepsExitingThenReadySaysCrashLoopingNamingThePod(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "crash")
	targetService(t, ns, "api")
	ca := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "api-ca"}, StringData: map[string]string{"ca.crt": "not a certificate"}}
	if err := k8s.Create(ctx, ca); err != nil {
		t.Fatal(err)
	}
	kubelet, err := local.StartKubelet(ctx, k8s, env.Config, enforcerBin, local.KubeletOptions{
		Namespace: ns, Upstream: "https://127.0.0.1:1", Dir: t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kubelet.Stop)
	p := newPolicy(ns, "crash", "api")
	p.Spec.Storage, p.Spec.Enforcer.Replicas = nil, ptr.To[int32](1)
	p.Spec.TargetRef.AppProtocol = v1alpha1.AppProtocolHTTPS
	p.Spec.TargetRef.TLS = &v1alpha1.TargetTLS{CASecretRef: &v1alpha1.SecretKeyRef{Name: "api-ca", Key: "ca.crt"}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	eventually(t, "Ready CrashLooping, naming the pod and its last exit", func() (bool, string) {
		c := condition(t, p, v1alpha1.ConditionReady)
		ok := c != nil && c.Status == metav1.ConditionFalse && c.Reason == v1alpha1.ReasonCrashLooping &&
			strings.Contains(c.Message, ": CrashLoopBackOff: back-off ") && strings.Contains(c.Message, "container enforcer last exited with code 2 (Error)") &&
			p.Status.Reason == v1alpha1.ReasonCrashLooping
		return ok, fmt.Sprintf("%+v, status.reason %q", c, p.Status.Reason)
	})
}
