package render_test

import (
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// The target's appProtocol is the scheme of --upstream, and its TLS block becomes the upstream
// TLS flags, with the CA's Secret mounted where --upstream-ca-file reads it.
func TestEnforcerWhenTheTargetSpeaksTLSOrHTTP2ThenTheUpstreamFlagsSaySo(t *testing.T) {
	cases := []struct {
		name      string
		target    v1alpha1.TargetRef
		wantArgs  []string
		wantMount bool
	}{
		{"when appProtocol is absent then http", v1alpha1.TargetRef{Name: "api", Port: 80},
			[]string{"--upstream=http://api.shop.svc:80"}, false},
		{"when appProtocol is h2c then h2c", v1alpha1.TargetRef{Name: "grpc", Port: 50051, AppProtocol: v1alpha1.AppProtocolH2C},
			[]string{"--upstream=h2c://grpc.shop.svc:50051"}, false},
		{"when appProtocol is https without tls then the system roots", v1alpha1.TargetRef{Name: "api", Port: 443, AppProtocol: v1alpha1.AppProtocolHTTPS},
			[]string{"--upstream=https://api.shop.svc:443"}, false},
		{"when tls is given but the protocol is not https then it is ignored",
			v1alpha1.TargetRef{Name: "api", Port: 80, TLS: &v1alpha1.TargetTLS{CASecretRef: &v1alpha1.SecretKeyRef{Name: "api-ca", Key: "ca.crt"}}},
			[]string{"--upstream=http://api.shop.svc:80"}, false},
		{"when tls names a CA and a server name then both are flags and the CA is mounted",
			v1alpha1.TargetRef{Name: "api", Port: 8443, AppProtocol: v1alpha1.AppProtocolHTTPS,
				TLS: &v1alpha1.TargetTLS{CASecretRef: &v1alpha1.SecretKeyRef{Name: "api-ca", Key: "ca.crt"}, ServerName: "api.internal"}},
			[]string{"--upstream=https://api.shop.svc:8443", "--upstream-server-name=api.internal", "--upstream-ca-file=/etc/sluice-upstream-ca/ca.crt"}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := readSample(t, "fixed-window.yaml")
			p.Spec.TargetRef = c.target
			_, objs := poolOfOne(t, p)
			pod := objs.Deployment.Spec.Template.Spec
			var got []string
			for _, a := range pod.Containers[0].Args {
				if len(a) > len("--upstream") && a[:len("--upstream")] == "--upstream" {
					got = append(got, a)
				}
			}
			if diff := cmp.Diff(c.wantArgs, got); diff != "" {
				t.Errorf("upstream flags (-want +got):\n%s", diff)
			}
			mounted := slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool {
				return v.Secret != nil && v.Secret.SecretName == "api-ca" && len(v.Secret.Items) == 1 && v.Secret.Items[0].Key == "ca.crt"
			}) && slices.ContainsFunc(pod.Containers[0].VolumeMounts, func(m corev1.VolumeMount) bool {
				return m.MountPath == "/etc/sluice-upstream-ca" && m.ReadOnly
			})
			if mounted != c.wantMount {
				t.Errorf("CA Secret mounted: %v, want %v", mounted, c.wantMount)
			}
		})
	}
}

// A client certificate Secret is mounted where --upstream-cert-file and --upstream-key-file read
// it, for an https target only; the target's timeouts become the upstream timeout flags, and the
// absent ones keep the enforcer's defaults (no flag).
func TestEnforcerWhenTheTargetNamesAClientCertificateAndTimeoutsThenTheyAreFlags(t *testing.T) {
	p := readSample(t, "fixed-window.yaml")
	p.Spec.TargetRef = v1alpha1.TargetRef{Name: "api", Port: 8443, AppProtocol: v1alpha1.AppProtocolHTTPS,
		TLS:      &v1alpha1.TargetTLS{ClientCertificateSecretRef: &v1alpha1.SecretRef{Name: "api-client"}},
		Timeouts: &v1alpha1.UpstreamTimeouts{Connect: ptrTo[v1alpha1.Duration]("2s"), Idle: ptrTo[v1alpha1.Duration]("1500ms")}}
	_, objs := poolOfOne(t, p)
	pod := objs.Deployment.Spec.Template.Spec
	var got []string
	for _, a := range pod.Containers[0].Args {
		if len(a) > len("--upstream-") && a[:len("--upstream-")] == "--upstream-" {
			got = append(got, a)
		}
	}
	want := []string{"--upstream-cert-file=/etc/sluice-upstream-client/tls.crt", "--upstream-key-file=/etc/sluice-upstream-client/tls.key",
		"--upstream-connect-timeout=2s", "--upstream-idle-timeout=1500ms"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("upstream flags (-want +got):\n%s", diff)
	}
	mounted := slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool {
		return v.Secret != nil && v.Secret.SecretName == "api-client" && len(v.Secret.Items) == 2
	}) && slices.ContainsFunc(pod.Containers[0].VolumeMounts, func(m corev1.VolumeMount) bool {
		return m.MountPath == "/etc/sluice-upstream-client" && m.ReadOnly
	})
	if !mounted {
		t.Errorf("client certificate Secret not mounted: %+v", pod.Volumes)
	}

	p.Spec.TargetRef.AppProtocol = v1alpha1.AppProtocolHTTP
	_, objs = poolOfOne(t, p)
	for _, v := range objs.Deployment.Spec.Template.Spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == "api-client" {
			t.Error("a client certificate mounted for a cleartext target")
		}
	}
}

func ptrTo[T any](v T) *T { return &v }
