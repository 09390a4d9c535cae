package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mattfenwick/cyclonus/pkg/matcher"
	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/redistest"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// mountSecret writes the Secret's keys into a directory as a kubelet mounts a Secret volume
// (items, when given, map keys to paths), and returns the directory.
func mountSecret(t *testing.T, s *corev1.Secret, items []corev1.KeyToPath) string {
	t.Helper()
	dir := t.TempDir()
	if len(items) == 0 {
		for k := range s.Data {
			items = append(items, corev1.KeyToPath{Key: k, Path: k})
		}
	}
	for _, it := range items {
		if err := os.WriteFile(filepath.Join(dir, it.Path), s.Data[it.Key], 0o400); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// mountOf finds the volume mounted at a directory of c and returns it.
func mountOf(t *testing.T, pod *corev1.PodSpec, c *corev1.Container, dir string) *corev1.Volume {
	t.Helper()
	for _, m := range c.VolumeMounts {
		if m.MountPath == dir {
			for i := range pod.Volumes {
				if pod.Volumes[i].Name == m.Name {
					return &pod.Volumes[i]
				}
			}
		}
	}
	t.Fatalf("nothing mounted at %s in container %s", dir, c.Name)
	return nil
}

// The managed Redis asks for a password that the controller generates once, into a Secret it
// owns and keeps across reconciles; the Redis config and the enforcer's password file come from
// it. Only the enforcer pods may reach it. A real redis-server started with the rendered arguments and config refuses a client
// without the password and answers one with the enforcer's file, and the rendered readiness
// probe passes only with the right password. A disruption budget covers the Redis pod.
func TestManagedRedisWhenProgrammedThenAGeneratedPasswordGuardsItAndTheEnforcerHoldsIt(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "mredis")
	targetService(t, ns, "api")
	p := newPolicy(ns, "cache", "api")
	p.Spec.Storage = &v1alpha1.Storage{ManagedRedis: &v1alpha1.ManagedRedis{}}
	p.Spec.Enforcer = nil
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
	name := render.RedisName(render.Name(p))
	key := client.ObjectKey{Namespace: ns, Name: name}
	secret := &corev1.Secret{}
	if err := k8s.Get(ctx, key, secret); err != nil {
		t.Fatal(err)
	}
	password := string(secret.Data[render.RedisPasswordKey])
	if !regexp.MustCompile(`^[0-9a-f]{64}$`).MatchString(password) || !metav1.IsControlledBy(secret, p) {
		t.Fatalf("Secret %s: password %q, owner %v; want 256 random bits in hex, controlled by the policy", name, password, secret.OwnerReferences)
	}

	redisDep, enforcerDep := &appsv1.Deployment{}, &appsv1.Deployment{}
	if err := k8s.Get(ctx, key, redisDep); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: render.Name(p)}, enforcerDep); err != nil {
		t.Fatal(err)
	}
	t.Run("when the Redis pod is disrupted then a budget keeps it", func(t *testing.T) {
		pdb := &policyv1.PodDisruptionBudget{}
		if err := k8s.Get(ctx, key, pdb); err != nil {
			t.Fatal(err)
		}
		if pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.IntValue() != 1 ||
			!metav1.IsControlledBy(pdb, p) || !equalLabels(pdb.Spec.Selector.MatchLabels, redisDep.Spec.Template.Labels) {
			t.Errorf("PodDisruptionBudget %+v, want minAvailable 1 over the Redis pods, controlled by the policy", pdb.Spec)
		}
	})

	// Redis as its pod would run it: the Secret mounted where the container reads it, and the
	// container's arguments, with the mount's directory where the test put the files.
	rc := &redisDep.Spec.Template.Spec.Containers[0]
	redisDir := mountSecret(t, secret, mountOf(t, &redisDep.Spec.Template.Spec, rc, render.RedisConfigDir).Secret.Items)
	local := func(s string) string { return strings.ReplaceAll(s, render.RedisConfigDir, redisDir) }
	if len(rc.Args) == 0 || !strings.HasPrefix(rc.Args[0], render.RedisConfigDir+"/") {
		t.Fatalf("Redis args %q do not start with the config file", rc.Args)
	}
	srv := redistest.NewServerWithConfig(t, local(rc.Args[0]), rc.Args[1:]...)

	// The enforcer's password file, as its pod mounts it.
	ec := &enforcerDep.Spec.Template.Spec.Containers[0]
	i := slices.IndexFunc(ec.Args, func(a string) bool { return strings.HasPrefix(a, "--redis-password-file=") })
	if i < 0 {
		t.Fatalf("enforcer args %q have no --redis-password-file", ec.Args)
	}
	file := strings.TrimPrefix(ec.Args[i], "--redis-password-file=")
	vol := mountOf(t, &enforcerDep.Spec.Template.Spec, ec, filepath.Dir(file))
	if vol.Secret == nil || vol.Secret.SecretName != name {
		t.Fatalf("the enforcer's password file comes from %+v, want Secret %s", vol.VolumeSource, name)
	}
	enforcerPassword, err := os.ReadFile(filepath.Join(mountSecret(t, secret, vol.Secret.Items), filepath.Base(file)))
	if err != nil {
		t.Fatal(err)
	}

	t.Run("when a client has no password then Redis refuses it", func(t *testing.T) {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
		defer func() { _ = c.Close() }()
		if err := c.Set(ctx, "k", "v", time.Minute).Err(); err == nil || !strings.HasPrefix(err.Error(), "NOAUTH") {
			t.Errorf("SET without a password: %v, want NOAUTH", err)
		}
	})
	t.Run("when the enforcer's password file is used then Redis answers", func(t *testing.T) {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr(), Password: string(enforcerPassword)})
		defer func() { _ = c.Close() }()
		if err := c.Set(ctx, "k", "v", time.Minute).Err(); err != nil {
			t.Errorf("SET with the enforcer's password: %v", err)
		}
	})
	probe := func(t *testing.T, dir string) error {
		t.Helper()
		cmd := rc.ReadinessProbe.Exec.Command
		args := make([]string, len(cmd))
		for i, a := range cmd {
			a = strings.ReplaceAll(a, render.RedisConfigDir, dir)
			args[i] = strings.ReplaceAll(a, fmt.Sprintf("-p %d", render.RedisPort), fmt.Sprintf("-p %d", srv.Port))
		}
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}
	t.Run("when the readiness probe runs with the mounted password then it passes", func(t *testing.T) {
		if rc.ReadinessProbe == nil || rc.ReadinessProbe.Exec == nil {
			t.Fatalf("readiness probe %+v, want an exec of redis-cli", rc.ReadinessProbe)
		}
		if err := probe(t, redisDir); err != nil {
			t.Errorf("probe failed: %v", err)
		}
	})
	t.Run("when the readiness probe runs with another password then it fails", func(t *testing.T) {
		wrong := t.TempDir()
		if err := os.WriteFile(filepath.Join(wrong, render.RedisPasswordKey), []byte("not-"+password), 0o400); err != nil {
			t.Fatal(err)
		}
		if err := probe(t, wrong); err == nil {
			t.Error("probe passed with a wrong password")
		}
	})

	t.Run("when a pod other than the enforcer's sends to Redis then the NetworkPolicy refuses it", func(t *testing.T) {
		engine, _ := analyze(t, ns)
		redisPod := &matcher.TrafficPeer{IP: "10.0.0.3", Internal: &matcher.InternalPeer{
			Namespace: ns, NamespaceLabels: map[string]string{render.NamespaceNameLabel: ns}, PodLabels: redisDep.Spec.Template.Labels,
		}}
		for _, c := range []struct {
			name string
			from *matcher.TrafficPeer
			want bool
		}{
			{"the enforcer", podPeer(t, enforcerPod(t, p)), true},
			{"another pod of the namespace", namespacePeer(t, "", ns, map[string]string{"app": "curious"}).from, false},
		} {
			if got := traffic(engine, c.from, redisPod, render.RedisPort, corev1.ProtocolTCP); got.IsAllowed() != c.want {
				t.Errorf("%s to Redis: allowed = %v, want %v\n%s", c.name, got.IsAllowed(), c.want, got.Table())
			}
		}
	})
	t.Run("when the policy changes and the Redis Deployment is deleted then the password stays", func(t *testing.T) {
		updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) { p.Spec.Rules[0].TokenBucket.Capacity = 20 })
		waitCondition(t, p, v1alpha1.ConditionProgrammed, metav1.ConditionTrue, "")
		if err := k8s.Delete(ctx, redisDep); err != nil {
			t.Fatal(err)
		}
		poll.WaitFor(t, 10*time.Second, func() error {
			d := &appsv1.Deployment{}
			if err := k8s.Get(ctx, key, d); err != nil {
				return err
			}
			if d.UID == redisDep.UID {
				return errors.New("the Redis Deployment is not created again yet")
			}
			return nil
		})
		again := &corev1.Secret{}
		if err := k8s.Get(ctx, key, again); err != nil {
			t.Fatal(err)
		}
		if string(again.Data[render.RedisPasswordKey]) != password || again.ResourceVersion != secret.ResourceVersion {
			t.Errorf("the Secret changed (resourceVersion %s to %s)", secret.ResourceVersion, again.ResourceVersion)
		}
	})
	t.Run("when the Secret is deleted then a new password is generated and Redis restarts with it", func(t *testing.T) {
		before := redisDep.Spec.Template.Annotations[render.RedisPasswordAnnotation]
		if err := k8s.Delete(ctx, secret); err != nil {
			t.Fatal(err)
		}
		poll.WaitFor(t, 10*time.Second, func() error {
			s, d := &corev1.Secret{}, &appsv1.Deployment{}
			if err := k8s.Get(ctx, key, s); err != nil {
				return err
			}
			if err := k8s.Get(ctx, key, d); err != nil {
				return err
			}
			if string(s.Data[render.RedisPasswordKey]) == password || len(s.Data[render.RedisPasswordKey]) != 64 {
				return errors.New("no new password yet")
			}
			if d.Spec.Template.Annotations[render.RedisPasswordAnnotation] == before {
				return errors.New("the Redis pod template does not follow the new password yet")
			}
			return nil
		})
	})
	t.Run("when storage moves to memory then the Secret and the budget are deleted", func(t *testing.T) {
		updateSpec(t, p, func(p *v1alpha1.RateLimitPolicy) { p.Spec.Storage = nil })
		poll.WaitFor(t, 10*time.Second, func() error {
			for _, o := range []client.Object{&corev1.Secret{}, &policyv1.PodDisruptionBudget{}, &networkingv1.NetworkPolicy{}} {
				if err := k8s.Get(ctx, key, o); !apierrors.IsNotFound(err) {
					return fmt.Errorf("%T still there (%w)", o, err)
				}
			}
			return nil
		})
	})
}

func equalLabels(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}
