package render

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/settings"
)

// A Pool is a set of enforcers and the policies they serve, rendered by one code: an
// EnforcerPool, whose enforcers serve every policy whose config carries its label, through the
// check API and Envoy's rate limit service; or the pool of one that serves a policy without
// spec.enforcer.poolRef, whose enforcers also proxy to its target. The two differ only in what
// their constructors, PoolOf and OneOf, put in it.
type Pool struct {
	// ID is the EnforcerPool's "<namespace>/<name>", "" for a pool of one: what its policies'
	// status.enforcer.pool says.
	ID string
	// Namespace and Name are those of its objects: the Deployment, the Service clients send to.
	Namespace, Name string
	// Replicas, Image and Storage are its enforcers' (Storage nil: memory).
	Replicas int32
	Image    string
	Storage  *v1alpha1.Storage

	// pool is the EnforcerPool, nil for a pool of one; policy is the pool of one's policy.
	pool   *v1alpha1.EnforcerPool
	policy *v1alpha1.RateLimitPolicy
}

// PoolOf is the EnforcerPool p.
func PoolOf(p *v1alpha1.EnforcerPool, d Defaults) *Pool {
	return &Pool{ID: p.Namespace + "/" + p.Name, Namespace: p.Namespace, Name: PoolName(p), Replicas: PoolReplicas(p),
		Image: PoolImage(p, d), Storage: p.Spec.Storage, pool: p}
}

// OneOf is the pool of one of policy p, shaped by its spec.enforcer and spec.storage.
func OneOf(p *v1alpha1.RateLimitPolicy, d Defaults) *Pool {
	image := d.EnforcerImage
	if e := p.Spec.Enforcer; e != nil && e.Image != "" {
		image = e.Image
	}
	return &Pool{Namespace: p.Namespace, Name: Name(p), Replicas: Replicas(p), Image: image, Storage: p.Spec.Storage, policy: p}
}

// Config renders policy p's config where the pool's enforcers read it, and its revision: in an
// EnforcerPool, a ConfigMap of the pool's namespace labelled with the pool (PoolConfigMap); in
// a pool of one, the ConfigMap its Deployment mounts and its enforcers watch, named as its other
// objects, in which targetRef.appProtocol is the target Service port's when the spec names none
// (target is nil when the Service does not exist).
func (pl *Pool) Config(p *v1alpha1.RateLimitPolicy, target *corev1.Service) (*corev1.ConfigMap, string, error) {
	if pl.pool != nil {
		return PoolConfigMap(p, pl.pool)
	}
	config, err := policyFile(withServiceProtocol(p, target))
	if err != nil {
		return nil, "", err
	}
	rev := report.Revision(config)
	return &corev1.ConfigMap{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: policyOwner(p).meta(pl.Name, policyLabels(p), map[string]string{RevisionAnnotation: rev}),
		Data:       map[string]string{configKey: string(config)},
	}, rev, nil
}

// Objects renders the pool's enforcers: the identity that lets them read their configs, the
// Deployment, its Service, budget and NetworkPolicy, the managed Redis, and a pool of one's
// bypass protection, drawn around its target (nil when the Service does not exist). A pool of
// one's Deployment is annotated with the revision of the config it serves. An error that wraps
// ErrBypassProtection says that no bypass protection can be drawn around the target.
func (pl *Pool) Objects(d Defaults, target *corev1.Service) (*PoolObjects, error) {
	w, c, err := pl.workload(target)
	if err != nil {
		return nil, err
	}
	o := &PoolObjects{}
	o.ServiceAccount, o.Role, o.RoleBinding = w.identity()
	if s := pl.Storage; s != nil && s.Redis != nil {
		c.redis(s.Redis)
	}
	if s := pl.Storage; s != nil && s.ManagedRedis != nil {
		o.RedisDeployment, o.RedisService, o.RedisPDB, o.RedisNetworkPolicy = w.managedRedis(c, s.ManagedRedis, d)
	}
	o.Deployment, o.Service, o.PDB, o.NetworkPolicy = w.enforcer(c, d)
	if pl.policy == nil {
		return o, nil
	}
	o.Bypass, err = Bypass(pl.policy, target)
	return o, err
}

// workload is what the pool's objects are made from, and its enforcer container's arguments
// before those of its store.
func (pl *Pool) workload(target *corev1.Service) (*workload, *pod, error) {
	if pl.pool != nil {
		return poolWorkload(pl), poolPod(pl.pool), nil
	}
	p := withServiceProtocol(pl.policy, target)
	config, err := policyFile(p)
	if err != nil {
		return nil, nil, err
	}
	return oneWorkload(p, pl, report.Revision(config)), enforcerPod(p, pl.Name), nil
}

// PoolName is the name of the pool's objects: "sluice-pool-<pool>", made a DNS-1035 label as
// Name makes a policy's.
func PoolName(p *v1alpha1.EnforcerPool) string { return label("sluice-pool-" + p.Name) }

// PoolAnnotation names the pool on its pods when its name is too long for the pool label.
const PoolAnnotation = "ratelimit.sluice.dev/pool"

// PoolPodLabels are the labels of the pool's enforcer pods, and the selector that finds them:
// the enforcer label every enforcer pod carries, and the pool's, which no policy's pods carry
// (their selector, PodLabels, names an instance that the pool's pods do not).
func PoolPodLabels(p *v1alpha1.EnforcerPool) map[string]string {
	return map[string]string{labelName: EnforcerPodLabelValue, report.PoolLabel: report.LabelValue(p.Name)}
}

// PoolOfPod is the name of the pool whose enforcer runs in pod, or "".
func PoolOfPod(pod metav1.Object) string {
	if pod.GetLabels()[labelName] != EnforcerPodLabelValue || pod.GetLabels()[report.PoolLabel] == "" {
		return ""
	}
	if name := pod.GetAnnotations()[PoolAnnotation]; name != "" {
		return name
	}
	return pod.GetLabels()[report.PoolLabel]
}

// PoolReplicas is the pool's replica count: the spec's, or 1 with memory storage and 2 otherwise.
func PoolReplicas(p *v1alpha1.EnforcerPool) int32 {
	if p.Spec.Replicas != nil {
		return *p.Spec.Replicas
	}
	if s := p.Spec.Storage; s != nil && (s.Redis != nil || s.ManagedRedis != nil) {
		return 2
	}
	return 1
}

// PoolImage is the pool's enforcer image: the spec's, or the manager's default.
func PoolImage(p *v1alpha1.EnforcerPool, d Defaults) string {
	if p.Spec.Image != "" {
		return p.Spec.Image
	}
	return d.EnforcerImage
}

// poolWorkload is an EnforcerPool's: its enforcers serve the check API and Envoy's rate limit
// service for every policy whose ConfigMap carries the pool's label in its namespace, and read
// nothing else.
func poolWorkload(pl *Pool) *workload {
	p := pl.pool
	ports := []corev1.ContainerPort{
		{Name: "check", ContainerPort: CheckPort, Protocol: corev1.ProtocolTCP},
		{Name: "rls", ContainerPort: RLSPort, Protocol: corev1.ProtocolTCP},
		{Name: "admin", ContainerPort: AdminPort, Protocol: corev1.ProtocolTCP},
	}
	servicePorts := []corev1.ServicePort{
		{Name: "check", Port: CheckPort, TargetPort: intstr.FromString("check"), Protocol: corev1.ProtocolTCP},
		// Envoy's rate limit service: gRPC over cleartext HTTP/2, which the name tells meshes.
		{Name: "grpc-rls", Port: RLSPort, TargetPort: intstr.FromString("rls"), Protocol: corev1.ProtocolTCP, AppProtocol: ptr.To("kubernetes.io/h2c")},
		{Name: "metrics", Port: AdminPort, TargetPort: intstr.FromString("admin"), Protocol: corev1.ProtocolTCP},
	}
	var annotations map[string]string
	if report.LabelValue(p.Name) != p.Name {
		annotations = map[string]string{PoolAnnotation: p.Name}
	}
	w := &workload{
		owner: poolOwner(p), name: pl.Name,
		labels: map[string]string{labelName: EnforcerPodLabelValue, report.PoolLabel: report.LabelValue(p.Name), labelManagedBy: "sluice",
			labelComponent: "pool"},
		podLabels: PoolPodLabels(p), podAnnotations: annotations, replicas: pl.Replicas, image: pl.Image,
		redisPodLabels: map[string]string{labelName: "sluice-redis", report.PoolLabel: report.LabelValue(p.Name)},
		resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")},
		},
		ports: ports, servicePorts: servicePorts, checkPorts: []int32{CheckPort, RLSPort},
		// The pool's policies are the ConfigMaps of its namespace that carry its label; RBAC
		// cannot grant by label, so the Role grants the namespace's ConfigMaps, and nothing else:
		// no Secret (the Redis credentials are mounted), nothing of another namespace.
		rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"list", "watch"}}},
	}
	if p.Spec.Resources != nil {
		w.resources = *p.Spec.Resources
	}
	return w
}

// poolPod is what an EnforcerPool says to its enforcers: the pool whose ConfigMaps they serve,
// and their servers.
func poolPod(p *v1alpha1.EnforcerPool) *pod {
	return &pod{args: []string{
		"--pool=" + p.Namespace + "/" + p.Name,
		fmt.Sprintf("--check-listen=:%d", CheckPort),
		fmt.Sprintf("--rls-listen=:%d", RLSPort),
		fmt.Sprintf("--admin-listen=:%d", AdminPort),
		"--shutdown-delay=" + settings.Defaults().ShutdownDelay.String(),
		"--shutdown-timeout=" + settings.Defaults().ShutdownTimeout.String(),
	}}
}

// PoolConfigMapName is the name of a pooled policy's ConfigMap in the pool's namespace:
// "sluice-pool-<pool>.<namespace>.<policy>", cut to fit and always followed by 8 hex digits of
// the hash of the three, so that no two policies of any two pools of a namespace share one.
func PoolConfigMapName(pool string, p *v1alpha1.RateLimitPolicy) string {
	sum := sha256.Sum256([]byte(pool + "/" + p.Namespace + "/" + p.Name))
	suffix := "-" + hex.EncodeToString(sum[:4])
	name := "sluice-pool-" + pool + "." + p.Namespace + "." + p.Name
	if n := validation.DNS1123SubdomainMaxLength - len(suffix); len(name) > n {
		name = name[:n]
	}
	return strings.TrimRight(name, "-.") + suffix
}

// PolicyUIDAnnotation records, on a pooled policy's ConfigMap, the UID of the policy it holds:
// the pool's controller removes the ConfigMaps of policies that no longer exist, and a policy
// of the same name created again is another policy.
const PolicyUIDAnnotation = "ratelimit.sluice.dev/policy-uid"

// PoolConfigMap is a pooled policy's config, in the pool's namespace, labelled with the pool for
// its enforcers to find and controlled by the pool, so that it goes with the pool; the policy
// lives in another namespace, or may, and no owner reference can cross namespaces. It returns
// the config's revision.
func PoolConfigMap(p *v1alpha1.RateLimitPolicy, pool *v1alpha1.EnforcerPool) (*corev1.ConfigMap, string, error) {
	config, err := policyFile(p)
	if err != nil {
		return nil, "", err
	}
	rev := report.Revision(config)
	labels := map[string]string{report.PoolLabel: report.LabelValue(pool.Name), labelManagedBy: "sluice", labelComponent: "pool-policy"}
	annotations := map[string]string{report.PolicyAnnotation: p.Namespace + "/" + p.Name, PolicyUIDAnnotation: string(p.UID), RevisionAnnotation: rev}
	return &corev1.ConfigMap{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: poolOwner(pool).meta(PoolConfigMapName(pool.Name, p), labels, annotations),
		Data:       map[string]string{report.PolicyFileKey: string(config)},
	}, rev, nil
}

// PolicyRevision is the revision of the config a policy renders, own or pooled: the same file.
func PolicyRevision(p *v1alpha1.RateLimitPolicy) (string, error) {
	config, err := policyFile(p)
	if err != nil {
		return "", err
	}
	return report.Revision(config), nil
}
