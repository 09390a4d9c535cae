package webhook_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	ctrlwebhook "sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
	"github.com/sluice-dev/sluice/webhook"
)

var (
	k8s      client.Client
	warned   client.Client
	warnings = &warningRecorder{}
)

// warningRecorder collects the admission warnings the API server returns.
type warningRecorder struct {
	mu   sync.Mutex
	seen []string
}

func (w *warningRecorder) HandleWarningHeaderWithContext(_ context.Context, _ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seen = append(w.seen, text)
}

func (w *warningRecorder) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	seen := w.seen
	w.seen = nil
	return seen
}

// TestMain starts a real API server with the webhook configurations of config/webhook, and a
// manager serving the webhook where they point.
func TestMain(m *testing.M) {
	flag.Parse()
	tier.RunFast(m)
	ctrl.SetLogger(logr.Discard())
	env, err := testenv.Start(testenv.WithWebhooks())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = v1alpha1.AddToScheme(scheme)
	k8s, _ = client.New(env.Config, client.Options{Scheme: scheme})
	cfg := rest.CopyConfig(env.Config)
	cfg.WarningHandlerWithContext = warnings
	warned, _ = client.New(cfg, client.Options{Scheme: scheme})

	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:  scheme,
		Metrics: metricsserver.Options{BindAddress: "0"},
		WebhookServer: ctrlwebhook.NewServer(ctrlwebhook.Options{
			Host: env.Webhook.LocalServingHost, Port: env.Webhook.LocalServingPort, CertDir: env.Webhook.LocalServingCertDir,
		}),
	})
	if err == nil {
		err = webhook.Setup(mgr)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _ = mgr.Start(ctx) }()
	if err := waitForWebhook(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	cancel()
	if err := env.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	os.Exit(code)
}

// waitForWebhook waits until a dry-run create passes through both webhooks.
func waitForWebhook(ctx context.Context) error {
	err := poll.Until(30*time.Second, func() error {
		// Only the webhook refuses a repeated key part: its denial says it is served.
		p := validPolicy("default", "probe")
		p.Spec.Rules[0].Key = append(p.Spec.Rules[0].Key, p.Spec.Rules[0].Key[0])
		err := k8s.Create(ctx, p, client.DryRunAll)
		if err != nil && strings.Contains(err.Error(), "denied the request") {
			return nil
		}
		return fmt.Errorf("no denial from the webhook: %w", err)
	})
	if err != nil {
		return fmt.Errorf("the webhook did not answer: %w", err)
	}
	return nil
}

func validPolicy(ns, name string) *v1alpha1.RateLimitPolicy {
	return &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080},
			Rules: []v1alpha1.Rule{{
				Name:        "per-client",
				TokenBucket: &v1alpha1.TokenBucket{Capacity: 10, Refill: v1alpha1.TokenRefill{Tokens: 5, Period: "1s"}},
				Key:         []v1alpha1.KeySource{{Type: v1alpha1.KeyRemoteAddress}},
			}},
		},
	}
}

func TestInvalidPoliciesWhenCreatedThroughTheAPIServerThenRejectedNamingTheField(t *testing.T) {
	// The schema's cases (rejected by CEL before the webhook is asked) and the webhook's own.
	cases := append(testenv.ReadInvalidCases(t, filepath.Join(testenv.RepoRoot(), "test", "testdata", "invalid")),
		testenv.ReadInvalidCases(t, filepath.Join("testdata", "invalid"))...)
	if len(cases) < 30 {
		t.Fatalf("found %d invalid policies, want at least 30", len(cases))
	}
	ns := testenv.Namespace(t, k8s, "webhook")
	for _, c := range cases {
		t.Run(filepath.Base(c.File), func(t *testing.T) {
			objs := testenv.ReadObjects(t, c.File)
			if len(objs) != 1 {
				t.Fatalf("want one policy per file, got %d", len(objs))
			}
			objs[0].SetNamespace(ns)
			testenv.RequireInvalid(t, k8s.Create(context.Background(), objs[0]), c.Field, c.Message)
		})
	}
}

func TestWebhookCasesWhenValidatedWithoutTheAPIServerThenTheValidatorRejectsThem(t *testing.T) {
	// The webhook's cases pass the schema: only the validator can reject them.
	for _, c := range testenv.ReadInvalidCases(t, filepath.Join("testdata", "invalid")) {
		t.Run(filepath.Base(c.File), func(t *testing.T) {
			p := &v1alpha1.RateLimitPolicy{}
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(testenv.ReadObjects(t, c.File)[0].Object, p); err != nil {
				t.Fatal(err)
			}
			_, err := (&webhook.Validator{}).ValidateCreate(context.Background(), p)
			testenv.RequireInvalid(t, err, c.Field, c.Message)
			if tier.Fast() {
				return // the API server's part needs the full tier
			}
			if err := k8s.Create(context.Background(), testenv.ReadObjects(t, c.File)[0], client.DryRunAll); err == nil {
				t.Fatal("accepted by the API server")
			}
		})
	}
}

func TestSamplesWhenCreatedThenStoredAsWrittenWithTheSchemasDefaults(t *testing.T) {
	files := testenv.Samples(t)
	ns := testenv.Namespace(t, k8s, "webhook")
	ctx := context.Background()
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			for _, u := range testenv.ReadObjects(t, file) {
				if u.GroupVersionKind() != testenv.GVK {
					continue
				}
				u.SetNamespace(ns)
				var written v1alpha1.RateLimitPolicy
				if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.DeepCopy().Object, &written); err != nil {
					t.Fatal(err)
				}
				if err := k8s.Create(ctx, u); err != nil {
					t.Fatalf("create %s: %v", u.GetName(), err)
				}
				got := &v1alpha1.RateLimitPolicy{}
				if err := k8s.Get(ctx, client.ObjectKeyFromObject(u), got); err != nil {
					t.Fatal(err)
				}
				requireAsWritten(t, &written, got)
			}
		})
	}
}

// requireAsWritten checks that the stored spec is what the author wrote plus the schema's
// constant defaults: nothing that depends on other fields or on the manager's flags, which GitOps
// tools would see as drift and later changes would fight.
func requireAsWritten(t *testing.T, written, got *v1alpha1.RateLimitPolicy) {
	t.Helper()
	s := got.Spec
	for i, r := range s.Rules {
		w := written.Spec.Rules[i]
		if diff := cmp.Diff(w, r); diff != "" {
			t.Errorf("rule %s changed at admission (-written +stored):\n%s", r.Name, diff)
		}
	}
	if diff := cmp.Diff(written.Spec.Enforcer, s.Enforcer); diff != "" {
		t.Errorf("spec.enforcer changed at admission (-written +stored):\n%s", diff)
	}
	if st := s.Storage; st != nil && st.Redis != nil {
		wantTimeout := v1alpha1.DefaultRedisTimeout
		if w := written.Spec.Storage.Redis.Timeout; w != nil {
			wantTimeout = *w
		}
		if st.Redis.Timeout == nil || *st.Redis.Timeout != wantTimeout || st.Redis.Mode == "" {
			t.Errorf("redis timeout %v mode %q; want %s and a mode", st.Redis.Timeout, st.Redis.Mode, wantTimeout)
		}
	}
	if st := s.Storage; st != nil && st.ManagedRedis != nil {
		if st.ManagedRedis.Image != written.Spec.Storage.ManagedRedis.Image || st.ManagedRedis.MaxMemory == nil {
			t.Errorf("managedRedis image %q maxMemory %v; want the image as written and the schema's maxMemory", st.ManagedRedis.Image, st.ManagedRedis.MaxMemory)
		}
	}
}

// A rule without its own failureMode is stored without one, and follows defaultFailureMode: a
// copy written at admission would stay behind when defaultFailureMode changes.
func TestPolicyWhenRulesLeaveFailureModeOutThenTheyFollowDefaultFailureMode(t *testing.T) {
	ns := testenv.Namespace(t, k8s, "webhook")
	p := validPolicy(ns, "closed")
	p.Spec.DefaultFailureMode = v1alpha1.FailClosed
	p.Spec.Rules = append(p.Spec.Rules, v1alpha1.Rule{Name: "open", FailureMode: v1alpha1.FailOpen,
		FixedWindow: &v1alpha1.Window{Limit: 100, Window: "1m"}, Key: p.Spec.Rules[0].Key})
	p.Spec.Storage = &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{Addresses: []v1alpha1.HostPort{"redis.example:6379"}}}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	stored := map[string]v1alpha1.FailureMode{}
	for _, r := range p.Spec.Rules {
		stored[r.Name] = r.FailureMode
	}
	if diff := cmp.Diff(map[string]v1alpha1.FailureMode{"per-client": "", "open": v1alpha1.FailOpen}, stored); diff != "" {
		t.Errorf("stored failure modes (-want +got):\n%s", diff)
	}
	for _, mode := range []v1alpha1.FailureMode{v1alpha1.FailClosed, v1alpha1.FailOpen} {
		p.Spec.DefaultFailureMode = mode
		compiled, err := policy.Compile(p)
		if err != nil {
			t.Fatal(err)
		}
		failOpen := map[string]bool{}
		for _, r := range compiled.Rules {
			failOpen[r.Name] = r.FailOpen
		}
		if diff := cmp.Diff(map[string]bool{"per-client": mode == v1alpha1.FailOpen, "open": true}, failOpen); diff != "" {
			t.Errorf("defaultFailureMode %s: fails open (-want +got):\n%s", mode, diff)
		}
	}
	if p.Spec.Enforcer != nil || *p.Spec.Storage.Redis.Timeout != "50ms" || p.Spec.Storage.Redis.Mode != v1alpha1.RedisStandalone {
		t.Errorf("enforcer %+v redis %+v; want no enforcer written, and the schema's timeout 50ms and mode Standalone", p.Spec.Enforcer, p.Spec.Storage.Redis)
	}
}

func TestRiskyPoliciesWhenCreatedThenKubectlGetsWarnings(t *testing.T) {
	ns := testenv.Namespace(t, k8s, "webhook")
	for i, c := range warningCases() {
		t.Run(c.name, func(t *testing.T) {
			p := c.policy()
			p.Namespace, p.Name = ns, fmt.Sprintf("risky-%d", i)
			warnings.take()
			if err := warned.Create(context.Background(), p); err != nil {
				t.Fatal(err)
			}
			requireWarnings(t, warnings.take(), c.want)
		})
	}
}

func TestPolicyWhenUpdatedToSomethingInvalidThenRejectedAndTheOldSpecStays(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "webhook")
	p := validPolicy(ns, "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	p.Spec.Rules[0].TokenBucket = nil
	p.Spec.Rules[0].LeakyBucket = &v1alpha1.LeakyBucket{Capacity: 10, Drain: v1alpha1.DrainRate{Requests: 1, Period: "1s"}, MaxWait: ptr.To[v1alpha1.Duration]("1h")}
	testenv.RequireInvalid(t, k8s.Update(ctx, p), "spec.rules[0].leakyBucket.maxWait", "must not exceed 10s")

	got := &v1alpha1.RateLimitPolicy{}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(p), got); err != nil {
		t.Fatal(err)
	}
	if got.Spec.Rules[0].TokenBucket == nil || got.Spec.Rules[0].LeakyBucket != nil {
		t.Errorf("stored rule = %+v, want the token bucket it had", got.Spec.Rules[0])
	}
}

func TestPolicyWhenItDoesNotDecodeThenTheSchemaNamesEveryWrongField(t *testing.T) {
	tier.Needs(t, "the test control plane")
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "ratelimit.sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
		"metadata": map[string]any{"name": "malformed", "namespace": "default"},
		"spec":     map[string]any{"targetRef": map[string]any{"name": "api", "port": "eighty"}, "rules": "all"},
	}}
	err := k8s.Create(context.Background(), u, client.DryRunAll)
	testenv.RequireInvalid(t, err, "spec.targetRef.port", `must be of type integer`)
	testenv.RequireInvalid(t, err, "spec.rules", `must be of type array`)
}

func TestWebhookConfigurationsWhenInstalledThenFailClosedOnCreateAndUpdateAndNeverSeeDeletes(t *testing.T) {
	tier.Needs(t, "the test control plane")
	ctx := context.Background()
	var validating admissionregistrationv1.ValidatingWebhookConfigurationList
	if err := k8s.List(ctx, &validating); err != nil {
		t.Fatal(err)
	}
	type hook struct {
		policy admissionregistrationv1.FailurePolicyType
		ops    []admissionregistrationv1.OperationType
	}
	var got []hook
	for _, c := range validating.Items {
		for _, w := range c.Webhooks {
			got = append(got, hook{*w.FailurePolicy, w.Rules[0].Operations})
		}
	}
	ops := []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update}
	want := []hook{{admissionregistrationv1.Fail, ops}}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(hook{})); diff != "" {
		t.Errorf("webhooks (-want +got):\n%s", diff)
	}
}

func requireWarnings(t *testing.T, got, want []string) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("got %d warnings, want %d:\n%s", len(got), len(want), strings.Join(got, "\n"))
	}
	for _, w := range want {
		if !slices.ContainsFunc(got, func(g string) bool { return strings.Contains(g, w) }) {
			t.Errorf("no warning containing %q in:\n%s", w, strings.Join(got, "\n"))
		}
	}
}

// An upgrade from a version with a defaulting webhook leaves its configuration behind; the
// manager deletes it at start, or every write of a policy would fail.
func TestRemoveObsoleteWhenTheOldDefaultingConfigurationIsLeftThenItIsDeleted(t *testing.T) {
	tier.Needs(t, "the test control plane")
	ctx := context.Background()
	none := admissionregistrationv1.SideEffectClassNone
	url := "https://127.0.0.1:1/mutate-ratelimit-sluice-dev-v1alpha1-ratelimitpolicy"
	old := &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: webhook.ObsoleteDefaultingWebhook},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{Name: "mratelimitpolicy.sluice.dev", SideEffects: &none, AdmissionReviewVersions: []string{"v1"},
			ClientConfig: admissionregistrationv1.WebhookClientConfig{URL: &url},
			// Matches nothing here, so that other tests running meanwhile are not failed by it.
			ObjectSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"never": "matched"}},
		}},
	}
	if err := k8s.Create(ctx, old); err != nil {
		t.Fatal(err)
	}
	if err := (webhook.RemoveObsolete{Client: k8s, Name: webhook.ObsoleteDefaultingWebhook}).Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(old), old); !apierrors.IsNotFound(err) {
		t.Errorf("the obsolete configuration is still there: %v", err)
	}
	// A second start, with nothing to delete, is fine too.
	if err := (webhook.RemoveObsolete{Client: k8s, Name: webhook.ObsoleteDefaultingWebhook}).Start(ctx); err != nil {
		t.Error(err)
	}
}
