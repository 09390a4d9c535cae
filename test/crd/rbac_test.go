package crd_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// Namespace users manage policies with the built-in roles a RoleBinding gives them: config/'s
// ClusterRoles aggregate into admin, edit and view, as the real clusterrole-aggregation
// controller of kube-controller-manager fills them in, and the API server's RBAC authorizer
// decides requests made as those users.
func TestRolesWhenANamespaceEditorAndViewerActThenTheBuiltInRolesGrantPolicies(t *testing.T) {
	tier.Needs(t, "the test control plane and kustomize")
	ctx := context.Background()
	admin := env.Client // TestMain's control plane runs the aggregation controller

	// The users' ClusterRoles exactly as make deploy installs them.
	out, err := kustomizeBuild("config/default")
	if err != nil {
		t.Fatal(err)
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	installed := 0
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		aggregated := false
		for label := range u.GetLabels() {
			aggregated = aggregated || strings.HasPrefix(label, "rbac.authorization.k8s.io/aggregate-to-")
		}
		if u.GetKind() != "ClusterRole" || !aggregated {
			continue
		}
		if err := admin.Create(ctx, u); err != nil {
			t.Fatal(err)
		}
		installed++
	}
	if installed != 4 {
		t.Fatalf("config/default has %d ClusterRoles that aggregate into the built-in roles, want 4 (editor and viewer of policies and of pools)", installed)
	}

	for _, name := range []string{"team-a", "team-b"} {
		if err := admin.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}); err != nil {
			t.Fatal(err)
		}
	}
	users := map[string]string{"ann": "admin", "jane": "edit", "joe": "view"}
	for user, role := range users {
		rb := &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: user},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: user}},
		}
		if err := admin.Create(ctx, rb); err != nil {
			t.Fatal(err)
		}
	}
	as := func(user string) client.WithWatch {
		cfg := rest.CopyConfig(env.Config)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: user}
		c, err := client.NewWithWatch(cfg, client.Options{Scheme: clientgoscheme.Scheme})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	// The aggregation controller fills the built-in roles in a moment after the ClusterRoles
	// appear: wait until each user may list the namespace's policies.
	for user := range users {
		poll.WaitFor(t, 30*time.Second, func() error {
			if err := as(user).List(ctx, &v1alpha1.RateLimitPolicyList{}, client.InNamespace("team-a")); err != nil {
				return fmt.Errorf("%s (%s in team-a) cannot list policies: %w", user, users[user], err)
			}
			return nil
		})
	}

	policy := func(ns, name string) *v1alpha1.RateLimitPolicy {
		return &v1alpha1.RateLimitPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: v1alpha1.RateLimitPolicySpec{
				TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080},
				Rules: []v1alpha1.Rule{{Name: "all", Key: []v1alpha1.KeySource{{Type: v1alpha1.KeyRemoteAddress}},
					FixedWindow: &v1alpha1.Window{Limit: 10, Window: "1m"}}},
			},
		}
	}
	allowed := func(t *testing.T, what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v, want it allowed", what, err)
		}
	}
	forbidden := func(t *testing.T, what string, err error) {
		t.Helper()
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s: %v, want Forbidden", what, err)
		}
	}

	for _, user := range []string{"jane", "ann"} {
		t.Run(fmt.Sprintf("when %s (%s) manages the namespace's policies then every write is allowed there and nowhere else", user, users[user]), func(t *testing.T) {
			c := as(user)
			p := policy("team-a", "by-"+user)
			allowed(t, "create", c.Create(ctx, p))
			allowed(t, "get", c.Get(ctx, client.ObjectKeyFromObject(p), p))
			p.Spec.Rules[0].FixedWindow.Limit = 20
			allowed(t, "update", c.Update(ctx, p))
			allowed(t, "patch", c.Patch(ctx, p, client.RawPatch("application/merge-patch+json", []byte(`{"metadata":{"labels":{"team":"a"}}}`))))
			p.Status.Limited = "1%"
			forbidden(t, "update status (the manager's to write)", c.Status().Update(ctx, p))
			allowed(t, "delete", c.Delete(ctx, p))
			forbidden(t, "create in team-b", c.Create(ctx, policy("team-b", "by-"+user)))
			forbidden(t, "list in team-b", c.List(ctx, &v1alpha1.RateLimitPolicyList{}, client.InNamespace("team-b")))

			pool := &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "pool-by-" + user}}
			allowed(t, "create a pool", c.Create(ctx, pool))
			pool.Spec.Image = "example.com/enforcer:2"
			allowed(t, "update a pool", c.Update(ctx, pool))
			pool.Status.Ready = "9/9"
			forbidden(t, "update a pool's status (the manager's to write)", c.Status().Update(ctx, pool))
			allowed(t, "delete a pool", c.Delete(ctx, pool))
			forbidden(t, "create a pool in team-b", c.Create(ctx, &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team-b", Name: "pool-by-" + user}}))
		})
	}

	t.Run("when joe (view) reads the namespace's policies then reads are allowed and writes forbidden", func(t *testing.T) {
		existing := policy("team-a", "existing")
		if err := admin.Create(ctx, existing); err != nil {
			t.Fatal(err)
		}
		c := as("joe")
		p := &v1alpha1.RateLimitPolicy{}
		allowed(t, "get", c.Get(ctx, client.ObjectKeyFromObject(existing), p))
		var list v1alpha1.RateLimitPolicyList
		allowed(t, "list", c.List(ctx, &list, client.InNamespace("team-a")))
		if len(list.Items) != 1 {
			t.Errorf("listed %d policies, want 1", len(list.Items))
		}
		w, err := c.Watch(ctx, &v1alpha1.RateLimitPolicyList{}, client.InNamespace("team-a"))
		allowed(t, "watch", err)
		if err == nil {
			w.Stop()
		}
		forbidden(t, "create", c.Create(ctx, policy("team-a", "by-joe")))
		p.Spec.Rules[0].FixedWindow.Limit = 1
		forbidden(t, "update", c.Update(ctx, p))
		forbidden(t, "delete", c.Delete(ctx, existing))
		forbidden(t, "get in team-b", c.Get(ctx, client.ObjectKey{Namespace: "team-b", Name: "existing"}, p))

		pool := &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "existing"}}
		if err := admin.Create(ctx, pool); err != nil {
			t.Fatal(err)
		}
		allowed(t, "get a pool", c.Get(ctx, client.ObjectKeyFromObject(pool), pool))
		allowed(t, "list pools", c.List(ctx, &v1alpha1.EnforcerPoolList{}, client.InNamespace("team-a")))
		forbidden(t, "create a pool", c.Create(ctx, &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "by-joe"}}))
		forbidden(t, "delete a pool", c.Delete(ctx, pool))
	})
}

func kustomizeBuild(overlay string) ([]byte, error) {
	cmd := exec.Command("go", "tool", "-modfile=hack/tools/go.mod", "kustomize", "build", overlay)
	cmd.Dir = testenv.RepoRoot()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w: %s", overlay, err, stderr.String())
	}
	return out, nil
}
