package policy

import (
	"fmt"
	"maps"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// MaxRedisTimeout bounds storage.redis.timeout: every request may wait this long for Redis before
// its rules apply their failureMode, so a longer timeout turns a Redis outage into a stall.
const MaxRedisTimeout = 5 * time.Second

// validateSpec checks the parts of the spec outside the rules that the schema cannot: requests
// within limits, Redis's timeout, a managed Redis's memory within its limit, and the label syntax
// of the bypass protection's sources.
func validateSpec(s *v1alpha1.RateLimitPolicySpec, spec *field.Path) field.ErrorList {
	var errs field.ErrorList
	if st := s.Storage; st != nil {
		p := spec.Child("storage")
		if st.Redis != nil {
			errs = append(errs, validateRedis(st.Redis, p.Child("redis"))...)
		}
		if st.ManagedRedis != nil {
			errs = append(errs, validateManagedRedis(st.ManagedRedis, p.Child("managedRedis"))...)
		}
	}
	if b := s.TargetRef.BypassProtection; b != nil {
		p := spec.Child("targetRef", "bypassProtection", "allowedSources")
		for i, src := range b.AllowedSources {
			errs = append(errs, metav1validation.ValidateLabels(src.PodLabels, p.Index(i).Child("podLabels"))...)
		}
	}
	if e := s.Enforcer; e != nil {
		errs = append(errs, validateResources(e.Resources, spec.Child("enforcer", "resources"))...)
	}
	return errs
}

func validateRedis(r *v1alpha1.RedisStorage, p *field.Path) field.ErrorList {
	var errs field.ErrorList
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
	// The schema holds maxMemory above 0; its memory limit is in another field.
	if mm := m.MaxMemory; mm != nil && m.Resources != nil && m.Resources.Limits.Memory() != nil &&
		!m.Resources.Limits.Memory().IsZero() && mm.Cmp(*m.Resources.Limits.Memory()) > 0 {
		errs = append(errs, field.Invalid(p.Child("maxMemory"), mm.String(), fmt.Sprintf(
			"must not exceed resources.limits.memory (%s): Redis would be killed for running out of memory before it evicts", m.Resources.Limits.Memory())))
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

// ValidatePool checks what the schema cannot say of an EnforcerPool, as Validate does of a
// policy: its Redis's timeout, a managed Redis's memory within its limit, requests within limits,
// and the label selector of the namespaces it admits.
func ValidatePool(p *v1alpha1.EnforcerPool) field.ErrorList {
	spec := field.NewPath("spec")
	var errs field.ErrorList
	if st := p.Spec.Storage; st != nil {
		path := spec.Child("storage")
		if st.Redis != nil {
			errs = append(errs, validateRedis(st.Redis, path.Child("redis"))...)
		}
		if st.ManagedRedis != nil {
			errs = append(errs, validateManagedRedis(st.ManagedRedis, path.Child("managedRedis"))...)
		}
	}
	errs = append(errs, validateResources(p.Spec.Resources, spec.Child("resources"))...)
	if a := p.Spec.AllowedPolicies; a != nil && a.Namespaces != nil && a.Namespaces.Selector != nil {
		path := spec.Child("allowedPolicies", "namespaces", "selector")
		if _, err := metav1.LabelSelectorAsSelector(a.Namespaces.Selector); err != nil {
			errs = append(errs, field.Invalid(path, a.Namespaces.Selector, err.Error()))
		}
	}
	return errs
}
