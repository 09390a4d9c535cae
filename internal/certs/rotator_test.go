package certs_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	clocktesting "k8s.io/utils/clock/testing"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	ctrlwebhook "sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/certs"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
	"github.com/sluice-dev/sluice/webhook"
)

// The API server calls the webhook through configurations that envtest installed with its own CA;
// the rotator must replace that trust with its own, renew the serving certificate and its CA
// while the manager runs, and never leave the API server unable to call the webhook.
//
// The rotator runs on a fake clock, which the test moves on by its interval and then waits until
// the rotator has synced: minutes of certificate lifetimes pass in as many syncs. The API server
// and the TLS client check validity on the real clock, so the fake one starts two minutes back
// and ends at most four ahead: within the five minutes by which certificates are backdated, and
// within the validity of the certificate served at each moment.
func TestRotatorWhenCertificatesExpireThenNewOnesAreServedAndTrustedWithoutARestart(t *testing.T) {
	tier.Needs(t, "the test control plane")
	ctrl.SetLogger(logr.Discard())
	const interval, steps = 20 * time.Second, 18 // six minutes of the rotator's time
	clk := clocktesting.NewFakeClock(time.Now().Add(-2 * time.Minute))
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
		CAValidity:         7 * time.Minute, // renewed after 4m40s
		CertValidity:       4 * time.Minute, // renewed after 2m40s
		Interval:           interval,
		Clock:              clk,
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
	// synced waits until the rotator has synced and waits on the clock for its next round.
	synced := func() {
		t.Helper()
		poll.WaitFor(t, 20*time.Second, poll.True("the rotator waiting for its next round", clk.HasWaiters))
	}
	synced()
	poll.WaitFor(t, 20*time.Second, func() error {
		if err := admit(); err != nil {
			return fmt.Errorf("the API server does not reach the webhook with the rotator's certificate: %w", err)
		}
		return nil
	})

	addr := net.JoinHostPort(env.Webhook.LocalServingHost, strconv.Itoa(env.Webhook.LocalServingPort))
	serials, issuers := map[string]bool{}, map[string]bool{}
	var failures []error
	for range steps {
		clk.Step(interval)
		synced()
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
		t.Errorf("saw %d serving certificates from %d CAs in %v, want at least 3 from 2 (renewals after 2m40s, the CA after 4m40s)", len(serials), len(issuers), steps*interval)
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
	poll.WaitFor(t, 10*time.Second, poll.True("the rotator waiting for its retry", clk.HasWaiters))

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
	poll.WaitFor(t, 10*time.Second, func() error {
		var m admissionregistrationv1.MutatingWebhookConfiguration
		var v admissionregistrationv1.ValidatingWebhookConfiguration
		errM := k8s.Get(ctx, client.ObjectKey{Name: "late-mutating"}, &m)
		errV := k8s.Get(ctx, client.ObjectKey{Name: "late-validating"}, &v)
		if errM == nil && errV == nil && len(m.Webhooks[0].ClientConfig.CABundle) > 0 && len(v.Webhooks[0].ClientConfig.CABundle) > 0 {
			return nil
		}
		if err := errors.Join(errM, errV); err != nil {
			return err
		}
		return errors.New("the caBundle is not filled after the retry")
	})
}

// A certificate is served only once the CA that signed it is in the caBundle of the webhook
// configurations: when the bundle update fails after a CA renewal, the previous certificate,
// which the API server trusts, is served on, and the new one once the update goes through.
func TestRotatorWhenTheBundleUpdateFailsThenThePreviousCertificateIsServedOn(t *testing.T) {
	tier.Needs(t, "the test control plane")
	env, err := testenv.Start(testenv.WithWebhooks())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	k8s, _ := client.New(env.Config, client.Options{Scheme: scheme})
	var failing atomic.Bool
	flaky := interceptor.NewClient(noWatch{k8s}, interceptor.Funcs{
		Update: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.UpdateOption) error {
			if _, ok := o.(*admissionregistrationv1.ValidatingWebhookConfiguration); ok && failing.Load() {
				return errors.New("etcdserver: request timed out")
			}
			return c.Update(ctx, o, opts...)
		},
	})
	clk := clocktesting.NewFakeClock(time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC))
	host := "sluice-webhook-service.default.svc"
	rotator := &certs.Rotator{
		Client:             flaky,
		Secret:             types.NamespacedName{Namespace: "default", Name: "sluice-webhook-certs"},
		Hosts:              []string{host},
		ValidatingWebhooks: []string{"validating-webhook-configuration"},
		CAValidity:         30 * time.Hour, // renewed at 20h
		CertValidity:       24 * time.Hour, // renewed at 16h, valid until 24h
		Clock:              clk,
	}
	ctx := context.Background()
	// trusted says whether the served certificate is trusted by the bundle the API server has.
	trusted := func() error {
		var cfg admissionregistrationv1.ValidatingWebhookConfiguration
		if err := k8s.Get(ctx, client.ObjectKey{Name: "validating-webhook-configuration"}, &cfg); err != nil {
			return err
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(cfg.Webhooks[0].ClientConfig.CABundle)
		served, err := rotator.GetCertificate(nil)
		if err != nil {
			return err
		}
		leaf, err := x509.ParseCertificate(served.Certificate[0])
		if err != nil {
			return err
		}
		_, err = leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: host, CurrentTime: clk.Now()})
		return err
	}
	if err := rotator.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if err := trusted(); err != nil {
		t.Fatalf("after the first sync: %v", err)
	}
	failing.Store(true)
	clk.Step(21 * time.Hour) // the CA and the certificate are both due
	if err := rotator.Sync(ctx); err == nil {
		t.Fatal("the sync succeeded although the bundle update failed")
	}
	if err := trusted(); err != nil {
		t.Errorf("when the bundle update failed after a CA renewal then the served certificate is not trusted: %v", err)
	}
	failing.Store(false)
	if err := rotator.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if err := trusted(); err != nil {
		t.Errorf("after the bundle update went through: %v", err)
	}
	served, _ := rotator.GetCertificate(nil)
	if leaf, _ := x509.ParseCertificate(served.Certificate[0]); !strings.Contains(leaf.Issuer.CommonName, strconv.FormatInt(clk.Now().Unix(), 10)) {
		t.Errorf("the certificate served after the update is issued by %s, want the CA made at %v", leaf.Issuer.CommonName, clk.Now())
	}
}

// noWatch lets a plain client stand where the interceptor wants a client.WithWatch.
type noWatch struct{ client.Client }

func (noWatch) Watch(context.Context, client.ObjectList, ...client.ListOption) (watch.Interface, error) {
	return nil, errors.New("no watch")
}
