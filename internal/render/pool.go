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
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/settings"
)

// PoolObjects are the desired objects of one EnforcerPool, in apply order: its Workload, whose
// Service has the check, RLS and admin ports and no proxy. The policies' configs are not among
// them: each policy renders its own (PoolConfigMap).
type PoolObjects struct {
	Workload
}

// All are the objects that exist for the pool.
func (o *PoolObjects) All() []client.Object { return o.objects() }

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

// Pool renders the pool's objects: its enforcers serve the check API and Envoy's rate limit
// service for every policy whose ConfigMap carries the pool's label in its namespace, and read
// nothing else.
func Pool(p *v1alpha1.EnforcerPool, d Defaults) *PoolObjects {
	name := PoolName(p)
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
		owner: poolOwner(p), name: name,
		labels: map[string]string{labelName: EnforcerPodLabelValue, report.PoolLabel: report.LabelValue(p.Name), labelManagedBy: "sluice",
			labelComponent: "pool"},
		podLabels: PoolPodLabels(p), podAnnotations: annotations, replicas: PoolReplicas(p), image: PoolImage(p, d),
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
	o := &PoolObjects{}
	o.ServiceAccount, o.Role, o.RoleBinding = w.identity()
	c := &pod{args: []string{
		"--pool=" + p.Namespace + "/" + p.Name,
		fmt.Sprintf("--check-listen=:%d", CheckPort),
		fmt.Sprintf("--rls-listen=:%d", RLSPort),
		fmt.Sprintf("--admin-listen=:%d", AdminPort),
		"--shutdown-delay=" + settings.Defaults().ShutdownDelay.String(),
		"--shutdown-timeout=" + settings.Defaults().ShutdownTimeout.String(),
	}}
	if s := p.Spec.Storage; s != nil && s.Redis != nil {
		c.redis(s.Redis)
	}
	if s := p.Spec.Storage; s != nil && s.ManagedRedis != nil {
		o.RedisDeployment, o.RedisService, o.RedisPDB, o.RedisNetworkPolicy = w.managedRedis(c, s.ManagedRedis, d,
			map[string]string{labelName: "sluice-redis", report.PoolLabel: report.LabelValue(p.Name)})
	}
	o.Deployment, o.Service, o.PDB, o.NetworkPolicy = w.enforcer(c, d)
	return o
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
