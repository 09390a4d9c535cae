// Package webhook is the admission webhook of RateLimitPolicy: a typed adapter that validates a
// policy with the same functions the controller and the enforcer call (internal/policy), and
// warns about legal but risky specs. Package internal/certs keeps its certificate.
//
// There is no defaulting webhook: the spec holds what the user wrote. Constant defaults are the
// schema's; values that depend on other fields or on the manager's flags (replicas, images) are
// computed when the policy is reconciled and reported in status.
package webhook

import (
	"context"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/policy"
)

// Deletes are never intercepted: the verbs are create and update only.
// +kubebuilder:webhook:path=/validate-ratelimit-sluice-dev-v1alpha1-ratelimitpolicy,mutating=false,failurePolicy=fail,sideEffects=None,groups=ratelimit.sluice.dev,resources=ratelimitpolicies,verbs=create;update,versions=v1alpha1,name=vratelimitpolicy.sluice.dev,admissionReviewVersions=v1,timeoutSeconds=10

// Setup registers the validating webhook with the manager's webhook server.
func Setup(mgr ctrl.Manager) error {
	return ctrl.NewWebhookManagedBy(mgr, &v1alpha1.RateLimitPolicy{}).
		WithValidator(&Validator{}).
		Complete()
}

// Validator rejects policies that can never work, naming the field, and warns about risky ones.
type Validator struct{}

var _ admission.Validator[*v1alpha1.RateLimitPolicy] = &Validator{}

// ValidateCreate judges a new policy.
func (v *Validator) ValidateCreate(_ context.Context, p *v1alpha1.RateLimitPolicy) (admission.Warnings, error) {
	return validate(p)
}

// ValidateUpdate judges the new version of a policy on its own: nothing in a policy is immutable.
func (v *Validator) ValidateUpdate(_ context.Context, _, p *v1alpha1.RateLimitPolicy) (admission.Warnings, error) {
	return validate(p)
}

// ValidateDelete allows every delete; the webhook is not even registered for deletes.
func (v *Validator) ValidateDelete(context.Context, *v1alpha1.RateLimitPolicy) (admission.Warnings, error) {
	return nil, nil
}

func validate(p *v1alpha1.RateLimitPolicy) (admission.Warnings, error) {
	if errs := policy.Validate(p); len(errs) > 0 {
		return nil, apierrors.NewInvalid(v1alpha1.GroupVersion.WithKind("RateLimitPolicy").GroupKind(), p.Name, errs)
	}
	return Warnings(p), nil
}
