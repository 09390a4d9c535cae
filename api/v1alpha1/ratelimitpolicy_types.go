package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// RateLimitPolicy declares the rate-limit rules of one Service. Sluice runs an enforcer in front of
// the Service that decides every request against these rules.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=rlp,categories=sluice
// +kubebuilder:printcolumn:name="Target",type=string,JSONPath=`.spec.targetRef.name`
// +kubebuilder:printcolumn:name="Rules",type=string,JSONPath=`.status.ruleNames`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.enforcer.ready`
// +kubebuilder:printcolumn:name="Limited",type=string,JSONPath=`.status.limited`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.reason`
// +kubebuilder:printcolumn:name="Store",type=string,JSONPath=`.status.enforcer.storeHealth`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:printcolumn:name="Storage",type=string,JSONPath=`.status.enforcer.storage`,priority=1
// +kubebuilder:printcolumn:name="Revision",type=string,JSONPath=`.status.enforcer.configRevision`,priority=1
type RateLimitPolicy struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the standard object metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec declares the rules and where and how they are enforced.
	// +required
	Spec RateLimitPolicySpec `json:"spec"`

	// status reports what the controller and the enforcer really do.
	// +optional
	Status RateLimitPolicyStatus `json:"status,omitempty"`
}

// RateLimitPolicyList is a list of RateLimitPolicy objects.
//
// +kubebuilder:object:root=true
type RateLimitPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the standard list metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the policies.
	Items []RateLimitPolicy `json:"items"`
}

// RateLimitPolicySpec declares the rules of one Service and where their state lives.
//
// +kubebuilder:validation:XValidation:rule="(has(self.storage) && (has(self.storage.redis) || has(self.storage.managedRedis))) || !has(self.enforcer) || !has(self.enforcer.replicas) || self.enforcer.replicas == 1",message="memory storage keeps counters inside one enforcer, so enforcer.replicas must be 1; use storage.redis or storage.managedRedis to run more replicas",fieldPath=".enforcer.replicas"
// +kubebuilder:validation:XValidation:rule="!has(self.enforcer) || !has(self.enforcer.poolRef) || !has(self.storage)",message="storage is the pool's when enforcer.poolRef is set: the pool keeps every policy's counters in its own store; remove storage or poolRef",fieldPath=".storage"
// +kubebuilder:validation:XValidation:rule="!has(self.enforcer) || !has(self.enforcer.poolRef) || !has(self.targetRef.bypassProtection)",message="bypassProtection admits only the policy's own enforcer pods, and a policy in a pool (enforcer.poolRef) has none: the gateway reaches the Service itself; remove bypassProtection or poolRef",fieldPath=".targetRef.bypassProtection"
// +kubebuilder:validation:XValidation:rule="!has(self.retries) || !has(self.retries.idempotencyKey) || !has(self.rules) || !self.rules.exists(r, has(r.lease))",message="lease does not apply with retries.idempotencyKey: a repeat is recognized by its record in Redis, which a leased rule's local decision does not read; remove lease or idempotencyKey",fieldPath=".retries.idempotencyKey"
type RateLimitPolicySpec struct {
	// targetRef is the Service, in the policy's namespace, that the enforcer fronts.
	// +required
	TargetRef TargetRef `json:"targetRef"`

	// rules are the limits. A request is checked against every rule that matches it, and it is
	// charged to all of them or to none: a refused request consumes nothing.
	// +required
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=32
	Rules []Rule `json:"rules,omitempty"`

	// trustedProxies are the CIDRs of proxies in front of the enforcer. X-Forwarded-For is believed
	// only when the peer is inside one of them; otherwise the peer address identifies the client.
	// The X-Forwarded-For, -Host, -Proto and Forwarded fields of such a peer are passed on to the
	// Service, extended; any other peer's are replaced by what its connection says.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=32
	TrustedProxies []CIDR `json:"trustedProxies,omitempty"`

	// defaultFailureMode is the failureMode of rules that do not set their own. Defaults to Open.
	// +optional
	// +kubebuilder:default=Open
	DefaultFailureMode FailureMode `json:"defaultFailureMode,omitempty"`

	// storage is where the rules' counters live. Absent means memory: one enforcer replica keeps
	// them in its own process (see memory for what it does not keep).
	// +optional
	Storage *Storage `json:"storage,omitempty"`

	// enforcer shapes the enforcer Deployment.
	// +optional
	Enforcer *EnforcerSpec `json:"enforcer,omitempty"`

	// retries shapes how retried requests are treated: repeats of one request by idempotency
	// key, and spread-out Retry-After values for refused clients.
	// +optional
	Retries *Retries `json:"retries,omitempty"`
}

// TargetRef names a Service port in the policy's namespace.
//
// +kubebuilder:validation:XValidation:rule="!has(self.tls) || !has(self.appProtocol) || self.appProtocol == 'https'",message="tls needs appProtocol https, here or on the Service port",fieldPath=".tls"
type TargetRef struct {
	// name is the name of the Service.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",message="must be a Service name: lowercase letters, digits and '-', starting with a letter"
	Name string `json:"name,omitempty"`

	// port is the Service port that receives the traffic that passes.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	Port int32 `json:"port,omitempty"`

	// bypassProtection, when set, stops clients from going around the enforcer: a NetworkPolicy
	// selects the target Service's pods (by the Service's selector) and admits their target port
	// only from this policy's enforcer pods and from allowedSources. All other traffic to those
	// pods on that port stops, and so does traffic that reaches them through the Service
	// directly; their other ports stay open. It needs a network plugin that enforces
	// NetworkPolicy, a Service with a selector, and a numeric targetPort on the Service port.
	// Absent: the target stays reachable beside the enforcer.
	// +optional
	BypassProtection *BypassProtection `json:"bypassProtection,omitempty"`

	// appProtocol is the protocol the enforcer speaks to the Service port: http (HTTP/1.1 in
	// cleartext, the enforcer's fastest path), https (TLS, verified as tls says; HTTP/2 when the
	// port offers it by ALPN, else HTTP/1.1) or h2c (cleartext HTTP/2 with prior knowledge, as
	// gRPC servers speak it). Absent means the Service port's appProtocol, as Gateway API
	// implementations read it (http, https, h2c, kubernetes.io/h2c, kubernetes.io/ws or
	// kubernetes.io/wss), and else http.
	// +optional
	AppProtocol AppProtocol `json:"appProtocol,omitempty"`

	// tls verifies the Service's certificate when the protocol is https (here or on the Service
	// port), and is ignored otherwise. Absent means the system roots and the Service's DNS name,
	// NAME.NAMESPACE.svc.
	// +optional
	TLS *TargetTLS `json:"tls,omitempty"`

	// timeouts bound the enforcer's hop to the Service. Absent fields keep the enforcer's
	// defaults: connect 5s, responseHeader 60s, idle 1s.
	// +optional
	Timeouts *UpstreamTimeouts `json:"timeouts,omitempty"`
}

// UpstreamTimeouts bound the hop from the enforcer to the Service. A request past its connect or
// response-header timeout is answered 504 (gRPC DEADLINE_EXCEEDED), counted in
// sluice_upstream_failures_total, and ended at the Service.
type UpstreamTimeouts struct {
	// connect is the time to open a connection to the Service, TLS handshake included.
	// +optional
	Connect *Duration `json:"connect,omitempty"`

	// responseHeader is the time the Service has to start its response once the request is
	// sent. A streamed response or an upgraded connection that has begun, and a gRPC call (which
	// its own deadline bounds), may last any time.
	// +optional
	ResponseHeader *Duration `json:"responseHeader,omitempty"`

	// idle is how long an idle pooled connection to the Service is kept. Keep it below the
	// Service's own keep-alive timeout (gunicorn's is 2s, Node's and uvicorn's 5s), so that the
	// Service never closes a connection the enforcer is about to use.
	// +optional
	Idle *Duration `json:"idle,omitempty"`
}

// BypassProtection lists who, besides the enforcer, may still reach the target's pods directly.
type BypassProtection struct {
	// allowedSources are the peers that may reach the target's pods on the target port without
	// passing the enforcer, such as a job that must not be limited. Empty: the enforcer alone.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=16
	AllowedSources []BypassSource `json:"allowedSources,omitempty"`
}

// BypassSource is one peer: the pods of a namespace (all, or those with podLabels), the pods
// with podLabels in the policy's namespace, or the addresses of a CIDR.
//
// +kubebuilder:validation:XValidation:rule="has(self.namespace) || has(self.podLabels) || has(self.cidr)",message="set namespace, podLabels or cidr"
// +kubebuilder:validation:XValidation:rule="!has(self.cidr) || !(has(self.namespace) || has(self.podLabels))",message="cidr stands alone: it cannot be combined with namespace or podLabels"
type BypassSource struct {
	// namespace is the name of the namespace whose pods may reach the target; with podLabels,
	// only its pods that carry them. Absent with podLabels: the policy's namespace.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",message="must be a namespace name: lowercase letters, digits and '-', starting and ending with a letter or digit"
	Namespace string `json:"namespace,omitempty"`

	// podLabels selects the pods that may reach the target: those that carry every one of these
	// labels.
	// +optional
	// +kubebuilder:validation:MinProperties=1
	// +kubebuilder:validation:MaxProperties=8
	PodLabels map[string]string `json:"podLabels,omitempty"`

	// cidr admits the addresses of a network, such as a load balancer's or a node's, which no
	// pod selector can name.
	// +optional
	CIDR CIDR `json:"cidr,omitempty"`
}

// AppProtocol is the protocol of the hop from the enforcer to the Service.
// +kubebuilder:validation:Enum=http;https;h2c
type AppProtocol string

// The protocols of the hop to the Service.
const (
	AppProtocolHTTP  AppProtocol = "http"
	AppProtocolHTTPS AppProtocol = "https"
	AppProtocolH2C   AppProtocol = "h2c"
)

// TargetTLS is how the enforcer verifies an https Service.
type TargetTLS struct {
	// caSecretRef names a Secret key, in the policy's namespace, holding the PEM CA bundle that
	// signs the Service's certificate; the Secret is mounted into the enforcer pods. Absent means
	// the system roots.
	// +optional
	CASecretRef *SecretKeyRef `json:"caSecretRef,omitempty"`

	// serverName is the name to verify in the Service's certificate, and the SNI the enforcer
	// sends. Absent means the Service's DNS name, NAME.NAMESPACE.svc.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	ServerName string `json:"serverName,omitempty"`

	// clientCertificateSecretRef names a Secret of type kubernetes.io/tls, in the policy's
	// namespace, whose tls.crt and tls.key the enforcer presents to a Service that asks for a
	// client certificate; the Secret is mounted into the enforcer pods. Absent: none is sent.
	// +optional
	ClientCertificateSecretRef *SecretRef `json:"clientCertificateSecretRef,omitempty"`
}

// SecretRef names a Secret in the policy's namespace.
type SecretRef struct {
	// name is the Secret's name.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name,omitempty"`
}

// Rule is one limit: an algorithm, the requests it applies to, and how clients are told apart.
//
// +kubebuilder:validation:XValidation:rule="[has(self.tokenBucket), has(self.leakyBucket), has(self.fixedWindow), has(self.slidingLog), has(self.slidingWindowCounter), has(self.concurrency)].filter(x, x).size() == 1",message="exactly one algorithm must be set: tokenBucket, leakyBucket, fixedWindow, slidingLog, slidingWindowCounter or concurrency"
// +kubebuilder:validation:XValidation:rule="!has(self.tokenBucket) || !has(self.cost) || self.cost <= self.tokenBucket.capacity",message="cost must not exceed tokenBucket.capacity: such a request could never pass",fieldPath=".cost"
// +kubebuilder:validation:XValidation:rule="!has(self.leakyBucket) || !has(self.cost) || self.cost <= self.leakyBucket.capacity",message="cost must not exceed leakyBucket.capacity: such a request could never pass",fieldPath=".cost"
// +kubebuilder:validation:XValidation:rule="!has(self.fixedWindow) || !has(self.cost) || self.cost <= self.fixedWindow.limit",message="cost must not exceed fixedWindow.limit: such a request could never pass",fieldPath=".cost"
// +kubebuilder:validation:XValidation:rule="!has(self.slidingLog) || !has(self.cost) || self.cost <= self.slidingLog.limit",message="cost must not exceed slidingLog.limit: such a request could never pass",fieldPath=".cost"
// +kubebuilder:validation:XValidation:rule="!has(self.slidingWindowCounter) || !has(self.cost) || self.cost <= self.slidingWindowCounter.limit",message="cost must not exceed slidingWindowCounter.limit: such a request could never pass",fieldPath=".cost"
// +kubebuilder:validation:XValidation:rule="!has(self.slidingLog) || self.slidingLog.limit <= 10000",message="must be at most 10000: a sliding log keeps one entry per admitted request; use slidingWindowCounter for larger limits",fieldPath=".slidingLog.limit"
// +kubebuilder:validation:XValidation:rule="!has(self.concurrency) || !has(self.cost) || self.cost == 1",message="a concurrency rule holds one slot per request: cost must be 1 or absent",fieldPath=".cost"
// +kubebuilder:validation:XValidation:rule="!has(self.concurrency) || (!has(self.charge) && !has(self.costFrom))",message="charge and costFrom do not apply to concurrency: a request holds its slot while it is in flight",fieldPath=".concurrency"
// +kubebuilder:validation:XValidation:rule="!has(self.leakyBucket) || !has(self.charge) || self.charge.when != 'Response'",message="a leaky bucket gives a request its place in the queue when it is admitted, so it cannot be charged by the response",fieldPath=".charge.when"
// +kubebuilder:validation:XValidation:rule="!has(self.costFrom) || (has(self.charge) && self.charge.when == 'Response')",message="costFrom reads the response: it needs charge.when Response",fieldPath=".costFrom"
// +kubebuilder:validation:XValidation:rule="!has(self.costFrom) || self.costFrom.max <= (has(self.tokenBucket) ? self.tokenBucket.capacity : has(self.fixedWindow) ? self.fixedWindow.limit : has(self.slidingLog) ? self.slidingLog.limit : has(self.slidingWindowCounter) ? self.slidingWindowCounter.limit : 0)",message="costFrom.max must not exceed the rule's capacity or limit: a response may not charge more than the rule can ever hold",fieldPath=".costFrom.max"
// +kubebuilder:validation:XValidation:rule="!has(self.lease) || has(self.tokenBucket) || has(self.fixedWindow)",message="lease applies to tokenBucket and fixedWindow only: units taken ahead cannot be exact where a leaky bucket gives each request its own place in time, a sliding log records each request's time, a sliding window counter weights counts by when they came, or a concurrency slot is released per request",fieldPath=".lease"
// +kubebuilder:validation:XValidation:rule="!has(self.lease) || !has(self.tokenBucket) || self.lease.max <= self.tokenBucket.capacity",message="lease.max must not exceed tokenBucket.capacity: an enforcer cannot take more units than the bucket holds",fieldPath=".lease.max"
// +kubebuilder:validation:XValidation:rule="!has(self.lease) || !has(self.fixedWindow) || self.lease.max <= self.fixedWindow.limit",message="lease.max must not exceed fixedWindow.limit: an enforcer cannot take more units than the window admits",fieldPath=".lease.max"
// +kubebuilder:validation:XValidation:rule="!has(self.lease) || !has(self.mode) || self.mode != 'Shadow'",message="lease does not apply to mode Shadow: a shadow rule is charged as if it were the only rule and never refuses, which units taken ahead cannot follow",fieldPath=".lease"
// +kubebuilder:validation:XValidation:rule="!has(self.lease) || !has(self.charge) || self.charge.when != 'Response'",message="lease does not apply to charge.when Response: leased units are taken before the request is forwarded, not after its response",fieldPath=".lease"
type Rule struct {
	// name identifies the rule in status, metrics, headers and Redis keys. A DNS label.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",message="must be a DNS label: lowercase letters, digits and '-', starting and ending with a letter or digit"
	Name string `json:"name,omitempty"`

	// tokenBucket admits bursts up to capacity and refills at a steady rate.
	// +optional
	TokenBucket *TokenBucket `json:"tokenBucket,omitempty"`

	// leakyBucket queues requests and releases them at a fixed rate; a request that would wait
	// longer than maxWait, or find the queue full, is refused.
	// +optional
	LeakyBucket *LeakyBucket `json:"leakyBucket,omitempty"`

	// fixedWindow admits limit units per clock-aligned window. Cheapest. Worst case: a client that
	// times its requests around a window boundary passes twice the limit in a window-long interval.
	// +optional
	FixedWindow *Window `json:"fixedWindow,omitempty"`

	// slidingLog admits limit units in any window-long interval, exactly, by remembering each
	// admitted request and its cost: it never exceeds the limit.
	// Its memory grows with the requests admitted in a window, one entry each whatever its cost,
	// about 40 bytes in Redis, so at most limit entries, and limit is at most 10000 (a key of
	// about 400 KB); use slidingWindowCounter for larger limits.
	// +optional
	SlidingLog *Window `json:"slidingLog,omitempty"`

	// slidingWindowCounter approximates a sliding window from the current and previous fixed
	// windows, the previous one weighted by how much of it the sliding window still covers, and
	// admits limit units per window to a client that keeps sending. Smooth and cheap, but not
	// exact: on ordinary traffic with a limit of 100 it passed up to 1.13x the limit in a
	// window-long interval, and a client that times its requests just before window boundaries
	// passes nearly twice the limit, as with fixedWindow. Below a limit of 20 prefer slidingLog
	// (docs/guarantees.md).
	// +optional
	SlidingWindowCounter *Window `json:"slidingWindowCounter,omitempty"`

	// concurrency admits at most limit requests of a client in flight at once, which protects
	// slow endpoints that a rate cannot: a request holds one slot from its admission until its
	// response ends (the last byte of a streamed body, the end of an upgraded connection) or its
	// client leaves. A slot is a lease: the enforcer renews it every third of leaseTimeout while
	// the request lasts, and an enforcer that dies with requests in flight frees their slots
	// within leaseTimeout. A refusal is 429 with Retry-After: 1, which promises no time: a slot
	// frees when a request in flight ends. Only the enforcer's proxy sees a response end: the
	// check API (ingress forward-auth) and Envoy's rate limit service skip the rule and count it
	// as skipped.
	// +optional
	Concurrency *Concurrency `json:"concurrency,omitempty"`

	// match selects the requests the rule applies to. Absent means every request.
	// +optional
	Match *Match `json:"match,omitempty"`

	// key lists the parts of a request that identify a client; each distinct combination gets its
	// own counter. Absent means one counter shared by every request the rule matches.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=8
	Key []KeySource `json:"key,omitempty"`

	// cost is how many units one request consumes. 0 checks the limit without consuming anything.
	// With costFrom, it is what a request is checked for before it is forwarded, and what a
	// response that reports no valid cost is charged. A concurrency rule's is 1: one slot.
	// Defaults to 1.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000000000
	Cost *int64 `json:"cost,omitempty"`

	// charge says when a request is charged: when Request, as it is admitted (the default), or
	// when Response, once its response ends, and then only for the statuses listed, such as failed
	// logins ("401", "403") or server errors ("5xx"). A rule charged when Response is checked before
	// the request is forwarded (a request the rule could not admit now is refused) but charged
	// only after the response, so requests in flight when its limit is reached still pass: at
	// most that many beyond the limit (a concurrency rule beside it bounds them). Only the
	// enforcer's proxy sees a response: the check API and Envoy's rate limit service skip such a
	// rule and count it as skipped.
	// +optional
	Charge *Charge `json:"charge,omitempty"`

	// costFrom reads a request's cost from its response, such as the tokens an LLM response
	// used: the value of a response header or trailer, a whole number from 0 to max (a larger
	// one is charged as max). A response without the field, or with a value that is not one
	// such number (negative, not a number, sent twice), is charged cost instead, and counted.
	// A charge larger than what the rule has left takes it to exhaustion. Needs charge.when
	// Response.
	// +optional
	CostFrom *CostFrom `json:"costFrom,omitempty"`

	// lease lets an enforcer take up to lease.max units of a client's limit from Redis at once
	// and decide from them locally, without a round trip to Redis, until they run out or
	// lease.expiry passes. The units are charged in Redis when they are taken, so the rule stays
	// exact: never more than the limit is admitted across enforcer replicas. The price is early
	// refusals: a request may be refused while each other enforcer replica holds up to max-1 of
	// the client's units unused. An enforcer killed while it holds units loses them: on a fixed
	// window they count until the window ends; on a token bucket they stop counting against the
	// bucket at the lease's expiry and refill from then. tokenBucket and fixedWindow only; not
	// with mode Shadow, charge.when Response or spec.retries.idempotencyKey. On memory storage
	// every decision is local already, and a lease changes nothing. Absent: every decision asks
	// Redis.
	// +optional
	Lease *Lease `json:"lease,omitempty"`

	// failureMode says what the rule decides when its storage cannot answer: Open lets requests
	// through, Closed refuses them with 503. When absent, the rule follows
	// spec.defaultFailureMode.
	// +optional
	FailureMode FailureMode `json:"failureMode,omitempty"`

	// mode is Enforce to refuse requests over the limit, or Shadow to only count the requests that
	// would have been refused. Defaults to Enforce.
	// +optional
	Mode RuleMode `json:"mode,omitempty"`
}

// TokenBucket holds up to capacity tokens and gains refill.tokens every refill.period. A request
// takes cost tokens, or is refused when the bucket holds fewer.
type TokenBucket struct {
	// capacity is the most tokens the bucket holds: the largest burst that passes at once.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000
	Capacity int64 `json:"capacity,omitempty"`

	// refill is the steady rate at which the bucket fills.
	// +required
	Refill TokenRefill `json:"refill"`
}

// TokenRefill is a rate of tokens: tokens per period.
type TokenRefill struct {
	// tokens are added every period, spread evenly over it.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000
	Tokens int64 `json:"tokens,omitempty"`

	// period is the time in which tokens are added.
	// +required
	Period Duration `json:"period,omitempty"`
}

// LeakyBucket is a bounded queue that drains at a fixed rate. Each request is given a departure
// time; it waits until then, so the upstream sees an even flow.
type LeakyBucket struct {
	// capacity is the most units that may wait in the queue at once.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	Capacity int64 `json:"capacity,omitempty"`

	// drain is the fixed rate at which the queue releases requests.
	// +required
	Drain DrainRate `json:"drain"`

	// maxWait is the longest a request may be held. A request that would wait longer is refused.
	// Absent means as long as a full queue takes to drain.
	// +optional
	MaxWait *Duration `json:"maxWait,omitempty"`
}

// DrainRate is a rate of requests: requests per period.
type DrainRate struct {
	// requests are released every period, spread evenly over it.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000
	Requests int64 `json:"requests,omitempty"`

	// period is the time in which requests are released.
	// +required
	Period Duration `json:"period,omitempty"`
}

// Window admits limit units per window.
type Window struct {
	// limit is the most units admitted per window.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000
	Limit int64 `json:"limit,omitempty"`

	// window is the length of the window.
	// +required
	Window Duration `json:"window,omitempty"`
}

// Concurrency admits at most limit requests of one client in flight at once.
//
// +kubebuilder:validation:XValidation:rule="!has(self.leaseTimeout) || !self.leaseTimeout.matches('^([0-9]{1,10}(h|m|s|ms)){1,4}$') || (duration(self.leaseTimeout) >= duration('1s') && duration(self.leaseTimeout) <= duration('1h'))",message="leaseTimeout must be at least 1s and at most 1h",fieldPath=".leaseTimeout"
type Concurrency struct {
	// limit is the most requests of one client in flight at once. At most 10000: each request in
	// flight is one entry of the client's state.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=10000
	Limit int64 `json:"limit,omitempty"`

	// leaseTimeout is how long a slot stays held without a renewal: the enforcer renews the
	// slots of its requests in flight every third of it, so it bounds how long the slots of an
	// enforcer that died (or lost its store) stay taken. From 1s to 1h. Defaults to 30s.
	// +optional
	LeaseTimeout *Duration `json:"leaseTimeout,omitempty"`
}

// DefaultLeaseTimeout is concurrency.leaseTimeout when it is absent.
const DefaultLeaseTimeout Duration = "30s"

// Charge says when a rule charges a request.
//
// +kubebuilder:validation:XValidation:rule="!has(self.statuses) || self.when == 'Response'",message="statuses are the responses that are charged: they need when Response",fieldPath=".statuses"
type Charge struct {
	// when is Request to charge a request when it is admitted, or Response to check it when it
	// is admitted and charge it once its response ends. (Not "on", which YAML 1.1 parsers,
	// kubectl's among them, read as the boolean true.)
	// +required
	When ChargeWhen `json:"when,omitempty"`

	// statuses are the response statuses that are charged, each a code such as "401" or a class
	// such as "5xx". Absent: every response. Responses of other statuses are never charged.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=16
	Statuses []StatusPattern `json:"statuses,omitempty"`
}

// ChargeWhen is when a rule charges a request.
//
// +kubebuilder:validation:Enum=Request;Response
type ChargeWhen string

// When rules charge requests.
const (
	// ChargeWhenRequest charges a request when it is admitted.
	ChargeWhenRequest ChargeWhen = "Request"
	// ChargeWhenResponse checks a request when it is admitted and charges it once its response ends.
	ChargeWhenResponse ChargeWhen = "Response"
)

// StatusPattern is an HTTP status code, such as "401", or a class of them, such as "5xx".
//
// +kubebuilder:validation:MinLength=3
// +kubebuilder:validation:MaxLength=3
// +kubebuilder:validation:XValidation:rule="self.matches('^[1-5]([0-9][0-9]|xx)$')",message="must be a status code such as 401 or a class such as 5xx"
type StatusPattern string

// CostFrom reads a request's cost from its response.
type CostFrom struct {
	// responseHeader is the response header, or trailer, whose value is the cost: a whole number
	// of units. A trailer is read once the response has ended, so a streamed response can report
	// the cost it learned last.
	// +required
	ResponseHeader HeaderName `json:"responseHeader,omitempty"`

	// max is the largest cost a response is charged: a larger value is charged as max. At most
	// the rule's capacity or limit.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000000
	Max int64 `json:"max,omitempty"`
}

// Lease is how many units of a client's limit one enforcer takes from Redis at once, and for
// how long it may use them.
//
// +kubebuilder:validation:XValidation:rule="!has(self.expiry) || !self.expiry.matches('^([0-9]{1,10}(h|m|s|ms)){1,4}$') || (duration(self.expiry) >= duration('100ms') && duration(self.expiry) <= duration('1m'))",message="expiry must be at least 100ms and at most 1m",fieldPath=".expiry"
type Lease struct {
	// max is the most units one enforcer takes at once for one client. From 2 to 1000000, and
	// at most the rule's capacity or limit. Each other enforcer replica may hold up to max-1 of
	// a client's units unused, so a request may be refused up to that many units early.
	// +required
	// +kubebuilder:validation:Minimum=2
	// +kubebuilder:validation:Maximum=1000000
	Max int64 `json:"max,omitempty"`

	// expiry is how long an enforcer may use the units it took: past it, what is left unused
	// is given up. From 100ms to 1m. Defaults to 1s.
	// +optional
	Expiry *Duration `json:"expiry,omitempty"`
}

// DefaultLeaseExpiry is lease.expiry when it is absent.
const DefaultLeaseExpiry Duration = "1s"

// Duration is a length of time made of whole hours (h), minutes (m), seconds (s) and
// milliseconds (ms), such as "500ms", "1s", "1m30s" or "24h", from 1ms to 720h (30 days).
//
// +kubebuilder:validation:MaxLength=32
// +kubebuilder:validation:XValidation:rule="self.matches('^([0-9]{1,10}(h|m|s|ms)){1,4}$')",message="must be a duration of whole h, m, s and ms, such as 500ms, 1s, 1m30s or 24h"
// +kubebuilder:validation:XValidation:rule="!self.matches('^([0-9]{1,10}(h|m|s|ms)){1,4}$') || (duration(self) >= duration('1ms') && duration(self) <= duration('720h'))",message="must be at least 1ms and at most 720h (30 days)"
type Duration string

// Match selects requests. All of its parts must match.
type Match struct {
	// methods are the HTTP methods that match. Absent means any method.
	// +optional
	// +listType=set
	// +kubebuilder:validation:MaxItems=9
	Methods []HTTPMethod `json:"methods,omitempty"`

	// path matches the request path, without the query string.
	// +optional
	Path *PathMatch `json:"path,omitempty"`

	// headers must all be present in the request with the given values.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=16
	Headers []HeaderMatch `json:"headers,omitempty"`
}

// HTTPMethod is an HTTP request method.
//
// +kubebuilder:validation:Enum=GET;HEAD;POST;PUT;PATCH;DELETE;OPTIONS;CONNECT;TRACE
type HTTPMethod string

// PathMatch matches the request path.
//
// +kubebuilder:validation:XValidation:rule="(has(self.type) && self.type == 'RegularExpression') || self.value.startsWith('/')",message="value must start with '/' for types Exact and Prefix",fieldPath=".value"
type PathMatch struct {
	// type is how value is compared: Exact, Prefix (whole path segments: /api matches /api and
	// /api/users but not /apis) or RegularExpression (RE2 syntax, matched against the whole path).
	// Defaults to Prefix.
	// +optional
	Type PathMatchType `json:"type,omitempty"`

	// value is the path or the expression.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	Value string `json:"value,omitempty"`
}

// PathMatchType is how a path is compared.
//
// +kubebuilder:validation:Enum=Exact;Prefix;RegularExpression
type PathMatchType string

// Path match types.
const (
	PathMatchExact             PathMatchType = "Exact"
	PathMatchPrefix            PathMatchType = "Prefix"
	PathMatchRegularExpression PathMatchType = "RegularExpression"
)

// HeaderMatch matches one request header.
type HeaderMatch struct {
	// name is the header name, compared without regard to case.
	// +required
	Name HeaderName `json:"name,omitempty"`

	// value is the exact value the header must have. Absent means any value: the header must
	// only be present.
	// +optional
	// +kubebuilder:validation:MaxLength=4096
	Value *string `json:"value,omitempty"`
}

// HeaderName is the name of an HTTP header.
//
// +kubebuilder:validation:MinLength=1
// +kubebuilder:validation:MaxLength=256
// +kubebuilder:validation:XValidation:rule="self.matches('^[A-Za-z0-9!#$%&*+.^_|~-]+$')",message="must be an HTTP header name: letters, digits and !#$%&*+-.^_|~"
type HeaderName string

// KeySource is one part of a request that identifies a client.
//
// +kubebuilder:validation:XValidation:rule="self.type == 'Header' ? has(self.name) : !has(self.name)",message="name is required with type Header and not allowed with other types"
type KeySource struct {
	// type is the part of the request: RemoteAddress (the client address, see
	// spec.trustedProxies), Header (the value of header name), Method or Path.
	// +required
	Type KeySourceType `json:"type,omitempty"`

	// name is the header to read, with type Header.
	// +optional
	Name *HeaderName `json:"name,omitempty"`
}

// KeySourceType is a part of a request that identifies a client.
//
// +kubebuilder:validation:Enum=RemoteAddress;Header;Method;Path
type KeySourceType string

// Key source types.
const (
	KeyRemoteAddress KeySourceType = "RemoteAddress"
	KeyHeader        KeySourceType = "Header"
	KeyMethod        KeySourceType = "Method"
	KeyPath          KeySourceType = "Path"
)

// FailureMode is what a rule decides when its storage cannot answer.
//
// +kubebuilder:validation:Enum=Open;Closed
type FailureMode string

// Failure modes.
const (
	// FailOpen lets requests through while storage is unavailable.
	FailOpen FailureMode = "Open"
	// FailClosed refuses requests with 503 while storage is unavailable.
	FailClosed FailureMode = "Closed"
)

// RuleMode is whether a rule refuses requests or only counts them.
//
// +kubebuilder:validation:Enum=Enforce;Shadow
type RuleMode string

// Rule modes.
const (
	// ModeEnforce refuses requests over the limit.
	ModeEnforce RuleMode = "Enforce"
	// ModeShadow never refuses; requests over the limit are counted as "would limit".
	ModeShadow RuleMode = "Shadow"
)

// CIDR is an IPv4 or IPv6 network in CIDR notation, such as 10.0.0.0/8 or fd00::/8.
//
// +kubebuilder:validation:MaxLength=49
// +kubebuilder:validation:XValidation:rule="isCIDR(self)",message="must be a CIDR such as 10.0.0.0/8 or fd00::/8"
type CIDR string

// Storage is where counters live. Exactly one of its members is set.
//
// +kubebuilder:validation:XValidation:rule="[has(self.memory), has(self.redis), has(self.managedRedis)].filter(x, x).size() == 1",message="exactly one of memory, redis or managedRedis must be set"
type Storage struct {
	// memory keeps counters in the enforcer's own memory. Exact only with one enforcer replica,
	// and only while it keeps them: at most 1,000,000 keys and 128 MiB (past that it evicts the
	// keys closest to idle, whose clients start afresh), none across a restart of the pod, and
	// while a rollout runs an old and a new pod side by side each counts alone.
	// +optional
	Memory *MemoryStorage `json:"memory,omitempty"`

	// redis keeps counters in a Redis that you run.
	// +optional
	Redis *RedisStorage `json:"redis,omitempty"`

	// managedRedis keeps counters in a Redis that the operator runs for this policy: one pod
	// without persistence, with a password that the manager generates once into the Secret
	// sluice-<policy>-redis (mounted as Redis's requirepass and as the enforcer's password file),
	// ready when an authenticated PING is answered, and a PodDisruptionBudget that holds a drain
	// until its pod is deleted by hand. A restart empties every counter, and while it restarts
	// fail-open rules admit every request.
	// +optional
	ManagedRedis *ManagedRedis `json:"managedRedis,omitempty"`
}

// MemoryStorage keeps counters in the enforcer process. It has no settings.
type MemoryStorage struct{}

// RedisStorage is the connection to a Redis that you run.
//
// +kubebuilder:validation:XValidation:rule="self.mode != 'Sentinel' || has(self.masterName)",message="masterName is required with mode Sentinel",fieldPath=".masterName"
// +kubebuilder:validation:XValidation:rule="self.mode == 'Sentinel' || !has(self.masterName)",message="masterName is only used with mode Sentinel",fieldPath=".masterName"
// +kubebuilder:validation:XValidation:rule="self.mode != 'Cluster' || !has(self.database) || self.database == 0",message="database must be 0 with mode Cluster: Redis Cluster has only database 0",fieldPath=".database"
// +kubebuilder:validation:XValidation:rule="self.mode != 'Standalone' || size(self.addresses) == 1",message="mode Standalone takes exactly one address",fieldPath=".addresses"
type RedisStorage struct {
	// mode is the Redis topology: Standalone (one server), Sentinel (addresses are sentinels) or
	// Cluster (addresses are seed nodes). Defaults to Standalone.
	// +optional
	// +kubebuilder:default=Standalone
	Mode RedisMode `json:"mode,omitempty"`

	// addresses are host:port pairs: the server, the sentinels, or the cluster's seed nodes.
	// +required
	// +listType=set
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=16
	Addresses []HostPort `json:"addresses,omitempty"`

	// masterName is the name of the master set that the sentinels watch. Sentinel only.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	MasterName string `json:"masterName,omitempty"`

	// database is the Redis database number. Must be 0 (or absent) with Cluster.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=15
	Database *int32 `json:"database,omitempty"`

	// credentialsSecretRef names a Secret in the policy's namespace holding the Redis username
	// and password. The Secret is mounted into the enforcer pods as files, read at every new
	// connection, so a rotated password takes effect without a restart; it never enters a
	// ConfigMap or an environment variable.
	// +optional
	CredentialsSecretRef *CredentialsSecretRef `json:"credentialsSecretRef,omitempty"`

	// tls turns on TLS to Redis. Absent means plain TCP.
	// +optional
	TLS *RedisTLS `json:"tls,omitempty"`

	// timeout bounds every Redis call of a decision. When it passes, rules apply their
	// failureMode. Defaults to 50ms.
	// +optional
	// +kubebuilder:default="50ms"
	Timeout *Duration `json:"timeout,omitempty"`
}

// DefaultRedisTimeout is the timeout of storage.redis when it sets none. The schema's defaults
// are marker literals; a test (enforcer/schema) holds them to these constants.
const DefaultRedisTimeout Duration = "50ms"

// DefaultPasswordKey is the key of the password in credentialsSecretRef's Secret when it names
// none.
const DefaultPasswordKey = "password"

// DefaultManagedRedisMaxMemory is the maxMemory of storage.managedRedis when it sets none; the
// schema's default says the same.
const DefaultManagedRedisMaxMemory = "256Mi"

// RedisMode is a Redis topology.
//
// +kubebuilder:validation:Enum=Standalone;Sentinel;Cluster
type RedisMode string

// Redis modes.
const (
	RedisStandalone RedisMode = "Standalone"
	RedisSentinel   RedisMode = "Sentinel"
	RedisCluster    RedisMode = "Cluster"
)

// HostPort is a network address: a host name or IP address and a port, such as
// redis.example:6379 or [fd00::1]:6379.
//
// +kubebuilder:validation:MaxLength=261
// +kubebuilder:validation:XValidation:rule="self.matches('^([a-zA-Z0-9.-]+|\\\\[[0-9a-fA-F:.]+\\\\]):[0-9]{1,5}$')",message="must be host:port, such as redis.example:6379 or [fd00::1]:6379"
// +kubebuilder:validation:XValidation:rule="!self.matches(':[0-9]{1,5}$') || (int(self.substring(self.lastIndexOf(':') + 1)) >= 1 && int(self.substring(self.lastIndexOf(':') + 1)) <= 65535)",message="the port must be from 1 to 65535"
type HostPort string

// CredentialsSecretRef names the Secret keys that hold Redis credentials.
type CredentialsSecretRef struct {
	// name is the Secret's name, in the policy's namespace.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name,omitempty"`

	// usernameKey is the key of the username. Absent means no username (Redis "default" user).
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	UsernameKey string `json:"usernameKey,omitempty"`

	// passwordKey is the key of the password. Defaults to password.
	// +optional
	// +kubebuilder:default=password
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	PasswordKey string `json:"passwordKey,omitempty"`
}

// RedisTLS configures TLS to Redis.
type RedisTLS struct {
	// caSecretRef names a Secret key holding the PEM CA bundle that signs the Redis certificate.
	// Absent means the system roots.
	// +optional
	CASecretRef *SecretKeyRef `json:"caSecretRef,omitempty"`

	// serverName is the name to verify in the Redis certificate. Absent means the host of the
	// address.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	ServerName string `json:"serverName,omitempty"`
}

// SecretKeyRef names one key of a Secret in the policy's namespace.
type SecretKeyRef struct {
	// name is the Secret's name.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name,omitempty"`

	// key is the key inside the Secret.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Key string `json:"key,omitempty"`
}

// ManagedRedis is a Redis that the operator runs for this policy, configured as a rate-limit
// store: no persistence, bounded memory, eviction of keys closest to their expiry.
// +kubebuilder:validation:XValidation:rule="!has(self.maxMemory) || quantity(string(self.maxMemory)).isGreaterThan(quantity('0'))",message="must be more than 0",fieldPath=".maxMemory"
type ManagedRedis struct {
	// image is the Redis image. Absent means the manager's default.
	// +optional
	// +kubebuilder:validation:MaxLength=512
	Image string `json:"image,omitempty"`

	// maxMemory bounds the memory Redis uses for counters. Defaults to 256Mi.
	// +optional
	// +kubebuilder:default="256Mi"
	MaxMemory *resource.Quantity `json:"maxMemory,omitempty"`

	// resources are the Redis container's compute resources.
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`
}

// Retries shapes how retried requests are treated.
type Retries struct {
	// idempotencyKey recognizes repeats of a request by a header the client sends with the same
	// value on every retry (the IETF Idempotency-Key draft, Stripe's API): a repeat of an
	// admitted request passes without being charged again, a repeat of a refused one is refused
	// the same way until its Retry-After, and a bounded number of free repeats keeps the header
	// from becoming a way around the limits. Absent: every request is charged.
	// +optional
	IdempotencyKey *IdempotencyKey `json:"idempotencyKey,omitempty"`

	// retryAfterJitterPercent adds to the Retry-After of each refusal, and to the t of its
	// RateLimit field, a random share of up to this many percent, so that clients refused together
	// do not all come back together. The value stays an upper bound: a request sent at the
	// advertised time passes, as without jitter. Absent: no jitter.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	RetryAfterJitterPercent *int32 `json:"retryAfterJitterPercent,omitempty"`
}

// IdempotencyKey says how repeats of a request are recognized and how many pass free.
// +kubebuilder:validation:XValidation:rule="!has(self.window) || !self.window.matches('^([0-9]{1,10}(h|m|s|ms)){1,4}$') || (duration(self.window) >= duration('1s') && duration(self.window) <= duration('24h'))",message="window must be at least 1s and at most 24h",fieldPath=".window"
type IdempotencyKey struct {
	// header is the request header that carries the key. Absent: Idempotency-Key.
	// +optional
	Header *HeaderName `json:"header,omitempty"`

	// window is how long a request's record is kept: repeats within it are recognized. From 1s
	// to 24h. Absent: 10m.
	// +optional
	Window *Duration `json:"window,omitempty"`

	// maxRepeats is how many repeats of an admitted request pass without being charged; the
	// repeats after them are charged like new requests. Absent: 3.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	MaxRepeats *int32 `json:"maxRepeats,omitempty"`
}

// Defaults of spec.retries.idempotencyKey.
const (
	DefaultIdempotencyHeader     HeaderName = "Idempotency-Key"
	DefaultIdempotencyWindow     Duration   = "10m"
	DefaultIdempotencyMaxRepeats int32      = 3
)

// EnforcerSpec shapes the enforcer Deployment, or names the pool whose enforcers serve the
// policy instead.
//
// +kubebuilder:validation:XValidation:rule="!has(self.poolRef) || !has(self.replicas)",message="replicas is the pool's: a policy in a pool (poolRef) runs no enforcer of its own; remove replicas or poolRef",fieldPath=".replicas"
// +kubebuilder:validation:XValidation:rule="!has(self.poolRef) || !has(self.image)",message="image is the pool's: a policy in a pool (poolRef) runs no enforcer of its own; remove image or poolRef",fieldPath=".image"
// +kubebuilder:validation:XValidation:rule="!has(self.poolRef) || !has(self.resources)",message="resources are the pool's: a policy in a pool (poolRef) runs no enforcer of its own; remove resources or poolRef",fieldPath=".resources"
// +kubebuilder:validation:XValidation:rule="!has(self.poolRef) || !has(self.rateLimitService)",message="rateLimitService is the pool's: every pool serves Envoy's rate limit service for its policies; remove rateLimitService or poolRef",fieldPath=".rateLimitService"
type EnforcerSpec struct {
	// poolRef names an EnforcerPool whose enforcers serve this policy, through their check API
	// (/policies/<namespace>/<name>/forward-auth and /auth-request) and Envoy's rate limit
	// service (domain <namespace>/<name>). The policy then runs no enforcer of its own, and no
	// reverse proxy: send the gateway's questions to the pool. replicas, image, resources,
	// rateLimitService and spec.storage are the pool's and must be absent. The pool must admit
	// the policy's namespace (its allowedPolicies). Changed on a live policy, the policy moves:
	// its new home serves it before its old one stops. Absent: the policy runs its own enforcer.
	// +optional
	PoolRef *PoolRef `json:"poolRef,omitempty"`

	// replicas is the number of enforcer pods. Defaults to 1 with memory storage and 2 otherwise.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	Replicas *int32 `json:"replicas,omitempty"`

	// image is the enforcer image. Absent means the manager's default.
	// +optional
	// +kubebuilder:validation:MaxLength=512
	Image string `json:"image,omitempty"`

	// resources are the enforcer container's compute resources.
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`

	// rateLimitService serves Envoy's rate limit service (gRPC, envoy.service.ratelimit.v3) on
	// the enforcer Service's port grpc-rls (8082), for Envoy-based gateways and meshes. Absent,
	// the port is not served. A caller of the service names the client of every request it asks
	// about, so whoever can reach the port can spend any client's limits: let only the gateway in.
	// +optional
	RateLimitService *RateLimitService `json:"rateLimitService,omitempty"`
}

// RateLimitService configures the enforcer's Envoy rate limit service.
type RateLimitService struct {
	// enabled serves the rate limit service.
	// +required
	Enabled bool `json:"enabled"`
}

// RateLimitPolicyStatus reports what the controller and the enforcer really do.
type RateLimitPolicyStatus struct {
	// observedGeneration is the spec generation that the conditions describe.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// conditions are Accepted (the spec is valid and the policy owns its target), Programmed
	// (the enforcer objects are applied), Ready (every replica serves the current revision),
	// Degraded (something outside the policy weakens enforcement, such as Redis), and
	// Reconciling and Stalled (kstatus: still working, or unable to progress until something
	// changes).
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=8
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// enforcer reports the enforcer Deployment and what its replicas report.
	// +optional
	Enforcer *EnforcerStatus `json:"enforcer,omitempty"`

	// reason is the reason of the first condition that fails, in the order Accepted (False),
	// Programmed (False), Ready (False), Degraded (True), for kubectl get; empty when none does.
	// +optional
	// +kubebuilder:validation:MaxLength=64
	Reason string `json:"reason,omitempty"`

	// limited is the share of the enforced rules' decisions that refused, over the last minute
	// and every replica, such as "12.5%"; empty with no decisions.
	// +optional
	// +kubebuilder:validation:MaxLength=8
	Limited string `json:"limited,omitempty"`

	// ruleNames are the names of spec.rules in spec order, comma-separated, such as
	// "burst,per-minute,per-hour": the RULES column of kubectl get. It is at most 64 characters:
	// past that, the names that fit are followed by "+N more" for the N rules left out, such as
	// "burst,per-minute,+30 more"; spec.rules lists them all.
	// +optional
	// +kubebuilder:validation:MaxLength=64
	RuleNames string `json:"ruleNames,omitempty"`

	// rules are each rule's decisions over the last minute, summed over the replicas that
	// report them, in spec order.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=32
	Rules []RuleStatus `json:"rules,omitempty"`
}

// RuleStatus counts one rule's decisions over the last minute.
type RuleStatus struct {
	// name is the rule's name.
	// +required
	// +kubebuilder:validation:MaxLength=63
	Name string `json:"name"`

	// allowed counts the requests the rule admitted.
	// +optional
	Allowed int64 `json:"allowed"`

	// limited counts the requests the rule refused (for a shadow rule: would have refused).
	// +optional
	Limited int64 `json:"limited"`

	// failed counts the decisions the store could not make, after which the rule applied its
	// failure mode.
	// +optional
	Failed int64 `json:"failed"`

	// skipped counts the requests the rule did not decide because their front end cannot see a
	// response end: a concurrency rule, or one charged on Response, asked through the check API
	// or Envoy's rate limit service.
	// +optional
	Skipped int64 `json:"skipped"`

	// charged counts the responses the rule charged after they ended (charge.when Response).
	// +optional
	Charged int64 `json:"charged"`

	// limitedShare is limited over allowed plus limited, such as "12.5%"; empty with neither.
	// +optional
	// +kubebuilder:validation:MaxLength=8
	LimitedShare string `json:"limitedShare,omitempty"`
}

// EnforcerStatus reports the enforcer Deployment, or the pool that serves the policy.
type EnforcerStatus struct {
	// serviceName is the Service that clients send traffic to instead of the target; for a
	// policy in a pool, the pool's Service, whose check port answers
	// /policies/<namespace>/<name>/forward-auth and /auth-request.
	// +optional
	// +kubebuilder:validation:MaxLength=63
	ServiceName string `json:"serviceName,omitempty"`

	// pool is the "<namespace>/<name>" of the EnforcerPool that serves the policy; empty when
	// the policy runs its own enforcer.
	// +optional
	// +kubebuilder:validation:MaxLength=317
	Pool string `json:"pool,omitempty"`

	// replicas is the desired number of enforcer pods: spec.enforcer.replicas, or 1 with memory
	// storage and 2 otherwise.
	// +optional
	Replicas int32 `json:"replicas,omitempty"`

	// image is the enforcer image the pods run: spec.enforcer.image, or the manager's
	// --enforcer-image.
	// +optional
	// +kubebuilder:validation:MaxLength=512
	Image string `json:"image,omitempty"`

	// readyReplicas is the number of enforcer pods that are ready and report that they serve
	// configRevision.
	// +optional
	ReadyReplicas int32 `json:"readyReplicas,omitempty"`

	// ready is readyReplicas/replicas, such as "2/2", for kubectl get.
	// +optional
	// +kubebuilder:validation:MaxLength=24
	Ready string `json:"ready,omitempty"`

	// storage is where the counters live: memory, redis-standalone, redis-sentinel,
	// redis-cluster or managed-redis.
	// +optional
	// +kubebuilder:validation:MaxLength=32
	Storage string `json:"storage,omitempty"`

	// configRevision identifies the compiled config the enforcer runs.
	// +optional
	// +kubebuilder:validation:MaxLength=64
	ConfigRevision string `json:"configRevision,omitempty"`

	// storeHealth is the health of the store as the replicas report it: Connected when every
	// replica that reports says its store answers, otherwise why the first does not
	// (RedisUnreachable, RedisAuthenticationFailed, RedisTLSFailed); while no replica reports,
	// RedisUnreachable when the manager's probe of storage.redis fails. Empty while nothing says.
	// +optional
	// +kubebuilder:validation:MaxLength=32
	StoreHealth string `json:"storeHealth,omitempty"`
}
