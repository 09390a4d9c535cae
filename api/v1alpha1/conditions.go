package v1alpha1

// Condition types of a RateLimitPolicy and of an EnforcerPool. GitOps tools read health from
// Ready.
const (
	// ConditionAccepted tells whether the spec is valid and the policy owns its target Service.
	ConditionAccepted = "Accepted"
	// ConditionProgrammed tells whether the enforcer objects were applied with the current spec.
	ConditionProgrammed = "Programmed"
	// ConditionReady tells whether every desired enforcer replica is available and reports that
	// it serves the current config revision, so that traffic is limited exactly as the spec says.
	ConditionReady = "Ready"
	// ConditionDegraded tells whether something outside the policy weakens enforcement, such as
	// an unreachable Redis or a missing target Service. Ready can be True while Degraded is True.
	ConditionDegraded = "Degraded"

	// ConditionReconciling is True while the enforcer does not yet run the current spec. With
	// Stalled it follows the kstatus convention that Argo CD and Flux read health from.
	ConditionReconciling = "Reconciling"
	// ConditionStalled is True when the controller cannot make progress until the spec or the
	// cluster changes: an invalid or conflicting policy, an enforcer object the API server refuses,
	// or an object in the way that the policy does not own.
	ConditionStalled = "Stalled"
)

// Reasons of the Accepted condition.
const (
	// ReasonAccepted: the spec is valid and the target Service is not claimed by another policy.
	ReasonAccepted = "Accepted"
	// ReasonInvalid: the spec is invalid; the message names the fields.
	ReasonInvalid = "Invalid"
	// ReasonConflicted: an older policy in the namespace already targets the same Service.
	ReasonConflicted = "Conflicted"
	// ReasonPoolNotFound: spec.enforcer.poolRef names an EnforcerPool that does not exist.
	ReasonPoolNotFound = "PoolNotFound"
	// ReasonNotAllowedByPool: the EnforcerPool that spec.enforcer.poolRef names does not admit
	// policies of the policy's namespace (its spec.allowedPolicies).
	ReasonNotAllowedByPool = "NotAllowedByPool"
)

// Reasons of the Programmed condition.
const (
	// ReasonProgrammed: every enforcer object was applied.
	ReasonProgrammed = "Programmed"
	// ReasonApplyFailed: applying an enforcer object failed; the message says which. With
	// Stalled True no retry can fix it.
	ReasonApplyFailed = "ApplyFailed"
	// ReasonNotAccepted: nothing is programmed because the policy is not accepted.
	ReasonNotAccepted = "NotAccepted"
)

// Reasons of the Ready condition.
const (
	// ReasonAvailable: every desired enforcer replica is ready and reports the current revision.
	ReasonAvailable = "Available"
	// ReasonRollingOut: the enforcer Deployment is rolling out, or a replica still reports an
	// earlier revision.
	ReasonRollingOut = "RollingOut"
	// ReasonUnavailable: fewer replicas than desired are ready and report; the message names
	// the first that does not, and why.
	ReasonUnavailable = "Unavailable"
	// ReasonNotProgrammed: the enforcer is not ready because it is not programmed.
	ReasonNotProgrammed = "NotProgrammed"
	// ReasonRefused: an enforcer replica refused the policy's current config, such as one that
	// does not load; the message is the replica's. In a pool the other policies keep serving.
	ReasonRefused = "Refused"
	// ReasonUnschedulable: an enforcer pod cannot be scheduled; the message is the scheduler's
	// (its PodScheduled condition).
	ReasonUnschedulable = "Unschedulable"
	// ReasonImagePullFailed: an enforcer pod's image cannot be pulled (ErrImagePull,
	// ImagePullBackOff, InvalidImageName); the message is the kubelet's.
	ReasonImagePullFailed = "ImagePullFailed"
	// ReasonContainerConfigError: the kubelet cannot create an enforcer container from its spec,
	// such as for a Secret or ConfigMap it needs that does not exist (CreateContainerConfigError);
	// the message is the kubelet's.
	ReasonContainerConfigError = "ContainerConfigError"
	// ReasonCrashLooping: an enforcer container keeps exiting (CrashLoopBackOff); the message is
	// the kubelet's, with the container's last exit code and reason.
	ReasonCrashLooping = "CrashLooping"
)

// Reasons of the Degraded condition.
const (
	// ReasonAsExpected: nothing weakens enforcement.
	ReasonAsExpected = "AsExpected"
	// ReasonRedisUnreachable: the configured Redis does not answer, as an enforcer replica sees
	// it or, with no replica reporting, as the manager's probe does; rules apply their failure
	// modes.
	ReasonRedisUnreachable = "RedisUnreachable"
	// ReasonRedisAuthenticationFailed: Redis refused an enforcer replica's credentials; the
	// message is Redis's own.
	ReasonRedisAuthenticationFailed = "RedisAuthenticationFailed"
	// ReasonRedisTLSFailed: the TLS handshake of an enforcer replica with Redis failed, such as
	// on a certificate that does not verify.
	ReasonRedisTLSFailed = "RedisTLSFailed"
	// ReasonTargetNotFound: the target Service does not exist, so the enforcer has nothing to front.
	ReasonTargetNotFound = "TargetNotFound"
	// ReasonPoliciesRefused: a replica of an EnforcerPool refused a policy's config; the pool's
	// status.policies.refusedPolicies names them.
	ReasonPoliciesRefused = "PoliciesRefused"
)

// StoreConnected is status.enforcer.storeHealth when every replica that reports says its store
// answers; otherwise it is the Degraded reason of the first that does not (RedisUnreachable,
// RedisAuthenticationFailed, RedisTLSFailed).
const StoreConnected = "Connected"
