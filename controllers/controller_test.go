package controllers_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

var (
	k8s        client.Client // a direct client: reads go to the API server
	env        *testenv.Env
	reconciler *controllers.RateLimitPolicyReconciler
	mgrClient  client.Client
	// redisAddr is the Redis every policy of these tests names.
	redisAddr string
	// enforcerBin is the enforcer binary the kubelet stand-in runs (see runEnforcers).
	enforcerBin string
)

func TestMain(m *testing.M) {
	flag.Parse()
	tier.RunFast(m)
	os.Exit(run(m))
}

// run starts the control plane with the real kube-controller-manager, a Redis, and the manager,
// runs the tests, and stops them all.
func run(m *testing.M) int {
	ctrl.SetLogger(logr.Discard())
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var err error
	env, err = testenv.Start(testenv.WithControllers())
	if err != nil {
		return fail(err)
	}
	defer func() { _ = env.Stop() }()
	redis, err := redistest.StartServer()
	if err != nil {
		return fail(err)
	}
	defer redis.Stop()
	redisAddr = redis.Addr()
	bin, err := os.MkdirTemp("", "sluice-controllers-")
	if err != nil {
		return fail(err)
	}
	defer func() { _ = os.RemoveAll(bin) }()
	if enforcerBin, err = local.BuildCmd(context.Background(), bin, "enforcer"); err != nil {
		return fail(err)
	}
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = v1alpha1.AddToScheme(scheme)
	direct := rest.CopyConfig(env.Config)
	direct.QPS, direct.Burst = -1, 0 // the test's own client is not throttled
	k8s, _ = client.New(direct, client.Options{Scheme: scheme})
	// The manager runs with the defaults of cmd/manager's --kube-api-qps and --kube-api-burst.
	managerConfig := rest.CopyConfig(env.Config)
	managerConfig.QPS, managerConfig.Burst = 400, 800
	mgr, err := ctrl.NewManager(managerConfig, ctrl.Options{
		Scheme:                 scheme,
		Cache:                  cache.Options{ByObject: controllers.CacheByObject()},
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	mgrClient = mgr.GetClient()
	reconciler = &controllers.RateLimitPolicyReconciler{
		Client: mgrClient, Scheme: scheme, Recorder: mgr.GetEventRecorder("sluice"),
		Defaults: render.Defaults{EnforcerImage: "example.com/enforcer:test", RedisImage: "example.com/redis:test",
			NetworkPolicy: &render.NetworkPolicyDefaults{ManagerNamespace: managerNamespace, MonitoringNamespaces: []string{monitoringNamespace}, CheckNamespaces: []string{gatewayNamespace}}},
		Workers:        16,
		ProbeRedis:     controllers.DialRedis,
		ProbeInterval:  300 * time.Millisecond,
		ReportInterval: time.Second,
	}
	if err := reconciler.SetupWithManager(ctx, mgr); err != nil {
		return fail(err)
	}
	go func() {
		if err := mgr.Start(ctx); err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
	}()
	return m.Run()
}

// runEnforcers runs the enforcer pods of a namespace until the test ends, as a kubelet would,
// and creates the Secret that newPolicy's credentials name.
func runEnforcers(t *testing.T, ns string) *local.Kubelet {
	t.Helper()
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "redis-creds"}, StringData: map[string]string{"password": ""}}
	if err := k8s.Create(context.Background(), secret); err != nil {
		t.Fatal(err)
	}
	k, err := local.StartKubelet(context.Background(), k8s, env.Config, enforcerBin, local.KubeletOptions{
		Namespace: ns, Upstream: "http://127.0.0.1:1", Dir: t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	return k
}

func targetService(t *testing.T, ns, name string) {
	t.Helper()
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 8080}}}}
	if err := k8s.Create(context.Background(), svc); err != nil {
		t.Fatal(err)
	}
}

func newPolicy(ns, name, target string) *v1alpha1.RateLimitPolicy {
	return &v1alpha1.RateLimitPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.RateLimitPolicySpec{
			TargetRef: v1alpha1.TargetRef{Name: target, Port: 8080},
			Rules: []v1alpha1.Rule{{Name: "burst", TokenBucket: &v1alpha1.TokenBucket{Capacity: 10, Refill: v1alpha1.TokenRefill{Tokens: 10, Period: "1s"}},
				Key: []v1alpha1.KeySource{{Type: v1alpha1.KeyHeader, Name: ptr.To[v1alpha1.HeaderName]("X-Api-Key")}}}},
			Storage: &v1alpha1.Storage{Redis: &v1alpha1.RedisStorage{
				Mode: v1alpha1.RedisStandalone, Addresses: []v1alpha1.HostPort{v1alpha1.HostPort(redisAddr)},
				CredentialsSecretRef: &v1alpha1.CredentialsSecretRef{Name: "redis-creds", PasswordKey: "password"},
				// Not the 50ms default: under the race detector on two busy cores a replica's
				// decision may take longer, and its report would Degrade a policy a test reads.
				Timeout: ptr.To[v1alpha1.Duration]("2s"),
			}},
			Enforcer: &v1alpha1.EnforcerSpec{Replicas: ptr.To[int32](3)},
		},
	}
}

// noticed is what of a policy's status a user acts on, which the controller writes at once: its
// conditions' statuses and reasons, and its enforcer's replicas and revision.
func noticed(p *v1alpha1.RateLimitPolicy) string {
	s := fmt.Sprint("generation ", p.Status.ObservedGeneration)
	for _, c := range p.Status.Conditions {
		s += fmt.Sprintf(", %s=%s/%s", c.Type, c.Status, c.Reason)
	}
	if e := p.Status.Enforcer; e != nil {
		s += fmt.Sprintf(", replicas %d/%d, revision %s", e.ReadyReplicas, e.Replicas, e.ConfigRevision)
	}
	return s
}

// eventually polls cond until it holds or 10 seconds pass.
func eventually(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	poll.WaitFor(t, 10*time.Second, func() error {
		if ok, detail := cond(); !ok {
			return fmt.Errorf("%s: %s", what, detail)
		}
		return nil
	})
}

func condition(t *testing.T, p *v1alpha1.RateLimitPolicy, typ string) *metav1.Condition {
	t.Helper()
	if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
		t.Fatal(err)
	}
	return meta.FindStatusCondition(p.Status.Conditions, typ)
}

func waitCondition(t *testing.T, p *v1alpha1.RateLimitPolicy, typ string, want metav1.ConditionStatus, reason string) {
	t.Helper()
	eventually(t, fmt.Sprintf("%s=%s (%s)", typ, want, reason), func() (bool, string) {
		c := condition(t, p, typ)
		return c != nil && c.Status == want && (reason == "" || c.Reason == reason) && p.Status.ObservedGeneration == p.Generation,
			fmt.Sprintf("%+v, observedGeneration %d of %d", c, p.Status.ObservedGeneration, p.Generation)
	})
}

func kstatus(t *testing.T, p *v1alpha1.RateLimitPolicy) status.Status {
	t.Helper()
	if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
		t.Fatal(err)
	}
	u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(p)
	if err != nil {
		t.Fatal(err)
	}
	res, err := status.Compute(&unstructured.Unstructured{Object: u})
	if err != nil {
		t.Fatal(err)
	}
	return res.Status
}

// updateSpec changes a policy as a user would: on the latest version, again after a conflict with
// the controller's own status writes.
func updateSpec(t *testing.T, p *v1alpha1.RateLimitPolicy, change func(*v1alpha1.RateLimitPolicy)) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
			return err
		}
		change(p)
		return k8s.Update(context.Background(), p)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestReconcileWhenPolicyIsCreatedThenEnforcerObjectsAppearOwnedAndStatusFollowsRollout(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	targetService(t, ns, "api")
	p := newPolicy(ns, "api-limits", "api")
	// The pods the ReplicaSet controller creates wait for a kubelet.
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, v1alpha1.ReasonProgrammed)
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonUnavailable)
	if c := condition(t, p, v1alpha1.ConditionReady); !strings.HasPrefix(c.Message, "0/3 replicas serve revision ") {
		t.Errorf("Ready before any pod runs = %+v, want 0/3 replicas serving", c)
	}
	if s := kstatus(t, p); s != status.InProgressStatus {
		t.Errorf("kstatus before the enforcer is ready = %s, want InProgress", s)
	}

	name := client.ObjectKey{Namespace: ns, Name: "sluice-api-limits"}
	cm, dep, svc, pdb := &corev1.ConfigMap{}, &appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}
	for _, o := range []client.Object{cm, dep, svc, pdb, &corev1.ServiceAccount{}, &rbacv1.Role{}, &rbacv1.RoleBinding{}} {
		if err := k8s.Get(ctx, name, o); err != nil {
			t.Fatalf("%T: %v", o, err)
		}
		refs := o.GetOwnerReferences()
		if len(refs) != 1 || refs[0].UID != p.UID || !ptr.Deref(refs[0].Controller, false) || !ptr.Deref(refs[0].BlockOwnerDeletion, false) {
			t.Errorf("%T owner references = %+v, want one controller reference to the policy", o, refs)
		}
	}
	if _, warnings, err := enforcer.Load([]byte(cm.Data["policy.yaml"])); err != nil || len(warnings) > 0 {
		t.Errorf("the enforcer cannot load the ConfigMap cleanly: %v, warnings %q", err, warnings)
	}
	if p.Status.Enforcer == nil || p.Status.Enforcer.ConfigRevision != cm.Annotations[render.RevisionAnnotation] || p.Status.Enforcer.ServiceName != name.Name || p.Status.Enforcer.Replicas != 3 {
		t.Errorf("status.enforcer = %+v", p.Status.Enforcer)
	}
	var creds *corev1.SecretVolumeSource
	for _, v := range dep.Spec.Template.Spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == "redis-creds" {
			creds = v.Secret
		}
	}
	if creds == nil || len(creds.Items) != 1 || creds.Items[0].Key != "password" || !slices.Contains(dep.Spec.Template.Spec.Containers[0].Args, "--redis-password-file=/etc/sluice-redis-credentials/password") {
		t.Errorf("credentials: volume %+v, args %v; want Secret redis-creds's password mounted and named by --redis-password-file", creds, dep.Spec.Template.Spec.Containers[0].Args)
	}
	for _, v := range cm.Data {
		if len(v) == 0 {
			t.Error("empty config")
		}
	}

	// A kubelet runs the pods: the Deployment controller counts them available, and each
	// enforcer reports the revision it serves.
	runEnforcers(t, ns)
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	if s := kstatus(t, p); s != status.CurrentStatus {
		t.Errorf("kstatus once the enforcer is ready = %s, want Current", s)
	}
	if p.Status.Enforcer.ReadyReplicas != 3 || p.Status.Enforcer.Ready != "3/3" {
		t.Errorf("status.enforcer = %+v, want 3/3 ready", p.Status.Enforcer)
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(dep), dep); err != nil || dep.Status.AvailableReplicas != 3 {
		t.Errorf("Deployment status %+v (%v), want 3 available as the Deployment controller counts them", dep.Status, err)
	}
}

// Events on transitions only: a new policy that rolls out is told once, when it turns Ready after
// a status that said it was on its way. Its first Accepted, Degraded and Ready are the start of
// every policy, not news; each would be one more write to the API server per policy. Its
// enforcers start only once that first status is written (after controllers.ProgressHold).
func TestEventsWhenAPolicyRollsOutThenOnlyReadyIsTold(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "events")
	targetService(t, ns, "api")
	p := newPolicy(ns, "rollout", "api")
	p.Spec.Storage, p.Spec.Enforcer.Replicas = nil, ptr.To[int32](1)
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionReconciling, metav1.ConditionTrue, "")
	runEnforcers(t, ns)
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	var told []string
	// The recorder writes in the order it was given events: once Ready's is there, so is any
	// before it.
	eventually(t, "the Ready event", func() (bool, string) {
		var events eventsv1.EventList
		if err := k8s.List(ctx, &events, client.InNamespace(ns)); err != nil {
			return false, err.Error()
		}
		told = nil
		for _, e := range events.Items {
			if e.Regarding.Kind == "RateLimitPolicy" && e.Regarding.Name == p.Name {
				told = append(told, e.Type+" "+e.Reason+" "+e.Action)
			}
		}
		return slices.Contains(told, "Normal Available Ready"), fmt.Sprint(told)
	})
	if len(told) != 1 {
		t.Errorf("events of a policy that rolled out: %v, want only Normal Available Ready", told)
	}
}

// A second reconcile of an unchanged policy, and of its pool of one, writes nothing: no request
// that changes anything is sent, and no object's resourceVersion moves on the API server.
func TestReconcileWhenNothingChangedThenZeroWrites(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	targetService(t, ns, "api")
	p := newPolicy(ns, "steady", "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	runEnforcers(t, ns)
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, "")

	versions := func() map[string]string {
		out := map[string]string{}
		for _, o := range []client.Object{&corev1.ConfigMap{}, &appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}, &v1alpha1.RateLimitPolicy{}} {
			key := client.ObjectKey{Namespace: ns, Name: "sluice-steady"}
			if _, ok := o.(*v1alpha1.RateLimitPolicy); ok {
				key.Name = "steady"
			}
			if err := k8s.Get(ctx, key, o); err != nil {
				t.Fatal(err)
			}
			out[fmt.Sprintf("%T", o)] = o.GetResourceVersion()
		}
		return out
	}
	before := versions()
	var writes atomic.Int64
	count := func() { writes.Add(1) }
	counting := interceptor.NewClient(noWatch{mgrClient}, interceptor.Funcs{
		Create: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.CreateOption) error {
			count()
			return c.Create(ctx, o, opts...)
		},
		Update: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.UpdateOption) error {
			count()
			return c.Update(ctx, o, opts...)
		},
		Patch: func(ctx context.Context, c client.WithWatch, o client.Object, patch client.Patch, opts ...client.PatchOption) error {
			count()
			return c.Patch(ctx, o, patch, opts...)
		},
		Apply: func(ctx context.Context, c client.WithWatch, o runtime.ApplyConfiguration, opts ...client.ApplyOption) error {
			count()
			return c.Apply(ctx, o, opts...)
		},
		Delete: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.DeleteOption) error {
			count()
			return c.Delete(ctx, o, opts...)
		},
		SubResourcePatch: func(ctx context.Context, c client.Client, sub string, o client.Object, patch client.Patch, opts ...client.SubResourcePatchOption) error {
			count()
			return c.SubResource(sub).Patch(ctx, o, patch, opts...)
		},
		SubResourceUpdate: func(ctx context.Context, c client.Client, sub string, o client.Object, opts ...client.SubResourceUpdateOption) error {
			count()
			return c.SubResource(sub).Update(ctx, o, opts...)
		},
	})
	r := *reconciler
	r.Client = counting
	pools := reconciler.PoolReconciler(counting)
	for range 3 {
		if _, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(p)}); err != nil {
			t.Fatal(err)
		}
		if _, err := pools.Reconcile(ctx, ctrl.Request{NamespacedName: controllers.OneKey(client.ObjectKeyFromObject(p))}); err != nil {
			t.Fatal(err)
		}
	}
	if n := writes.Load(); n != 0 {
		t.Errorf("%d writes in 3 reconciles of an unchanged policy and its pool of one, want 0", n)
	}
	if after := versions(); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("resourceVersions moved: %v -> %v", before, after)
	}
}

func TestReconcileWhenARuleChangesThenConfigAndRevisionFollowAndScalingRollsOut(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	targetService(t, ns, "api")
	p := newPolicy(ns, "change", "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	runEnforcers(t, ns)
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, "")
	dep := &appsv1.Deployment{}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sluice-change"}, dep); err != nil {
		t.Fatal(err)
	}
	oldRevision := p.Status.Enforcer.ConfigRevision
	oldTemplate := dep.Spec.Template.DeepCopy()

	updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) { p.Spec.Rules[0].TokenBucket.Capacity = 20 })
	eventually(t, "a new config revision", func() (bool, string) {
		cm := &corev1.ConfigMap{}
		_ = k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sluice-change"}, cm)
		_ = k8s.Get(ctx, client.ObjectKeyFromObject(p), p)
		rev := cm.Annotations[render.RevisionAnnotation]
		return rev != oldRevision && p.Status.Enforcer.ConfigRevision == rev && p.Status.ObservedGeneration == p.Generation,
			fmt.Sprintf("ConfigMap %s, status %s", rev, p.Status.Enforcer.ConfigRevision)
	})
	// The running pods reload the config: the pod template does not change, so nothing restarts.
	// Ready comes back once every replica reports the new revision.
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(dep), dep); err != nil {
		t.Fatal(err)
	}
	if !equality.Semantic.DeepEqual(oldTemplate, &dep.Spec.Template) {
		t.Errorf("a rule change changed the pod template: every enforcer would restart")
	}
	if dep.Annotations[render.RevisionAnnotation] != p.Status.Enforcer.ConfigRevision {
		t.Errorf("Deployment revision annotation %q, want %q", dep.Annotations[render.RevisionAnnotation], p.Status.Enforcer.ConfigRevision)
	}
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	if c := condition(t, p, v1alpha1.ConditionReady); c.Message != "3/3 replicas serve revision "+p.Status.Enforcer.ConfigRevision {
		t.Errorf("Ready message %q, want every replica serving %s", c.Message, p.Status.Enforcer.ConfigRevision)
	}

	// Scaling up: Ready is False until the Deployment controller and the kubelet have the two
	// new replicas available and serving.
	updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) { p.Spec.Enforcer.Replicas = ptr.To[int32](5) })
	eventually(t, "Ready False while the new replicas start", func() (bool, string) {
		c := condition(t, p, v1alpha1.ConditionReady)
		return c.Status == metav1.ConditionFalse && c.ObservedGeneration == p.Generation, fmt.Sprintf("%+v", c)
	})
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	if p.Status.Enforcer.Ready != "5/5" {
		t.Errorf("status.enforcer.ready %q, want 5/5", p.Status.Enforcer.Ready)
	}
}

// A policy that passed the schema but cannot work (here a leaky bucket whose maxWait is longer
// than its queue takes to drain, which CEL cannot say) is not accepted, with the reason, and
// nothing is deployed for it.
func TestReconcileWhenSpecIsInvalidThenNotAcceptedAndStalled(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	p := newPolicy(ns, "invalid", "api")
	p.Spec.Rules[0] = v1alpha1.Rule{Name: "queue", LeakyBucket: &v1alpha1.LeakyBucket{Capacity: 5,
		Drain: v1alpha1.DrainRate{Requests: 10, Period: "1s"}, MaxWait: ptr.To[v1alpha1.Duration]("1s")}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionAccepted, metav1.ConditionFalse, v1alpha1.ReasonInvalid)
	if c := condition(t, p, v1alpha1.ConditionAccepted); c == nil || !strings.Contains(c.Message, "spec.rules[0].leakyBucket.maxWait") {
		t.Errorf("Accepted message %q does not name the field", c.Message)
	}
	if s := kstatus(t, p); s != status.FailedStatus {
		t.Errorf("kstatus of an invalid policy = %s, want Failed", s)
	}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sluice-invalid"}, &appsv1.Deployment{}); err == nil {
		t.Error("a Deployment exists for an invalid policy")
	}
}

func TestReconcileWhenTwoPoliciesTargetOneServiceThenTheLaterIsConflicted(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	targetService(t, ns, "api")
	first := newPolicy(ns, "first", "api")
	if err := k8s.Create(ctx, first); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, first, v1alpha1.ConditionAccepted, metav1.ConditionTrue, "")
	// Created within the same second or not (timestamps have whole seconds), first is the
	// earlier: a tie breaks by name.
	second := newPolicy(ns, "second", "api")
	if err := k8s.Create(ctx, second); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, second, v1alpha1.ConditionAccepted, metav1.ConditionFalse, v1alpha1.ReasonConflicted)
	eventually(t, "a Conflicted event on the later policy", func() (bool, string) {
		var events eventsv1.EventList
		if err := k8s.List(ctx, &events, client.InNamespace(ns)); err != nil {
			return false, err.Error()
		}
		for _, e := range events.Items {
			if e.Regarding.Name == "second" && e.Reason == v1alpha1.ReasonConflicted && e.Type == corev1.EventTypeWarning {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%d events, none Conflicted for second", len(events.Items))
	})
	if c := condition(t, first, v1alpha1.ConditionAccepted); c.Status != metav1.ConditionTrue {
		t.Errorf("the first policy lost its target: %+v", c)
	}
	if err := k8s.Delete(ctx, first); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, second, v1alpha1.ConditionAccepted, metav1.ConditionTrue, v1alpha1.ReasonAccepted)
}

func TestReconcileWhenTargetServiceIsMissingThenDegradedUntilItAppears(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	p := newPolicy(ns, "orphan", "not-yet")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionDegraded, metav1.ConditionTrue, v1alpha1.ReasonTargetNotFound)
	targetService(t, ns, "not-yet")
	waitCondition(t, p, v1alpha1.ConditionDegraded, metav1.ConditionFalse, v1alpha1.ReasonAsExpected)
}

func TestReconcileWhenRedisStopsAnsweringThenDegradedUntilItIsBack(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	srv := redistest.NewServer(t)
	targetService(t, ns, "api")
	p := newPolicy(ns, "redis-down", "api")
	p.Spec.Storage.Redis.Addresses = []v1alpha1.HostPort{v1alpha1.HostPort(srv.Addr())}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionDegraded, metav1.ConditionFalse, v1alpha1.ReasonAsExpected)
	srv.Kill()
	waitCondition(t, p, v1alpha1.ConditionDegraded, metav1.ConditionTrue, v1alpha1.ReasonRedisUnreachable)
	if msg := condition(t, p, v1alpha1.ConditionDegraded).Message; !strings.Contains(msg, srv.Addr()) || !strings.Contains(msg, "failureMode") {
		t.Errorf("message %q; want the address and what the rules do meanwhile", msg)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionDegraded, metav1.ConditionFalse, v1alpha1.ReasonAsExpected)
}

// Deletion is garbage collection: the policy has no finalizer, every object it renders carries its
// controller reference, and the real garbage collector removes them all, the managed Redis and
// the pods included.
func TestReconcileWhenPolicyIsDeletedThenTheGarbageCollectorRemovesItsObjects(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "ctrl")
	targetService(t, ns, "api")
	p := newPolicy(ns, "doomed", "api")
	p.Spec.Enforcer = nil
	p.Spec.Storage = &v1alpha1.Storage{ManagedRedis: &v1alpha1.ManagedRedis{}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	if len(p.Finalizers) != 0 {
		t.Errorf("finalizers %v: deletion must not wait for the controller", p.Finalizers)
	}
	name, redisName := client.ObjectKey{Namespace: ns, Name: "sluice-doomed"}, client.ObjectKey{Namespace: ns, Name: "sluice-doomed-redis"}
	owned := map[client.Object]client.ObjectKey{
		&corev1.ConfigMap{}: name, &appsv1.Deployment{}: name, &corev1.Service{}: name, &policyv1.PodDisruptionBudget{}: name,
		&corev1.ServiceAccount{}: name, &rbacv1.Role{}: name, &rbacv1.RoleBinding{}: name,
		&appsv1.Deployment{}: redisName, &corev1.Service{}: redisName,
		&corev1.Secret{}: redisName, &policyv1.PodDisruptionBudget{}: redisName, &networkingv1.NetworkPolicy{}: name,
	}
	for o, key := range owned {
		if err := k8s.Get(ctx, key, o); err != nil {
			t.Fatalf("%T %s: %v", o, key.Name, err)
		}
		if ref := metav1.GetControllerOf(o); ref == nil || ref.UID != p.UID || !ptr.Deref(ref.BlockOwnerDeletion, false) {
			t.Errorf("%T %s controller reference %+v, want the policy", o, key.Name, ref)
		}
	}
	redisDep := &appsv1.Deployment{}
	if err := k8s.Get(ctx, redisName, redisDep); err != nil {
		t.Fatal(err)
	}
	args := fmt.Sprint(redisDep.Spec.Template.Spec.Containers[0].Args)
	for _, want := range []string{"--save ", "--appendonly no", "--maxmemory-policy volatile-ttl"} {
		if !strings.Contains(args, want) {
			t.Errorf("managed Redis args %s lack %q", args, want)
		}
	}
	var pods corev1.PodList
	eventually(t, "the ReplicaSet controller's pods", func() (bool, string) {
		err := k8s.List(ctx, &pods, client.InNamespace(ns))
		return err == nil && len(pods.Items) >= 3, fmt.Sprintf("%d pods (%v)", len(pods.Items), err)
	})
	if err := k8s.Delete(ctx, p); err != nil {
		t.Fatal(err)
	}
	eventually(t, "every owned object collected", func() (bool, string) {
		for o, key := range owned {
			if err := k8s.Get(ctx, key, o); !apierrors.IsNotFound(err) {
				return false, fmt.Sprintf("%T %s still there (%v)", o, key.Name, err)
			}
		}
		if err := k8s.List(ctx, &pods, client.InNamespace(ns)); err != nil || len(pods.Items) > 0 {
			return false, fmt.Sprintf("%d pods still there (%v)", len(pods.Items), err)
		}
		return true, ""
	})
}

// noWatch lets the interceptor wrap the manager's cached client, which the reconciler uses for
// everything but watches.
type noWatch struct{ client.Client }

func (noWatch) Watch(context.Context, client.ObjectList, ...client.ListOption) (watch.Interface, error) {
	return nil, errors.New("the reconciler does not watch through its client")
}

// Under steady traffic the counts change at every report, and the status is written at most
// once per report interval (1s here), yet it is written: the counts move. An annotation on the
// policy's ConfigMap changes meanwhile, and each change brings a reconcile that sees new counts:
// many times the writes, if writes were not bounded. The test waits for four writes, however
// long the machine takes to make them, and counts the Service changes between them.
func TestStatusWhenTrafficFlowsThenCountsAreWrittenAtMostOncePerInterval(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "busy")
	targetService(t, ns, "api")
	p := newPolicy(ns, "busy", "api")
	p.Spec.Enforcer.Replicas = ptr.To[int32](1)
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	runEnforcers(t, ns)
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	pods, err := local.EnforcerPods(ctx, k8s, ns, "busy")
	if err != nil || len(pods) != 1 {
		t.Fatalf("%d enforcer pods (%v), want 1", len(pods), err)
	}
	watcher, err := client.NewWithWatch(env.Config, client.Options{Scheme: k8s.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	configs, err := watcher.Watch(ctx, &corev1.ConfigMapList{}, client.InNamespace(ns))
	if err != nil {
		t.Fatal(err)
	}
	defer configs.Stop()
	var changes atomic.Int64 // of the policy's ConfigMap, each a reconcile
	go func() {
		for ev := range configs.ResultChan() {
			if cm, ok := ev.Object.(*corev1.ConfigMap); ok && ev.Type == watch.Modified && cm.Name == "sluice-busy" {
				changes.Add(1)
			}
		}
	}()
	w, err := watcher.Watch(ctx, &v1alpha1.RateLimitPolicyList{}, client.InNamespace(ns))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	type write struct {
		at              time.Time
		allowed, change int64
		// noticed is what a user acts on (conditions, replicas, revision): a change of it is
		// written at once, by design, and only writes that move counts alone are bound.
		noticed string
	}
	const want = 4 // writes in a row that moved counts alone
	var writes []write
	var seen atomic.Int64
	enough := make(chan struct{})
	go func() {
		countsOnly := 0
		for ev := range w.ResultChan() {
			if p, ok := ev.Object.(*v1alpha1.RateLimitPolicy); ok && ev.Type == watch.Modified && countsOnly < want-1 {
				var allowed int64
				if len(p.Status.Rules) == 1 {
					allowed = p.Status.Rules[0].Allowed
				}
				writes = append(writes, write{time.Now(), allowed, changes.Load(), noticed(p)})
				seen.Add(1)
				if n := len(writes); n > 1 && writes[n-1].noticed == writes[n-2].noticed {
					countsOnly++
				} else {
					countsOnly = 0
					writes = writes[n-1:] // a noticeable change starts the run again
				}
				if countsOnly == want-1 {
					close(enough)
				}
			}
		}
	}()
	var driving sync.WaitGroup
	driving.Go(func() {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sluice-busy"}}
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			patch := []byte(fmt.Sprintf(`{"metadata":{"annotations":{"test.sluice.dev/tick":"%d"}}}`, i))
			if err := k8s.Patch(ctx, cm, client.RawPatch(types.MergePatchType, patch)); err != nil {
				t.Error(err)
				return
			}
			select {
			case <-enough:
				return
			case <-t.Context().Done(): // the test failed first
				return
			case <-tick.C:
			}
		}
	})
	driving.Go(func() {
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, local.PodURL(&pods[0], "proxy")+"/", nil)
			req.Header.Set("X-Api-Key", fmt.Sprint("client-", i%50))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				_ = resp.Body.Close()
			}
			select {
			case <-enough:
				return
			case <-t.Context().Done(): // the test failed first
				return
			case <-tick.C:
			}
		}
	})
	select {
	case <-enough:
	case <-time.After(2 * time.Minute):
		t.Fatalf("%d status writes in 2 minutes of traffic, want %d in a row that moved counts alone", seen.Load(), want)
	}
	driving.Wait()
	for i := 1; i < len(writes); i++ {
		if gap := writes[i].at.Sub(writes[i-1].at); gap < 900*time.Millisecond {
			t.Errorf("writes %d and %d %v apart, both %q, want at least the interval", i-1, i, gap, writes[i].noticed)
		}
	}
	first, last := writes[0], writes[len(writes)-1]
	if last.allowed <= first.allowed {
		t.Errorf("status.rules[0].allowed went from %d to %d over %d writes, want the counts to move", first.allowed, last.allowed, want)
	}
	if n := last.change - first.change; n < 2*(want-1) {
		t.Errorf("%d changes of the ConfigMap between the first and the last of %d writes, want at least %d: the bound was not put to the test", n, want, 2*(want-1))
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(p), p); err != nil || len(p.Status.Rules) != 1 || p.Status.Rules[0].Allowed == 0 {
		t.Errorf("status.rules %+v (%v), want the traffic counted", p.Status.Rules, err)
	}
}
