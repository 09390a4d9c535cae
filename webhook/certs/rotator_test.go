package certs_test

import (
	"github.com/sluice-dev/sluice/test/tier"

	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/go-logr/logr"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	clocktesting "k8s.io/utils/clock/testing"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	ctrlwebhook "sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/test/testenv"
	"github.com/sluice-dev/sluice/webhook"
	"github.com/sluice-dev/sluice/webhook/certs"
)

// The API server calls the webhook through configurations that envtest installed with its own CA;
// the rotator must replace that trust with its own, renew the serving certificate and its CA
// while the manager runs, and never leave the API server unable to call the webhook.
func TestRotatorWhenCertificatesExpireThenNewOnesAreServedAndTrustedWithoutARestart(t *testing.T) {
	tier.Needs(t, "the test control plane")
	ctrl.SetLogger(logr.Discard())
	env, err := testenv.Start(testenv.WithWebhooks())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = v1alpha1.AddToScheme(scheme)
	k8s, _ := client.New(env.Config, client.Options{Scheme: scheme})

	rotator := &certs.Rotator{
		Client:             k8s,
		Secret:             types.NamespacedName{Namespace: "default", Name: "sluice-webhook-certs"},
		Hosts:              []string{"localhost", env.Webhook.LocalServingHost},
		ValidatingWebhooks: []string{"validating-webhook-configuration"},
		CAValidity:         15 * time.Second, // renewed at 10s
		CertValidity:       6 * time.Second,  // renewed every 4s
		Interval:           200 * time.Millisecond,
	}
	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:  scheme,
		Metrics: metricsserver.Options{BindAddress: "0"},
		WebhookServer: ctrlwebhook.NewServer(ctrlwebhook.Options{
			Host: env.Webhook.LocalServingHost, Port: env.Webhook.LocalServingPort,
			TLSOpts: []func(*tls.Config){func(c *tls.Config) { c.GetCertificate = rotator.GetCertificate }},
		}),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := webhook.Setup(mgr); err != nil {
		t.Fatal(err)
	}
	if err := mgr.Add(rotator); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = mgr.Start(ctx) }()

	admit := func() error {
		p := &v1alpha1.RateLimitPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "probe"},
			Spec: v1alpha1.RateLimitPolicySpec{
				TargetRef: v1alpha1.TargetRef{Name: "api", Port: 80},
				Rules:     []v1alpha1.Rule{{Name: "all", FixedWindow: &v1alpha1.Window{Limit: 1, Window: "1s"}}},
			},
		}
		// The webhook fails closed: an admission that passes reached it.
		return k8s.Create(ctx, p, client.DryRunAll)
	}
	deadline := time.Now().Add(20 * time.Second)
	for err := admit(); err != nil; err = admit() {
		if time.Now().After(deadline) {
			t.Fatalf("the API server never reached the webhook with the rotator's certificate: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}

	addr := net.JoinHostPort(env.Webhook.LocalServingHost, strconv.Itoa(env.Webhook.LocalServingPort))
	serials, issuers := map[string]bool{}, map[string]bool{}
	var failures []error
	for end := time.Now().Add(13 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if err := admit(); err != nil {
			failures = append(failures, err)
		}
		cert, err := servedAndTrusted(ctx, k8s, addr, env.Webhook.LocalServingHost)
		if err != nil {
			t.Fatal(err)
		}
		serials[cert.SerialNumber.String()] = true
		issuers[cert.Issuer.CommonName] = true
	}
	if len(serials) < 3 || len(issuers) < 2 {
		t.Errorf("saw %d serving certificates from %d CAs in 13s, want at least 3 from 2 (renewals every 4s, the CA at 10s)", len(serials), len(issuers))
	}
	if len(failures) > 0 {
		t.Errorf("%d admission requests failed during rotation, want none; first: %v", len(failures), failures[0])
	}
}

// servedAndTrusted dials the webhook server and checks its certificate against the caBundle that
// the webhook configuration carries now.
func servedAndTrusted(ctx context.Context, k8s client.Client, addr, host string) (*x509.Certificate, error) {
	var validating admissionregistrationv1.ValidatingWebhookConfiguration
	if err := k8s.Get(ctx, client.ObjectKey{Name: "validating-webhook-configuration"}, &validating); err != nil {
		return nil, err
	}
	bundle := validating.Webhooks[0].ClientConfig.CABundle
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(bundle)
	conn, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true}) //nolint:gosec // verified below against the bundle
	if err != nil {
		return nil, err
	}
	defer func() { _ = conn.Close() }()
	cert := conn.ConnectionState().PeerCertificates[0]
	if _, err := cert.Verify(x509.VerifyOptions{Roots: pool, DNSName: host}); err != nil {
		return nil, fmt.Errorf("served certificate %s not trusted by the caBundle: %w", cert.SerialNumber, err)
	}
	return cert, nil
}

func TestRotatorWhenWebhookConfigurationsAppearAfterStartThenTheirCABundleIsFilledOnTheRetry(t *testing.T) {
	tier.Needs(t, "the test control plane")
	clk := clocktesting.NewFakeClock(time.Now())
	env, err := testenv.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	k8s, _ := client.New(env.Config, client.Options{Scheme: scheme})
	rotator := &certs.Rotator{
		Client:             k8s,
		Secret:             types.NamespacedName{Namespace: "default", Name: "sluice-webhook-certs"},
		Hosts:              []string{"sluice-webhook-service.default.svc"},
		MutatingWebhooks:   []string{"late-mutating"},
		ValidatingWebhooks: []string{"late-validating"},
		Interval:           time.Hour, // only the retry after an error can fill them in time
		Clock:              clk,
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = rotator.Start(ctx) }()
	// The first sync finds no configurations and waits on the clock for its retry.
	for !clk.HasWaiters() {
		time.Sleep(10 * time.Millisecond)
	}

	none := admissionregistrationv1.SideEffectClassNone
	url := "https://127.0.0.1:1/never"
	hook := admissionregistrationv1.WebhookClientConfig{URL: &url}
	if err := k8s.Create(ctx, &admissionregistrationv1.MutatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: "late-mutating"},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{Name: "m.sluice.dev", ClientConfig: hook, SideEffects: &none, AdmissionReviewVersions: []string{"v1"}}}}); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Create(ctx, &admissionregistrationv1.ValidatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: "late-validating"},
		Webhooks: []admissionregistrationv1.ValidatingWebhook{{Name: "v.sluice.dev", ClientConfig: hook, SideEffects: &none, AdmissionReviewVersions: []string{"v1"}}}}); err != nil {
		t.Fatal(err)
	}
	clk.Step(2 * time.Second) // the retry after an error
	deadline := time.Now().Add(10 * time.Second)
	for {
		var m admissionregistrationv1.MutatingWebhookConfiguration
		var v admissionregistrationv1.ValidatingWebhookConfiguration
		errM := k8s.Get(ctx, client.ObjectKey{Name: "late-mutating"}, &m)
		errV := k8s.Get(ctx, client.ObjectKey{Name: "late-validating"}, &v)
		if errM == nil && errV == nil && len(m.Webhooks[0].ClientConfig.CABundle) > 0 && len(v.Webhooks[0].ClientConfig.CABundle) > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the caBundle was not filled within 10s of the retry")
		}
		time.Sleep(100 * time.Millisecond)
	}
}
