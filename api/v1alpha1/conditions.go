package v1alpha1

// Condition types of a RateLimitPolicy. GitOps tools read health from Ready.
const (
	// ConditionAccepted tells whether the spec is valid and the policy owns its target Service.
	ConditionAccepted = "Accepted"
	// ConditionProgrammed tells whether the enforcer objects were applied with the current spec.
	ConditionProgrammed = "Programmed"
	// ConditionReady tells whether the enforcer runs the current config revision on all its
	// replicas, so that traffic is limited exactly as the spec says.
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
	// ReasonAvailable: all enforcer replicas run the current config revision.
	ReasonAvailable = "Available"
	// ReasonRollingOut: the enforcer Deployment is rolling out the current config revision.
	ReasonRollingOut = "RollingOut"
	// ReasonNotProgrammed: the enforcer is not ready because it is not programmed.
	ReasonNotProgrammed = "NotProgrammed"
)

// Reasons of the Degraded condition.
const (
	// ReasonAsExpected: nothing weakens enforcement.
	ReasonAsExpected = "AsExpected"
	// ReasonRedisUnreachable: the configured Redis does not answer; rules apply their failure mode.
	ReasonRedisUnreachable = "RedisUnreachable"
	// ReasonTargetNotFound: the target Service does not exist, so the enforcer has nothing to front.
	ReasonTargetNotFound = "TargetNotFound"
)
