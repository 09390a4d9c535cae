// Package report is what an enforcer replica says about itself on its admin port, at Path: the
// config revision it serves, its store's health as it sees it, and its per-rule counters. The
// enforcer serves it and the manager reads it into the policy's status; both use these types.
package report

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"time"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// Path is where the admin server serves the report.
const Path = "/report"

// Version is the report format. A reader refuses a report of another version rather than
// misreading it.
const Version = "sluice.dev/report/v1"

// Report is one replica's account of itself.
type Report struct {
	Version string `json:"version"`
	// Started is when the process started; the counters count from then.
	Started time.Time `json:"started"`
	// Revision is the config revision the replica decides requests with (see Revision), and
	// RevisionSince when it began to.
	Revision      string    `json:"revision"`
	RevisionSince time.Time `json:"revisionSince"`
	// ConfigSource is where the replica took its config from last: SourceAPI or SourceFile.
	ConfigSource string `json:"configSource"`
	Store        Store  `json:"store"`
	// Rules are the rules of the served config, in order, with their counters.
	Rules []Rule `json:"rules"`

	// Pool is, for a replica of an EnforcerPool, the pool's "<namespace>/<name>"; Revision is
	// then empty, and Policies and Refused say what it serves, policy by policy.
	Pool string `json:"pool,omitempty"`
	// Synced is, in a pool, true once the replica has loaded every policy the API server held
	// when it started watching.
	Synced bool `json:"synced,omitempty"`
	// Policies are, in a pool, the policies the replica serves, by ID, each with the revision
	// of its config (see Revision) and since when.
	Policies []PolicyServed `json:"policies,omitempty"`
	// Refused are, in a pool, the configs the replica was given and refused, by ID: a policy
	// refused at its latest revision while it serves an earlier one is in both lists.
	Refused []PolicyRefused `json:"refused,omitempty"`
}

// PolicyServed is a policy a pool replica serves.
type PolicyServed struct {
	// Policy is the policy's "<namespace>/<name>".
	Policy   string    `json:"policy"`
	Revision string    `json:"revision"`
	Since    time.Time `json:"since"`
}

// PolicyRefused is a policy config a pool replica refused, and why.
type PolicyRefused struct {
	// Policy is the policy's "<namespace>/<name>", as its ConfigMap names it.
	Policy   string `json:"policy"`
	Revision string `json:"revision"`
	Reason   string `json:"reason"`
}

// Config sources.
const (
	// SourceFile is the policy file: at start, in standalone mode, and while the API server
	// cannot be reached.
	SourceFile = "file"
	// SourceAPI is the enforcer's ConfigMap, watched through the API server.
	SourceAPI = "api"
)

// Store is the store's health as the replica sees it.
type Store struct {
	// Kind is memory, redis-standalone, redis-sentinel or redis-cluster: StoreKind.
	Kind string `json:"kind"`
	// Connected is false when the last ping failed; Cause and Message then say why.
	Connected bool `json:"connected"`
	// BreakerOpen is true while decisions skip the store and rules apply their failure modes.
	BreakerOpen bool `json:"breakerOpen,omitempty"`
	// Cause is one of the Cause constants when not connected.
	Cause string `json:"cause,omitempty"`
	// Message is the error as the store reported it, the server's own words when it answered.
	Message string `json:"message,omitempty"`
	// Since is when Connected last changed.
	Since time.Time `json:"since"`
}

// Causes of a store that is not connected.
const (
	// CauseAuthentication: the server refused the credentials (WRONGPASS, NOAUTH, NOPERM).
	CauseAuthentication = "authentication"
	// CauseTLS: the TLS handshake failed, such as a certificate that does not verify.
	CauseTLS = "tls"
	// CauseTimeout: the server did not answer within the timeout.
	CauseTimeout = "timeout"
	// CauseUnreachable: anything else, such as a refused connection or an unknown host.
	CauseUnreachable = "unreachable"
)

// Rule is one rule's decisions since the process started.
type Rule struct {
	// Policy is the rule's policy, "<namespace>/<name>".
	Policy string `json:"policy"`
	Name   string `json:"name"`
	Counters
}

// Counters count the decisions of one rule, as sluice_decisions_total does by result, and the
// responses it charged, as sluice_response_charges_total does (all but failed).
type Counters struct {
	Allowed       uint64 `json:"allowed"`
	Limited       uint64 `json:"limited"`
	ShadowLimited uint64 `json:"shadowLimited"`
	FailedOpen    uint64 `json:"failedOpen"`
	FailedClosed  uint64 `json:"failedClosed"`
	Skipped       uint64 `json:"skipped,omitempty"`
	Charged       uint64 `json:"charged,omitempty"`
}

// Add returns c+o.
func (c Counters) Add(o Counters) Counters {
	return Counters{c.Allowed + o.Allowed, c.Limited + o.Limited, c.ShadowLimited + o.ShadowLimited,
		c.FailedOpen + o.FailedOpen, c.FailedClosed + o.FailedClosed, c.Skipped + o.Skipped, c.Charged + o.Charged}
}

// Sub returns c-o, each counter at least 0.
func (c Counters) Sub(o Counters) Counters {
	sub := func(a, b uint64) uint64 {
		if a < b {
			return 0
		}
		return a - b
	}
	return Counters{sub(c.Allowed, o.Allowed), sub(c.Limited, o.Limited), sub(c.ShadowLimited, o.ShadowLimited),
		sub(c.FailedOpen, o.FailedOpen), sub(c.FailedClosed, o.FailedClosed), sub(c.Skipped, o.Skipped), sub(c.Charged, o.Charged)}
}

// Revision identifies a policy file by its content: the controller names the config it renders
// with it, and the enforcer the config it loaded, so the two agree without either taking the
// other's word.
func Revision(policyFile []byte) string {
	sum := sha256.Sum256(policyFile)
	return hex.EncodeToString(sum[:8])
}

// StoreKind names a store in reports and in status: memory, or redis- and the Redis topology in
// lower case (mode "" is Standalone, as the store takes it).
func StoreKind(redis bool, mode v1alpha1.RedisMode) string {
	if !redis {
		return "memory"
	}
	if mode == "" {
		mode = v1alpha1.RedisStandalone
	}
	return "redis-" + strings.ToLower(string(mode))
}

// The contract of a pool's config: the manager writes one ConfigMap per policy into the pool's
// namespace, labelled PoolLabel with PoolLabelValue of the pool's name and annotated
// PolicyAnnotation with the policy's "<namespace>/<name>", its policy file under PolicyFileKey;
// the pool's enforcers watch the ConfigMaps of their namespace with that label.
const (
	PoolLabel        = "ratelimit.sluice.dev/pool"
	PolicyAnnotation = "ratelimit.sluice.dev/policy"
	PolicyFileKey    = "policy.yaml"
)

// LabelValue is name if it fits a label value, which holds at most 63 characters. A longer
// name, up to the 253 of an object name, is cut to leave room and followed by "-" and 8 hex
// digits of its SHA-256, as cluster-api's util/labels/format does: valid, stable, and distinct
// for names that share their first 54 characters.
func LabelValue(name string) string {
	const most = 63
	if len(name) <= most {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	suffix := "-" + hex.EncodeToString(sum[:4])
	return name[:most-len(suffix)] + suffix
}
