package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// EnforcerPool runs one set of enforcers that decides requests for many policies: the check API
// (forward-auth, auth-request) and Envoy's rate limit service, for gateways and ingresses that
// send every route's questions to one address. A policy joins a pool with
// spec.enforcer.poolRef; it then runs no enforcer of its own. The reverse proxy stays per
// policy: a policy that needs it runs its own enforcer.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=epool,categories=sluice
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.ready`
// +kubebuilder:printcolumn:name="Policies",type=integer,JSONPath=`.status.policies.served`
// +kubebuilder:printcolumn:name="Refused",type=integer,JSONPath=`.status.policies.refused`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.reason`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Storage",type=string,JSONPath=`.status.storage`,priority=1
// +kubebuilder:printcolumn:name="Service",type=string,JSONPath=`.status.serviceName`,priority=1
type EnforcerPool struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the standard object metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec declares the pool's enforcers and which policies may join it.
	// +required
	Spec EnforcerPoolSpec `json:"spec"`

	// status reports what the controller and the pool's enforcers really do.
	// +optional
	Status EnforcerPoolStatus `json:"status,omitempty"`
}

// EnforcerPoolList is a list of EnforcerPool objects.
//
// +kubebuilder:object:root=true
type EnforcerPoolList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the standard list metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the pools.
	Items []EnforcerPool `json:"items"`
}

// EnforcerPoolSpec declares a pool's enforcers, their store, and which policies may join.
//
// +kubebuilder:validation:XValidation:rule="(has(self.storage) && (has(self.storage.redis) || has(self.storage.managedRedis))) || !has(self.replicas) || self.replicas == 1",message="memory storage keeps counters inside one enforcer, so replicas must be 1; use storage.redis or storage.managedRedis to run more replicas",fieldPath=".replicas"
type EnforcerPoolSpec struct {
	// replicas is the number of enforcer pods; every one serves every policy of the pool.
	// Defaults to 1 with memory storage and 2 otherwise.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	Replicas *int32 `json:"replicas,omitempty"`

	// image is the enforcer image. Absent means the manager's default.
	// +optional
	// +kubebuilder:validation:MaxLength=512
	Image string `json:"image,omitempty"`

	// resources are the enforcer container's compute resources. Absent: 100m CPU and 128Mi
	// requested, 1Gi of memory at most (a pool of 10,000 one-rule policies stays under 300Mi).
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`

	// storage is where the counters of every policy of the pool live, each policy under keys of
	// its own. Absent means memory: one enforcer replica keeps them in its own process. Secrets
	// it names are in the pool's namespace.
	// +optional
	Storage *Storage `json:"storage,omitempty"`

	// allowedPolicies says which namespaces' policies may join the pool. Absent: the pool's own
	// namespace only.
	// +optional
	AllowedPolicies *AllowedPolicies `json:"allowedPolicies,omitempty"`
}

// AllowedPolicies says which policies may join a pool, as a Gateway listener's allowedRoutes
// says which routes may attach.
type AllowedPolicies struct {
	// namespaces are the namespaces whose policies may join. Absent: the pool's own namespace.
	// +optional
	Namespaces *PolicyNamespaces `json:"namespaces,omitempty"`
}

// PolicyNamespaces selects namespaces: the pool's own, all, or those a label selector selects.
//
// +kubebuilder:validation:XValidation:rule="self.from == 'Selector' ? has(self.selector) : !has(self.selector)",message="selector is required with from Selector and not allowed otherwise",fieldPath=".selector"
type PolicyNamespaces struct {
	// from is Same (the pool's namespace), All (every namespace) or Selector (the namespaces
	// whose labels selector matches). Defaults to Same.
	// +optional
	// +kubebuilder:default=Same
	From FromNamespaces `json:"from,omitempty"`

	// selector selects namespaces by their labels, with from Selector. The API server labels
	// every namespace kubernetes.io/metadata.name with its name.
	// +optional
	Selector *metav1.LabelSelector `json:"selector,omitempty"`
}

// FromNamespaces is where a pool's policies may come from.
//
// +kubebuilder:validation:Enum=Same;All;Selector
type FromNamespaces string

// Where a pool's policies may come from.
const (
	// NamespacesFromSame admits the policies of the pool's own namespace.
	NamespacesFromSame FromNamespaces = "Same"
	// NamespacesFromAll admits the policies of every namespace.
	NamespacesFromAll FromNamespaces = "All"
	// NamespacesFromSelector admits the policies of the namespaces a label selector selects.
	NamespacesFromSelector FromNamespaces = "Selector"
)

// PoolRef names the EnforcerPool a policy joins.
type PoolRef struct {
	// name is the pool's name.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",message="must be an object name: lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
	Name string `json:"name,omitempty"`

	// namespace is the pool's namespace. Absent: the policy's.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",message="must be a namespace name: lowercase letters, digits and '-', starting and ending with a letter or digit"
	Namespace string `json:"namespace,omitempty"`
}

// EnforcerPoolStatus reports a pool's enforcers and the policies they serve.
type EnforcerPoolStatus struct {
	// observedGeneration is the spec generation that the conditions describe.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// conditions are Accepted (the spec is valid), Programmed (the pool's objects are applied),
	// Ready (every replica is ready and reports that it follows the pool's policies), Degraded
	// (a replica's store does not answer, or a replica refused a policy), and Reconciling and
	// Stalled (kstatus).
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=8
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// serviceName is the pool's Service: its port check (8081) answers
	// /policies/<namespace>/<name>/forward-auth and /auth-request, its port grpc-rls (8082) is
	// Envoy's rate limit service.
	// +optional
	// +kubebuilder:validation:MaxLength=63
	ServiceName string `json:"serviceName,omitempty"`

	// replicas is the desired number of enforcer pods.
	// +optional
	Replicas int32 `json:"replicas,omitempty"`

	// readyReplicas is the number of pods that are ready and report.
	// +optional
	ReadyReplicas int32 `json:"readyReplicas,omitempty"`

	// ready is readyReplicas/replicas, such as "2/2", for kubectl get.
	// +optional
	// +kubebuilder:validation:MaxLength=24
	Ready string `json:"ready,omitempty"`

	// image is the enforcer image the pods run.
	// +optional
	// +kubebuilder:validation:MaxLength=512
	Image string `json:"image,omitempty"`

	// storage is where the counters live: memory, redis-standalone, redis-sentinel,
	// redis-cluster or managed-redis.
	// +optional
	// +kubebuilder:validation:MaxLength=32
	Storage string `json:"storage,omitempty"`

	// reason is the reason of the first condition that fails, in the order Accepted (False),
	// Programmed (False), Ready (False), Degraded (True), for kubectl get; empty when none does.
	// +optional
	// +kubebuilder:validation:MaxLength=64
	Reason string `json:"reason,omitempty"`

	// policies counts the policies the replicas serve and refuse.
	// +optional
	Policies *PoolPolicies `json:"policies,omitempty"`

	// replicaStatuses are the pool's pods as they report, by name: the first 100.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=100
	ReplicaStatuses []PoolReplica `json:"replicaStatuses,omitempty"`
}

// PoolPolicies counts a pool's policies.
type PoolPolicies struct {
	// served is the number of policies every reporting replica serves.
	// +optional
	Served int32 `json:"served"`

	// refused is the number of policies a replica refused: their config did not load, and the
	// replica serves the last version it loaded, or refuses their requests.
	// +optional
	Refused int32 `json:"refused"`

	// refusedPolicies are the first 16 policies refused, with a replica's reason.
	// +optional
	// +listType=map
	// +listMapKey=policy
	// +kubebuilder:validation:MaxItems=16
	RefusedPolicies []RefusedPolicy `json:"refusedPolicies,omitempty"`
}

// RefusedPolicy is a policy a replica refused, and why.
type RefusedPolicy struct {
	// policy is the policy's "<namespace>/<name>".
	// +required
	// +kubebuilder:validation:MaxLength=317
	Policy string `json:"policy"`

	// message is the replica's reason, such as the validation error.
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Message string `json:"message,omitempty"`
}

// PoolReplica is one pool pod as it reports.
type PoolReplica struct {
	// name is the pod's name.
	// +required
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name"`

	// ready is the pod's Ready condition, and that it reported.
	// +optional
	Ready bool `json:"ready"`

	// policies is the number of policies the replica serves.
	// +optional
	Policies int32 `json:"policies"`

	// refused is the number of policies the replica refused.
	// +optional
	Refused int32 `json:"refused"`

	// store is the store's health as the replica sees it: connected, or the store's own words.
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Store string `json:"store,omitempty"`
}
