// Package render turns a pool, an EnforcerPool or a policy's pool of one, into the objects of its
// enforcers, and a policy into its config where its pool reads it. It is pure: the same policy,
// pool, target Service and defaults give the same objects, which golden files in testdata pin.
package render

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/settings"
)

// Ports of the enforcer container and Service (the enforcer's own, from settings), and of a
// managed Redis.
const (
	ProxyPort = settings.ProxyPort
	CheckPort = settings.CheckPort
	RLSPort   = settings.RLSPort
	AdminPort = settings.AdminPort
	RedisPort = 6379
)

// PolicyFile is where the enforcer reads its policy: the ConfigMap's one key, mounted.
const (
	configKey  = "policy.yaml"
	configDir  = "/etc/sluice"
	PolicyFile = configDir + "/" + configKey
	redisCADir = "/etc/sluice-redis-ca"
	// redisCredentialsDir holds the files of storage.redis.credentialsSecretRef.
	redisCredentialsDir = "/etc/sluice-redis-credentials"
	// upstreamCADir holds the CA bundle of targetRef.tls.caSecretRef.
	upstreamCADir = "/etc/sluice-upstream-ca"
	// upstreamClientDir holds the client certificate of targetRef.tls.clientCertificateSecretRef.
	upstreamClientDir = "/etc/sluice-upstream-client"
)

// gracePeriod is the enforcer pod's: its stop on SIGTERM serves on with /readyz failing for
// the shutdown delay, while endpoints drop the pod, then drains for up to the shutdown timeout.
// The grace period covers both, with a margin, so the kubelet never kills a drain that keeps its
// promise.
func gracePeriod() time.Duration {
	d := settings.Defaults()
	return d.ShutdownDelay + d.ShutdownTimeout + 5*time.Second
}

// Annotations and labels.
const (
	// RevisionAnnotation records the config revision rendered into the ConfigMap and the
	// Deployment, for people reading them; readiness comes from what the replicas report.
	RevisionAnnotation = "ratelimit.sluice.dev/config-revision"
	// PolicyAnnotation names the policy on the pods of a policy whose name is too long for a
	// label value, where the instance label holds a digest of it.
	PolicyAnnotation = "ratelimit.sluice.dev/policy"
	labelName        = "app.kubernetes.io/name"
	labelInstance    = "app.kubernetes.io/instance"
	labelComponent   = "app.kubernetes.io/component"
	labelManagedBy   = "app.kubernetes.io/managed-by"
)

// Defaults are the manager's settings that policies may override, and those that shape every
// policy's objects.
type Defaults struct {
	EnforcerImage string
	RedisImage    string
	// NetworkPolicy, when set, renders a NetworkPolicy that admits traffic to the enforcer pods
	// port by port; nil renders none.
	NetworkPolicy *NetworkPolicyDefaults
}

// NetworkPolicyDefaults say which namespaces may reach which port of the enforcer pods. Every
// list holds namespace names.
type NetworkPolicyDefaults struct {
	// ManagerNamespace is the manager's namespace, whose pods read the admin port's /report.
	ManagerNamespace string
	// MonitoringNamespaces may reach the admin port too (Prometheus scrapes /metrics there).
	MonitoringNamespaces []string
	// CheckNamespaces may reach the check and RLS ports (gateways that ask for decisions),
	// besides the policy's own namespace.
	CheckNamespaces []string
	// ProxyNamespaces alone may reach the proxy port; empty means any source, in or outside the
	// cluster.
	ProxyNamespaces []string
}

// PoolObjects are the desired objects of one pool's enforcers, in apply order (see All): an
// EnforcerPool's, or a policy's pool of one, whose Service has the proxy port for its target.
// The policies' configs are not among them: each policy renders its own (Pool.Config).
type PoolObjects struct {
	Workload
	// Bypass keeps clients from reaching the target's pods around a pool of one's proxy; nil
	// without targetRef.bypassProtection, without the target Service, and in an EnforcerPool,
	// whose gateway reaches the Service itself. See Bypass.
	Bypass *networkingv1.NetworkPolicy
}

// Workload are the objects of a set of enforcers, a policy's own or a pool's.
type Workload struct {
	// ServiceAccount, Role and RoleBinding let the enforcers list and watch the ConfigMaps they
	// serve: a policy's own, or those of the pool's namespace labelled with the pool.
	ServiceAccount *corev1.ServiceAccount
	Role           *rbacv1.Role
	RoleBinding    *rbacv1.RoleBinding
	Deployment     *appsv1.Deployment
	Service        *corev1.Service
	// PDB is nil with one replica.
	PDB *policyv1.PodDisruptionBudget
	// NetworkPolicy admits traffic to the enforcer pods; nil when Defaults.NetworkPolicy is.
	NetworkPolicy *networkingv1.NetworkPolicy
	// Redis objects are nil without managedRedis. RedisSecret holds its password, which the
	// controller generates once and keeps: see WithRedisPassword, which sets it.
	RedisDeployment *appsv1.Deployment
	RedisService    *corev1.Service
	RedisPDB        *policyv1.PodDisruptionBudget
	RedisSecret     *corev1.Secret
	// RedisNetworkPolicy admits the managed Redis's port from the enforcer pods alone; nil when
	// Defaults.NetworkPolicy is.
	RedisNetworkPolicy *networkingv1.NetworkPolicy
}

// objects are the workload's objects that exist, in apply order.
func (w *Workload) objects() []client.Object {
	objs := []client.Object{w.ServiceAccount, w.Role, w.RoleBinding}
	if w.NetworkPolicy != nil {
		objs = append(objs, w.NetworkPolicy)
	}
	if w.RedisSecret != nil {
		objs = append(objs, w.RedisSecret)
	}
	if w.RedisService != nil {
		objs = append(objs, w.RedisDeployment, w.RedisService, w.RedisPDB)
	}
	if w.RedisNetworkPolicy != nil {
		objs = append(objs, w.RedisNetworkPolicy)
	}
	objs = append(objs, w.Deployment, w.Service)
	if w.PDB != nil {
		objs = append(objs, w.PDB)
	}
	return objs
}

// All are the objects that exist for the pool.
func (o *PoolObjects) All() []client.Object {
	objs := o.objects()
	if o.Bypass != nil {
		objs = append(objs, o.Bypass)
	}
	return objs
}

// Name is the name of the policy's enforcer objects: "sluice-<policy>" when that is a DNS-1035
// label, as a Service name must be; otherwise a label made from it (see label).
func Name(p *v1alpha1.RateLimitPolicy) string { return label("sluice-" + p.Name) }

// label returns name if it is a DNS-1035 label. Otherwise, as for a policy named "shop.v2" or
// one too long, it turns dots into dashes, cuts the name to leave room, and appends "-" and 8
// hex digits of the SHA-256 of name: the result is a valid label, stable, and unique however
// similar two names are.
func label(name string) string {
	if len(validation.IsDNS1035Label(name)) == 0 {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	suffix := "-" + hex.EncodeToString(sum[:4])
	clean := strings.ReplaceAll(name, ".", "-")
	if n := validation.DNS1035LabelMaxLength - len(suffix); len(clean) > n {
		clean = clean[:n]
	}
	return strings.TrimRight(clean, "-") + suffix
}

// ServesRLS reports whether the policy asks for Envoy's rate limit service.
func ServesRLS(p *v1alpha1.RateLimitPolicy) bool {
	return p.Spec.Enforcer != nil && p.Spec.Enforcer.RateLimitService != nil && p.Spec.Enforcer.RateLimitService.Enabled
}

// containerPorts are the enforcer container's ports; rls adds Envoy's rate limit service's.
func containerPorts(rls bool) []corev1.ContainerPort {
	ports := []corev1.ContainerPort{
		{Name: "proxy", ContainerPort: ProxyPort, Protocol: corev1.ProtocolTCP},
		{Name: "check", ContainerPort: CheckPort, Protocol: corev1.ProtocolTCP},
	}
	if rls {
		ports = append(ports, corev1.ContainerPort{Name: "rls", ContainerPort: RLSPort, Protocol: corev1.ProtocolTCP})
	}
	return append(ports, corev1.ContainerPort{Name: "admin", ContainerPort: AdminPort, Protocol: corev1.ProtocolTCP})
}

// servicePorts are the enforcer Service's ports, as containerPorts.
func servicePorts(rls bool) []corev1.ServicePort {
	ports := []corev1.ServicePort{
		{Name: "proxy", Port: ProxyPort, TargetPort: intstr.FromString("proxy"), Protocol: corev1.ProtocolTCP},
		{Name: "check", Port: CheckPort, TargetPort: intstr.FromString("check"), Protocol: corev1.ProtocolTCP},
	}
	if rls {
		// Envoy's rate limit service: gRPC over cleartext HTTP/2, which the name tells meshes.
		ports = append(ports, corev1.ServicePort{Name: "grpc-rls", Port: RLSPort, TargetPort: intstr.FromString("rls"), Protocol: corev1.ProtocolTCP, AppProtocol: ptr.To("kubernetes.io/h2c")})
	}
	return append(ports, corev1.ServicePort{Name: "metrics", Port: AdminPort, TargetPort: intstr.FromString("admin"), Protocol: corev1.ProtocolTCP})
}

// RedisName is the name of the managed Redis Deployment and Service of the enforcer objects
// named name.
func RedisName(name string) string { return label(name + "-redis") }

// The label that every enforcer pod carries.
const (
	EnforcerPodLabelKey   = labelName
	EnforcerPodLabelValue = "sluice-enforcer"
)

// PodLabels are the labels of the policy's enforcer pods, and the selector that finds them.
func PodLabels(p *v1alpha1.RateLimitPolicy) map[string]string {
	return map[string]string{labelName: EnforcerPodLabelValue, labelInstance: LabelValue(p.Name)}
}

// LabelValue is name if it fits a label value, which holds at most 63 characters, as every
// policy name of up to 63 does (names and label values share their alphabet). A longer name, up
// to the 253 of an object name, is cut to leave room and followed by "-" and 8 hex digits of its
// SHA-256, as cluster-api's util/labels/format does: valid, stable, and distinct for names that
// share their first 54 characters.
func LabelValue(name string) string { return report.LabelValue(name) }

// PolicyOfPod is the name of the policy whose enforcer runs in pod, or "": from its annotation
// when the name is too long for the instance label, else from the label.
func PolicyOfPod(pod metav1.Object) string {
	if pod.GetLabels()[labelName] != EnforcerPodLabelValue {
		return ""
	}
	if name := pod.GetAnnotations()[PolicyAnnotation]; name != "" {
		return name
	}
	return pod.GetLabels()[labelInstance]
}

// podAnnotations carry the policy's name when the labels cannot. A name that fits a label adds
// none, so the pod template of existing policies stays as it was and nothing rolls out.
func podAnnotations(p *v1alpha1.RateLimitPolicy) map[string]string {
	if LabelValue(p.Name) == p.Name {
		return nil
	}
	return map[string]string{PolicyAnnotation: p.Name}
}

// Replicas is the enforcer's replica count: the spec's, or 1 with memory storage and 2 otherwise.
func Replicas(p *v1alpha1.RateLimitPolicy) int32 {
	if p.Spec.Enforcer != nil && p.Spec.Enforcer.Replicas != nil {
		return *p.Spec.Enforcer.Replicas
	}
	if s := p.Spec.Storage; s != nil && (s.Redis != nil || s.ManagedRedis != nil) {
		return 2
	}
	return 1
}

// upstreamArg is the --upstream flag: the target Service's DNS name and port, in the scheme of
// its appProtocol (http when absent).
func upstreamArg(p *v1alpha1.RateLimitPolicy) string {
	scheme := string(p.Spec.TargetRef.AppProtocol)
	if scheme == "" {
		scheme = string(v1alpha1.AppProtocolHTTP)
	}
	return fmt.Sprintf("--upstream=%s://%s.%s.svc:%d", scheme, p.Spec.TargetRef.Name, p.Namespace, p.Spec.TargetRef.Port)
}

// oneWorkload is a pool of one's: its enforcers proxy to the target of p, serve the check API
// (and Envoy's rate limit service when p asks), and read p's ConfigMap alone.
func oneWorkload(p *v1alpha1.RateLimitPolicy, pl *Pool, revision string) *workload {
	rls := ServesRLS(p)
	w := &workload{
		owner: policyOwner(p), name: pl.Name, labels: policyLabels(p),
		podLabels: PodLabels(p), podAnnotations: podAnnotations(p), replicas: pl.Replicas, image: pl.Image,
		redisPodLabels: map[string]string{labelName: "sluice-redis", labelInstance: LabelValue(p.Name)},
		resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi")},
		},
		ports: containerPorts(rls), servicePorts: servicePorts(rls), checkPorts: []int32{CheckPort}, proxy: true, revision: revision, config: true,
		// The enforcer watches its ConfigMap through the API server and may read nothing else.
		rules: []rbacv1.PolicyRule{{
			APIGroups: []string{""}, Resources: []string{"configmaps"}, ResourceNames: []string{pl.Name},
			Verbs: []string{"get", "list", "watch"},
		}},
	}
	if rls {
		w.checkPorts = append(w.checkPorts, RLSPort)
	}
	if e := p.Spec.Enforcer; e != nil && e.Resources != nil {
		w.resources = *e.Resources
	}
	return w
}

// policyLabels are the labels of the objects of a policy's pool of one.
func policyLabels(p *v1alpha1.RateLimitPolicy) map[string]string {
	return map[string]string{labelName: EnforcerPodLabelValue, labelInstance: LabelValue(p.Name), labelManagedBy: "sluice"}
}

// withServiceProtocol is p as its pool of one renders it: when its targetRef names no
// appProtocol, the target Service port's appProtocol, as Gateway API implementations read it, if
// it is one the enforcer speaks (kubernetes.io/h2c is h2c; kubernetes.io/ws and wss are http and
// https).
func withServiceProtocol(p *v1alpha1.RateLimitPolicy, svc *corev1.Service) *v1alpha1.RateLimitPolicy {
	if p.Spec.TargetRef.AppProtocol != "" || svc == nil {
		return p
	}
	for _, port := range svc.Spec.Ports {
		if port.Port != p.Spec.TargetRef.Port || port.AppProtocol == nil {
			continue
		}
		var proto v1alpha1.AppProtocol
		switch strings.ToLower(*port.AppProtocol) {
		case "http", "kubernetes.io/ws":
			proto = v1alpha1.AppProtocolHTTP
		case "https", "kubernetes.io/wss":
			proto = v1alpha1.AppProtocolHTTPS
		case "h2c", "kubernetes.io/h2c":
			proto = v1alpha1.AppProtocolH2C
		default:
			return p // a protocol the enforcer does not speak: http, as without one
		}
		c := p.DeepCopy()
		c.Spec.TargetRef.AppProtocol = proto
		return c
	}
	return p
}

// owner is the object that controls rendered objects, in its namespace: a policy or a pool.
type owner struct {
	ref       metav1.OwnerReference
	namespace string
}

func policyOwner(p *v1alpha1.RateLimitPolicy) owner {
	return owner{namespace: p.Namespace, ref: metav1.OwnerReference{APIVersion: v1alpha1.GroupVersion.String(), Kind: "RateLimitPolicy",
		Name: p.Name, UID: p.UID, Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}
}

func poolOwner(p *v1alpha1.EnforcerPool) owner {
	return owner{namespace: p.Namespace, ref: metav1.OwnerReference{APIVersion: v1alpha1.GroupVersion.String(), Kind: "EnforcerPool",
		Name: p.Name, UID: p.UID, Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}
}

// meta is the metadata of an object the owner controls, in its namespace.
func (o owner) meta(name string, labels, annotations map[string]string) metav1.ObjectMeta {
	return metav1.ObjectMeta{Name: name, Namespace: o.namespace, Labels: labels, Annotations: annotations,
		OwnerReferences: []metav1.OwnerReference{o.ref}}
}

// workload is what an enforcer Deployment and its companions are made from: a policy's own
// enforcer, or a pool's.
type workload struct {
	owner owner
	// name names every object; labels label them.
	name                              string
	labels, podLabels, podAnnotations map[string]string
	// redisPodLabels are the labels of the managed Redis's pod.
	redisPodLabels map[string]string
	replicas       int32
	image          string
	resources      corev1.ResourceRequirements
	ports          []corev1.ContainerPort
	servicePorts   []corev1.ServicePort
	// checkPorts are the ports the NetworkPolicy admits from gateways.
	checkPorts []int32
	// proxy is whether the proxy port is served (a policy's own enforcer).
	proxy bool
	// revision annotates the Deployment; config mounts the ConfigMap named name.
	revision string
	config   bool
	// rules are the Role's: what the enforcer may read from the API server.
	rules []rbacv1.PolicyRule
}

// enforcer renders the Deployment, its Service, its budget (nil with one replica) and its
// NetworkPolicy (nil when d asks for none).
func (w *workload) enforcer(c *pod, d Defaults) (*appsv1.Deployment, *corev1.Service, *policyv1.PodDisruptionBudget, *networkingv1.NetworkPolicy) {
	dep := w.deployment(c)
	svc := &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: w.owner.meta(w.name, w.labels, nil),
		Spec: corev1.ServiceSpec{
			Selector: w.podLabels,
			Ports:    w.servicePorts,
		},
	}
	var np *networkingv1.NetworkPolicy
	if d.NetworkPolicy != nil {
		np = w.networkPolicy(d.NetworkPolicy)
	}
	var pdb *policyv1.PodDisruptionBudget
	if w.replicas > 1 {
		pdb = &policyv1.PodDisruptionBudget{
			TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
			ObjectMeta: w.owner.meta(w.name, w.labels, nil),
			Spec: policyv1.PodDisruptionBudgetSpec{
				MaxUnavailable: ptr.To(intstr.FromInt32(1)),
				Selector:       &metav1.LabelSelector{MatchLabels: w.podLabels},
			},
		}
	}
	return dep, svc, pdb, np
}

// managedRedis renders a managed Redis for the workload's enforcers and points the enforcer pod
// at it.
func (w *workload) managedRedis(c *pod, m *v1alpha1.ManagedRedis, d Defaults) (*appsv1.Deployment, *corev1.Service, *policyv1.PodDisruptionBudget, *networkingv1.NetworkPolicy) {
	redisName := RedisName(w.name)
	c.args = append(c.args, fmt.Sprintf("--redis-url=redis://%s.%s.svc:%d/0", redisName, w.owner.namespace, RedisPort),
		"--redis-password-file="+redisCredentialsDir+"/"+RedisPasswordKey)
	c.mount("redis-credentials", redisName, redisCredentialsDir, corev1.KeyToPath{Key: RedisPasswordKey, Path: RedisPasswordKey})
	labels := map[string]string{labelManagedBy: "sluice", labelComponent: "redis"}
	maps.Copy(labels, w.redisPodLabels)
	dep, svc, pdb := managedRedis(w.owner, m, redisName, d, labels, w.redisPodLabels)
	var np *networkingv1.NetworkPolicy
	if d.NetworkPolicy != nil {
		np = redisNetworkPolicy(w.owner, redisName, dep, w.podLabels)
	}
	return dep, svc, pdb, np
}

// identity is the enforcer's: it may read from the API server what its Role's rules say, and
// nothing else.
func (w *workload) identity() (*corev1.ServiceAccount, *rbacv1.Role, *rbacv1.RoleBinding) {
	sa := &corev1.ServiceAccount{
		TypeMeta:                     metav1.TypeMeta{APIVersion: "v1", Kind: "ServiceAccount"},
		ObjectMeta:                   w.owner.meta(w.name, w.labels, nil),
		AutomountServiceAccountToken: ptr.To(false),
	}
	role := &rbacv1.Role{
		TypeMeta:   metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "Role"},
		ObjectMeta: w.owner.meta(w.name, w.labels, nil),
		Rules:      w.rules,
	}
	binding := &rbacv1.RoleBinding{
		TypeMeta:   metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "RoleBinding"},
		ObjectMeta: w.owner.meta(w.name, w.labels, nil),
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: w.name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: w.owner.namespace, Name: w.name}},
	}
	return sa, role, binding
}

// pod is the enforcer container's arguments and the Secrets it mounts.
type pod struct {
	args    []string
	volumes []corev1.Volume
	mounts  []corev1.VolumeMount
}

// mount mounts the items of a Secret read-only at dir, as the volume named so.
func (c *pod) mount(volume, secret, dir string, items ...corev1.KeyToPath) {
	c.volumes = append(c.volumes, corev1.Volume{Name: volume, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
		SecretName: secret, Items: items,
	}}})
	c.mounts = append(c.mounts, corev1.VolumeMount{Name: volume, MountPath: dir, ReadOnly: true})
}

// enforcerPod is what the policy says to the enforcers of its pool of one: their servers, the
// upstream, its TLS and timeouts.
func enforcerPod(p *v1alpha1.RateLimitPolicy, name string) *pod {
	c := &pod{args: []string{
		"--policy=" + PolicyFile,
		upstreamArg(p),
		fmt.Sprintf("--listen=:%d", ProxyPort),
		fmt.Sprintf("--check-listen=:%d", CheckPort),
		fmt.Sprintf("--admin-listen=:%d", AdminPort),
		"--shutdown-delay=" + settings.Defaults().ShutdownDelay.String(),
		"--shutdown-timeout=" + settings.Defaults().ShutdownTimeout.String(),
		"--configmap=" + p.Namespace + "/" + name,
	}}
	if ServesRLS(p) {
		c.args = append(c.args, fmt.Sprintf("--rls-listen=:%d", RLSPort))
	}
	if t := p.Spec.TargetRef.TLS; t != nil && p.Spec.TargetRef.AppProtocol == v1alpha1.AppProtocolHTTPS {
		c.upstreamTLS(t)
	}
	if t := p.Spec.TargetRef.Timeouts; t != nil {
		for _, f := range []struct {
			flag string
			d    *v1alpha1.Duration
		}{{"--upstream-connect-timeout", t.Connect}, {"--upstream-response-header-timeout", t.ResponseHeader}, {"--upstream-idle-timeout", t.Idle}} {
			if f.d != nil {
				c.args = append(c.args, f.flag+"="+string(*f.d))
			}
		}
	}
	return c
}

func (c *pod) upstreamTLS(t *v1alpha1.TargetTLS) {
	if t.ServerName != "" {
		c.args = append(c.args, "--upstream-server-name="+t.ServerName)
	}
	if ref := t.CASecretRef; ref != nil {
		c.mount("upstream-ca", ref.Name, upstreamCADir, corev1.KeyToPath{Key: ref.Key, Path: "ca.crt"})
		c.args = append(c.args, "--upstream-ca-file="+upstreamCADir+"/ca.crt")
	}
	if ref := t.ClientCertificateSecretRef; ref != nil {
		c.mount("upstream-client", ref.Name, upstreamClientDir,
			corev1.KeyToPath{Key: corev1.TLSCertKey, Path: corev1.TLSCertKey}, corev1.KeyToPath{Key: corev1.TLSPrivateKeyKey, Path: corev1.TLSPrivateKeyKey})
		c.args = append(c.args, "--upstream-cert-file="+upstreamClientDir+"/"+corev1.TLSCertKey, "--upstream-key-file="+upstreamClientDir+"/"+corev1.TLSPrivateKeyKey)
	}
}

func (c *pod) redis(r *v1alpha1.RedisStorage) {
	c.args = append(c.args, redisArgs(r)...)
	if t := r.TLS; t != nil && t.CASecretRef != nil {
		c.mount("redis-ca", t.CASecretRef.Name, redisCADir, corev1.KeyToPath{Key: t.CASecretRef.Key, Path: "ca.crt"})
		c.args = append(c.args, "--redis-ca-file="+redisCADir+"/ca.crt")
	}
	if ref := r.CredentialsSecretRef; ref != nil {
		// Mounted rather than passed as environment: the kubelet updates a mounted Secret, and
		// the enforcer reads the files at every new connection, so a fixed or rotated password
		// takes effect without a restart.
		key := ref.PasswordKey
		if key == "" {
			key = v1alpha1.DefaultPasswordKey
		}
		items := []corev1.KeyToPath{{Key: key, Path: "password"}}
		c.args = append(c.args, "--redis-password-file="+redisCredentialsDir+"/password")
		if ref.UsernameKey != "" {
			items = append(items, corev1.KeyToPath{Key: ref.UsernameKey, Path: "username"})
			c.args = append(c.args, "--redis-username-file="+redisCredentialsDir+"/username")
		}
		c.mount("redis-credentials", ref.Name, redisCredentialsDir, items...)
	}
}

// redisNetworkPolicy admits the enforcer pods alone to their managed Redis.
func redisNetworkPolicy(o owner, redisName string, redis *appsv1.Deployment, enforcerPods map[string]string) *networkingv1.NetworkPolicy {
	return &networkingv1.NetworkPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "networking.k8s.io/v1", Kind: "NetworkPolicy"},
		ObjectMeta: o.meta(redisName, redis.Labels, nil),
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: *redis.Spec.Selector.DeepCopy(),
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				Ports: tcpPorts(RedisPort),
				From:  []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{MatchLabels: enforcerPods}}},
			}},
		},
	}
}

// deployment runs the enforcer pods: rolled one extra pod at a time, never one fewer, spread
// over nodes.
func (w *workload) deployment(c *pod) *appsv1.Deployment {
	podLabels, name := w.podLabels, w.name
	var annotations map[string]string
	if w.revision != "" {
		annotations = map[string]string{RevisionAnnotation: w.revision}
	}
	mounts, volumes := c.mounts, c.volumes
	if w.config {
		mounts = append([]corev1.VolumeMount{{Name: "config", MountPath: configDir, ReadOnly: true}}, mounts...)
		volumes = append([]corev1.Volume{{
			Name:         "config",
			VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: name}}},
		}}, volumes...)
	}
	return &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: w.owner.meta(name, w.labels, annotations),
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(w.replicas),
			Selector: &metav1.LabelSelector{MatchLabels: podLabels},
			Strategy: appsv1.DeploymentStrategy{
				Type: appsv1.RollingUpdateDeploymentStrategyType,
				RollingUpdate: &appsv1.RollingUpdateDeployment{
					MaxUnavailable: ptr.To(intstr.FromInt32(0)),
					MaxSurge:       ptr.To(intstr.FromInt32(1)),
				},
			},
			Template: corev1.PodTemplateSpec{
				// The config revision is not in the template: the running pods take a changed
				// policy from their ConfigMap, watched through the API server, without a rollout.
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels, Annotations: w.podAnnotations},
				Spec: corev1.PodSpec{
					// The token lets the enforcer watch its ConfigMaps, all its Role allows.
					ServiceAccountName:            name,
					AutomountServiceAccountToken:  ptr.To(true),
					TerminationGracePeriodSeconds: ptr.To(int64(gracePeriod() / time.Second)),
					SecurityContext:               restrictedPod(),
					TopologySpreadConstraints: []corev1.TopologySpreadConstraint{{
						MaxSkew:           1,
						TopologyKey:       "kubernetes.io/hostname",
						WhenUnsatisfiable: corev1.ScheduleAnyway,
						LabelSelector:     &metav1.LabelSelector{MatchLabels: podLabels},
					}},
					Containers: []corev1.Container{{
						Name:            "enforcer",
						Image:           w.image,
						Args:            c.args,
						Ports:           w.ports,
						ReadinessProbe:  probe("/readyz", 5),
						LivenessProbe:   probe("/healthz", 10),
						Resources:       w.resources,
						SecurityContext: restrictedContainer(),
						VolumeMounts:    mounts,
					}},
					Volumes: volumes,
				},
			},
		},
	}
}

// NamespaceNameLabel is the label the API server sets on every namespace to its name, which
// NetworkPolicies select namespaces by.
const NamespaceNameLabel = "kubernetes.io/metadata.name"

// networkPolicy admits, to the enforcer pods: the proxy port, where served, from
// ProxyNamespaces, or from anywhere when it lists none; the check and RLS ports from the owner's
// namespace and CheckNamespaces; the admin port (reports, keys, metrics, pprof) from the
// manager's namespace and MonitoringNamespaces. Egress is not restricted. Kubelet probes come
// from the node, which NetworkPolicies always admit.
func (w *workload) networkPolicy(d *NetworkPolicyDefaults) *networkingv1.NetworkPolicy {
	var rules []networkingv1.NetworkPolicyIngressRule
	if w.proxy {
		proxy := networkingv1.NetworkPolicyIngressRule{Ports: tcpPorts(ProxyPort)}
		if len(d.ProxyNamespaces) > 0 {
			proxy.From = namespacePeers(d.ProxyNamespaces)
		}
		rules = append(rules, proxy)
	}
	rules = append(rules, networkingv1.NetworkPolicyIngressRule{
		Ports: tcpPorts(w.checkPorts...),
		From:  namespacePeers(append([]string{w.owner.namespace}, d.CheckNamespaces...)),
	})
	var admin []string
	if d.ManagerNamespace != "" {
		admin = append(admin, d.ManagerNamespace)
	}
	if admin = append(admin, d.MonitoringNamespaces...); len(admin) > 0 {
		rules = append(rules, networkingv1.NetworkPolicyIngressRule{Ports: tcpPorts(AdminPort), From: namespacePeers(admin)})
	}
	return &networkingv1.NetworkPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "networking.k8s.io/v1", Kind: "NetworkPolicy"},
		ObjectMeta: w.owner.meta(w.name, w.labels, nil),
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: w.podLabels},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress:     rules,
		},
	}
}

func tcpPorts(ports ...int32) []networkingv1.NetworkPolicyPort {
	out := make([]networkingv1.NetworkPolicyPort, len(ports))
	for i, port := range ports {
		out[i] = networkingv1.NetworkPolicyPort{Protocol: ptr.To(corev1.ProtocolTCP), Port: ptr.To(intstr.FromInt32(port))}
	}
	return out
}

// namespacePeers selects every pod of the named namespaces, by the name label the API server
// keeps on each: sorted and without repeats, so the same set renders the same object.
func namespacePeers(namespaces []string) []networkingv1.NetworkPolicyPeer {
	names := slices.Compact(slices.Sorted(slices.Values(namespaces)))
	return []networkingv1.NetworkPolicyPeer{{NamespaceSelector: &metav1.LabelSelector{
		MatchExpressions: []metav1.LabelSelectorRequirement{{Key: NamespaceNameLabel, Operator: metav1.LabelSelectorOpIn, Values: names}},
	}}}
}

// ErrBypassProtection begins the error of a bypass protection that cannot be drawn around the
// target Service: only a change of the Service or of the policy helps.
var ErrBypassProtection = errors.New("spec.targetRef.bypassProtection")

// BypassName is the name of the bypass protection's NetworkPolicy of the enforcer objects named
// name.
func BypassName(name string) string { return label(name + "-bypass") }

// Bypass renders targetRef.bypassProtection against the target Service as it is: a NetworkPolicy
// that selects the Service's pods by its selector and admits their target port only from the
// policy's enforcer pods and the allowed sources. A pod that any NetworkPolicy selects admits
// only what some policy allows, so a second rule keeps every other port and protocol of those
// pods open, as before. It returns nil when the policy asks for no protection or the Service
// does not exist (Degraded says so), and an error that names what is missing when the Service
// cannot be protected: no selector, no such port, or a named targetPort, around which no port
// range can be drawn.
func Bypass(p *v1alpha1.RateLimitPolicy, target *corev1.Service) (*networkingv1.NetworkPolicy, error) {
	b := p.Spec.TargetRef.BypassProtection
	if b == nil || target == nil {
		return nil, nil
	}
	if len(target.Spec.Selector) == 0 {
		return nil, fmt.Errorf("%w: Service %s has no selector, so no NetworkPolicy can select its pods", ErrBypassProtection, target.Name)
	}
	var sp *corev1.ServicePort
	for i := range target.Spec.Ports {
		if target.Spec.Ports[i].Port == p.Spec.TargetRef.Port {
			sp = &target.Spec.Ports[i]
		}
	}
	if sp == nil {
		return nil, fmt.Errorf("%w: Service %s has no port %d", ErrBypassProtection, target.Name, p.Spec.TargetRef.Port)
	}
	if sp.TargetPort.Type == intstr.String {
		return nil, fmt.Errorf("%w: port %d of Service %s has the named targetPort %q; bypass protection needs its number, to leave the pods' other ports open",
			ErrBypassProtection, sp.Port, target.Name, sp.TargetPort.StrVal)
	}
	port := sp.TargetPort.IntVal
	if port == 0 {
		port = sp.Port
	}
	protocol := sp.Protocol
	if protocol == "" {
		protocol = corev1.ProtocolTCP
	}
	from := []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{MatchLabels: PodLabels(p)}}}
	for _, src := range b.AllowedSources {
		from = append(from, sourcePeer(src))
	}
	var others []networkingv1.NetworkPolicyPort
	portRange := func(proto corev1.Protocol, first, last int32) {
		if first <= last {
			others = append(others, networkingv1.NetworkPolicyPort{Protocol: ptr.To(proto), Port: ptr.To(intstr.FromInt32(first)), EndPort: ptr.To(last)})
		}
	}
	for _, proto := range []corev1.Protocol{corev1.ProtocolTCP, corev1.ProtocolUDP, corev1.ProtocolSCTP} {
		if proto == protocol {
			portRange(proto, 1, port-1)
			portRange(proto, port+1, 65535)
		} else {
			portRange(proto, 1, 65535)
		}
	}
	name := Name(p)
	labels := map[string]string{labelName: "sluice-enforcer", labelInstance: LabelValue(p.Name), labelManagedBy: "sluice", labelComponent: "bypass-protection"}
	return &networkingv1.NetworkPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "networking.k8s.io/v1", Kind: "NetworkPolicy"},
		ObjectMeta: policyOwner(p).meta(BypassName(name), labels, nil),
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: target.Spec.Selector},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{
				{Ports: []networkingv1.NetworkPolicyPort{{Protocol: ptr.To(protocol), Port: ptr.To(intstr.FromInt32(port))}}, From: from},
				{Ports: others},
			},
		},
	}, nil
}

// sourcePeer is an allowed source as a NetworkPolicy peer.
func sourcePeer(src v1alpha1.BypassSource) networkingv1.NetworkPolicyPeer {
	if src.CIDR != "" {
		cidr := string(src.CIDR)
		if prefix, err := netip.ParsePrefix(cidr); err == nil {
			cidr = prefix.Masked().String() // the schema admits 10.0.0.1/8; a NetworkPolicy wants 10.0.0.0/8
		}
		return networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: cidr}}
	}
	var peer networkingv1.NetworkPolicyPeer
	if src.Namespace != "" {
		peer.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{NamespaceNameLabel: src.Namespace}}
	}
	if len(src.PodLabels) > 0 {
		peer.PodSelector = &metav1.LabelSelector{MatchLabels: src.PodLabels}
	}
	return peer
}

// policyFile is the policy as the enforcer loads it: the same document a user applies, reduced
// to what decides requests. Secret references are names, never credentials.
func policyFile(p *v1alpha1.RateLimitPolicy) ([]byte, error) {
	doc := v1alpha1.RateLimitPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: v1alpha1.GroupVersion.String(), Kind: "RateLimitPolicy"},
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace},
		Spec:       *p.Spec.DeepCopy(),
	}
	doc.Spec.Enforcer = nil // shapes the Deployment, not decisions
	doc.Spec.Storage = nil  // reaches the enforcer as flags, which a file cannot override
	out, err := yaml.Marshal(doc)
	if err != nil {
		return nil, fmt.Errorf("render the policy file: %w", err)
	}
	return out, nil
}

func redisArgs(r *v1alpha1.RedisStorage) []string {
	addrs := make([]string, len(r.Addresses))
	for i, a := range r.Addresses {
		addrs[i] = string(a)
	}
	var args []string
	switch r.Mode {
	case v1alpha1.RedisCluster:
		args = append(args, "--redis-cluster="+strings.Join(addrs, ","))
	case v1alpha1.RedisSentinel:
		args = append(args, "--redis-sentinel="+strings.Join(addrs, ","), "--redis-master="+r.MasterName)
	default:
		var db int32
		if r.Database != nil {
			db = *r.Database
		}
		args = append(args, fmt.Sprintf("--redis-url=redis://%s/%d", addrs[0], db))
	}
	if r.TLS != nil {
		args = append(args, "--redis-tls")
		if r.TLS.ServerName != "" {
			args = append(args, "--redis-server-name="+r.TLS.ServerName)
		}
	}
	if r.Timeout != nil {
		args = append(args, "--redis-timeout="+string(*r.Timeout))
	}
	return args
}

// The managed Redis's generated Secret: the password, which the enforcer reads as a file, and
// the same password as the Redis config file's requirepass, which Redis reads at start.
const (
	RedisPasswordKey = "password"
	RedisConfigKey   = "redis.conf"
	// RedisConfigDir is where the Redis container finds the Secret's files.
	RedisConfigDir = "/etc/sluice-redis"
	// RedisPasswordAnnotation on the Redis pod template is a digest of the password, so that a
	// new password (the Secret deleted or edited) restarts Redis with it.
	RedisPasswordAnnotation = "ratelimit.sluice.dev/redis-password-digest"
)

// RedisReadinessCommand is the managed Redis's readiness probe: redis-cli, authenticated with the
// mounted password, must be answered PONG. The password goes through the environment of
// redis-cli alone, never through its arguments or the container's environment.
var RedisReadinessCommand = []string{"sh", "-c",
	fmt.Sprintf(`test "$(REDISCLI_AUTH="$(cat %s/%s)" redis-cli -h 127.0.0.1 -p %d ping)" = PONG`, RedisConfigDir, RedisPasswordKey, RedisPort)}

// WithRedisPassword completes the managed Redis of a policy's or a pool's workload with its
// Secret, holding password, and the digest of password on the Redis pod template. Rendering
// stays pure: the controller generates the password once and passes the one it finds from then
// on.
func (w *Workload) WithRedisPassword(password string) {
	if w.RedisDeployment == nil {
		return
	}
	w.RedisSecret, w.RedisDeployment.Spec.Template.Annotations = redisSecret(w.RedisDeployment, password)
}

// redisSecret is a managed Redis's Secret, holding password, and the annotations of its pod
// template: a digest of the password, so that a new one restarts Redis with it.
func redisSecret(redis *appsv1.Deployment, password string) (*corev1.Secret, map[string]string) {
	secret := &corev1.Secret{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{Name: redis.Name, Namespace: redis.Namespace, Labels: redis.Labels,
			OwnerReferences: redis.OwnerReferences},
		Type: corev1.SecretTypeOpaque,
		Data: map[string][]byte{
			RedisPasswordKey: []byte(password),
			// Quoted as Redis's config parser reads strings, so any password the Secret is given
			// reads back whole.
			RedisConfigKey: []byte("requirepass " + strconv.Quote(password) + "\n"),
		},
	}
	sum := sha256.Sum256([]byte(password))
	return secret, map[string]string{RedisPasswordAnnotation: hex.EncodeToString(sum[:8])}
}

// RedisSecretLabels are the labels of every managed Redis's objects, its Secret among them: the
// manager caches only the Secrets that carry them.
var RedisSecretLabels = map[string]string{labelName: "sluice-redis", labelManagedBy: "sluice"}

// managedRedis is a Redis configured as a rate-limit store: nothing persisted (counters are
// short-lived and rebuilt by traffic), bounded memory, and eviction of the keys closest to their
// TTL, which are the ones closest to idle. It asks for a password from its Secret (see
// WithRedisPassword), is ready when it answers an authenticated PING, and a disruption budget
// keeps a drain from evicting it: with one replica, that waits for someone to delete the pod.
func managedRedis(o owner, m *v1alpha1.ManagedRedis, name string, d Defaults, labels, podLabels map[string]string) (*appsv1.Deployment, *corev1.Service, *policyv1.PodDisruptionBudget) {
	image := d.RedisImage
	if m.Image != "" {
		image = m.Image
	}
	maxMemory := resource.MustParse(v1alpha1.DefaultManagedRedisMaxMemory)
	if m.MaxMemory != nil {
		maxMemory = *m.MaxMemory
	}
	resources := corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: maxMemory},
	}
	if m.Resources != nil {
		resources = *m.Resources
	}
	dep := &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: o.meta(name, labels, nil),
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](1),
			Selector: &metav1.LabelSelector{MatchLabels: podLabels},
			Strategy: appsv1.DeploymentStrategy{Type: appsv1.RecreateDeploymentStrategyType},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels},
				Spec: corev1.PodSpec{
					AutomountServiceAccountToken: ptr.To(false),
					SecurityContext:              restrictedPod(),
					Containers:                   []corev1.Container{redisContainer(image, maxMemory, resources)},
					Volumes:                      []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: name}}}},
				},
			},
		},
	}
	svc := &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: o.meta(name, labels, nil),
		Spec: corev1.ServiceSpec{
			Selector: podLabels,
			Ports:    []corev1.ServicePort{{Name: "redis", Port: RedisPort, TargetPort: intstr.FromString("redis"), Protocol: corev1.ProtocolTCP}},
		},
	}
	pdb := &policyv1.PodDisruptionBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
		ObjectMeta: o.meta(name, labels, nil),
		Spec: policyv1.PodDisruptionBudgetSpec{
			MinAvailable: ptr.To(intstr.FromInt32(1)),
			Selector:     &metav1.LabelSelector{MatchLabels: podLabels},
		},
	}
	return dep, svc, pdb
}

// redisContainer runs a managed Redis from the config file of its Secret.
func redisContainer(image string, maxMemory resource.Quantity, resources corev1.ResourceRequirements) corev1.Container {
	return corev1.Container{
		Name:  "redis",
		Image: image,
		Args: []string{
			RedisConfigDir + "/" + RedisConfigKey,
			"--save", "", "--appendonly", "no",
			"--maxmemory", fmt.Sprint(maxMemory.Value()),
			"--maxmemory-policy", "volatile-ttl",
		},
		Ports: []corev1.ContainerPort{{Name: "redis", ContainerPort: RedisPort, Protocol: corev1.ProtocolTCP}},
		ReadinessProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: RedisReadinessCommand}},
			PeriodSeconds: 5, TimeoutSeconds: 2,
		},
		Resources:       resources,
		SecurityContext: restrictedContainer(),
		VolumeMounts:    []corev1.VolumeMount{{Name: "config", MountPath: RedisConfigDir, ReadOnly: true}},
	}
}

func probe(path string, period int32) *corev1.Probe {
	return &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: path, Port: intstr.FromString("admin")}},
		PeriodSeconds: period,
	}
}

// restrictedPod and restrictedContainer pass the Pod Security "restricted" profile.
func restrictedPod() *corev1.PodSecurityContext {
	return &corev1.PodSecurityContext{
		RunAsNonRoot:   ptr.To(true),
		RunAsUser:      ptr.To[int64](65532),
		SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

func restrictedContainer() *corev1.SecurityContext {
	return &corev1.SecurityContext{
		AllowPrivilegeEscalation: ptr.To(false),
		ReadOnlyRootFilesystem:   ptr.To(true),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
}
