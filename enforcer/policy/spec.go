package policy

import (
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// MaxRedisTimeout bounds storage.redis.timeout: every request may wait this long for Redis before
// its rules apply their failureMode, so a longer timeout turns a Redis outage into a stall.
const MaxRedisTimeout = 5 * time.Second

// validateSpec checks the parts of the spec outside the rules: storage and the enforcer. The
// schema already says most of this in CEL; saying it again here keeps the judgement the same for
// objects that never passed through the API server, such as the enforcer's own policy file.
func validateSpec(s *v1alpha1.RateLimitPolicySpec, spec *field.Path) field.ErrorList {
	var errs field.ErrorList
	target := spec.Child("targetRef")
	if msgs := validation.IsDNS1035Label(s.TargetRef.Name); len(msgs) > 0 {
		errs = append(errs, field.Invalid(target.Child("name"), s.TargetRef.Name, "must be a Service name: "+strings.Join(msgs, "; ")))
	}
	if msgs := validation.IsValidPortNum(int(s.TargetRef.Port)); len(msgs) > 0 {
		errs = append(errs, field.Invalid(target.Child("port"), s.TargetRef.Port, strings.Join(msgs, "; ")))
	}
	shared := false
	if st := s.Storage; st != nil {
		p := spec.Child("storage")
		set := 0
		for _, b := range []bool{st.Memory != nil, st.Redis != nil, st.ManagedRedis != nil} {
			if b {
				set++
			}
		}
		if set != 1 {
			errs = append(errs, field.Invalid(p, fmt.Sprintf("%d members set", set), "exactly one of memory, redis or managedRedis must be set"))
		}
		if st.Redis != nil {
			shared = true
			errs = append(errs, validateRedis(st.Redis, p.Child("redis"))...)
		}
		if st.ManagedRedis != nil {
			shared = true
			errs = append(errs, validateManagedRedis(st.ManagedRedis, p.Child("managedRedis"))...)
		}
	}
	if e := s.Enforcer; e != nil {
		p := spec.Child("enforcer")
		if e.Replicas != nil && *e.Replicas > 1 && !shared {
			errs = append(errs, field.Invalid(p.Child("replicas"), *e.Replicas,
				"memory storage keeps counters inside one enforcer, so enforcer.replicas must be 1; use storage.redis or storage.managedRedis to run more replicas"))
		}
		errs = append(errs, validateResources(e.Resources, p.Child("resources"))...)
	}
	return errs
}

func validateRedis(r *v1alpha1.RedisStorage, p *field.Path) field.ErrorList {
	var errs field.ErrorList
	mode := r.Mode
	oneOf(mode, true, redisModes, p.Child("mode"), &errs)
	if mode == "" {
		mode = v1alpha1.RedisStandalone
	}
	switch {
	case mode == v1alpha1.RedisSentinel && r.MasterName == "":
		errs = append(errs, field.Required(p.Child("masterName"), "masterName is required with mode Sentinel"))
	case mode != v1alpha1.RedisSentinel && r.MasterName != "":
		errs = append(errs, field.Invalid(p.Child("masterName"), r.MasterName, "masterName is only used with mode Sentinel"))
	}
	if mode == v1alpha1.RedisCluster && r.Database != nil && *r.Database != 0 {
		errs = append(errs, field.Invalid(p.Child("database"), *r.Database, "database must be 0 with mode Cluster: Redis Cluster has only database 0"))
	}
	if mode == v1alpha1.RedisStandalone && len(r.Addresses) != 1 {
		errs = append(errs, field.Invalid(p.Child("addresses"), len(r.Addresses), "mode Standalone takes exactly one address"))
	}
	for i, a := range r.Addresses {
		host, port, err := net.SplitHostPort(string(a))
		if n, perr := strconv.Atoi(port); err != nil || host == "" || perr != nil || n < 1 || n > 65535 {
			errs = append(errs, field.Invalid(p.Child("addresses").Index(i), a, "must be host:port, such as redis.example:6379 or [fd00::1]:6379"))
		}
	}
	if r.Timeout != nil {
		path := p.Child("timeout")
		if d := duration(*r.Timeout, path, &errs); d > MaxRedisTimeout {
			errs = append(errs, field.Invalid(path, *r.Timeout, fmt.Sprintf(
				"must be at most %v: every request waits up to this long for Redis before failureMode applies", MaxRedisTimeout)))
		}
	}
	return errs
}

func validateManagedRedis(m *v1alpha1.ManagedRedis, p *field.Path) field.ErrorList {
	var errs field.ErrorList
	if mm := m.MaxMemory; mm != nil {
		switch {
		case mm.Sign() <= 0:
			errs = append(errs, field.Invalid(p.Child("maxMemory"), mm.String(), "must be more than 0"))
		case m.Resources != nil && m.Resources.Limits.Memory() != nil && !m.Resources.Limits.Memory().IsZero() && mm.Cmp(*m.Resources.Limits.Memory()) > 0:
			errs = append(errs, field.Invalid(p.Child("maxMemory"), mm.String(), fmt.Sprintf(
				"must not exceed resources.limits.memory (%s): Redis would be killed for running out of memory before it evicts", m.Resources.Limits.Memory())))
		}
	}
	return append(errs, validateResources(m.Resources, p.Child("resources"))...)
}

// validateResources rejects requests above limits, which the Deployment would refuse later, out
// of the user's sight.
func validateResources(r *corev1.ResourceRequirements, p *field.Path) field.ErrorList {
	if r == nil {
		return nil
	}
	var errs field.ErrorList
	for _, name := range slices.Sorted(maps.Keys(r.Requests)) {
		req := r.Requests[name]
		if limit, ok := r.Limits[name]; ok && req.Cmp(limit) > 0 {
			errs = append(errs, field.Invalid(p.Child("requests").Key(string(name)), req.String(),
				fmt.Sprintf("must be less than or equal to the %s limit (%s)", name, limit.String())))
		}
	}
	return errs
}

// Values of the schema's enums, for files that never passed through the API server. A value
// outside them, such as failureMode: closed, must be refused, never read as the default.
var (
	httpMethods    = []v1alpha1.HTTPMethod{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"}
	pathMatchTypes = []v1alpha1.PathMatchType{v1alpha1.PathMatchExact, v1alpha1.PathMatchPrefix, v1alpha1.PathMatchRegularExpression}
	keySourceTypes = []v1alpha1.KeySourceType{v1alpha1.KeyRemoteAddress, v1alpha1.KeyHeader, v1alpha1.KeyMethod, v1alpha1.KeyPath}
	failureModes   = []v1alpha1.FailureMode{v1alpha1.FailOpen, v1alpha1.FailClosed}
	ruleModes      = []v1alpha1.RuleMode{v1alpha1.ModeEnforce, v1alpha1.ModeShadow}
	redisModes     = []v1alpha1.RedisMode{v1alpha1.RedisStandalone, v1alpha1.RedisSentinel, v1alpha1.RedisCluster}
)

// oneOf adds an error when v is not one of an enum's values; optional enums skip the empty value.
func oneOf[T ~string](v T, optional bool, values []T, p *field.Path, errs *field.ErrorList) {
	if (optional && v == "") || slices.Contains(values, v) {
		return
	}
	names := make([]string, len(values))
	for i, s := range values {
		names[i] = string(s)
	}
	*errs = append(*errs, field.NotSupported(p, v, names))
}
