// Package webhook is the admission webhook of RateLimitPolicy: typed adapters that default a
// policy, validate it with the same functions the controller and the enforcer call
// (enforcer/policy), and warn about legal but risky specs. Package certs keeps its certificate.
package webhook

import (
	"context"
	"encoding/json"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/controllers/render"
	"github.com/sluice-dev/sluice/enforcer/policy"
)

// Deletes are never intercepted: the verbs are create and update only.
// +kubebuilder:webhook:path=/mutate-ratelimit-sluice-dev-v1alpha1-ratelimitpolicy,mutating=true,failurePolicy=fail,sideEffects=None,groups=ratelimit.sluice.dev,resources=ratelimitpolicies,verbs=create;update,versions=v1alpha1,name=mratelimitpolicy.sluice.dev,admissionReviewVersions=v1,timeoutSeconds=10
// +kubebuilder:webhook:path=/validate-ratelimit-sluice-dev-v1alpha1-ratelimitpolicy,mutating=false,failurePolicy=fail,sideEffects=None,groups=ratelimit.sluice.dev,resources=ratelimitpolicies,verbs=create;update,versions=v1alpha1,name=vratelimitpolicy.sluice.dev,admissionReviewVersions=v1,timeoutSeconds=10

// mutatePath is the path of the defaulting webhook, as the marker above says.
const mutatePath = "/mutate-ratelimit-sluice-dev-v1alpha1-ratelimitpolicy"

// Setup registers the defaulting and validating webhooks with the manager's webhook server.
func Setup(mgr ctrl.Manager, defaults render.Defaults) error {
	mutate := admission.WithDefaulter(mgr.GetScheme(), &Defaulter{Defaults: defaults})
	mgr.GetWebhookServer().Register(mutatePath, &admission.Webhook{Handler: schemaFirst{mutate}})
	return ctrl.NewWebhookManagedBy(mgr, &v1alpha1.RateLimitPolicy{}).
		WithValidator(&Validator{}).
		Complete()
}

// schemaFirst lets through, unchanged, an object that does not even decode as a policy (a string
// where the schema wants a list, say). The API server checks the schema after the defaulting
// webhook, and its message names every wrong field; a decoding error would name only the first,
// in Go's terms.
type schemaFirst struct{ admission.Handler }

func (h schemaFirst) Handle(ctx context.Context, req admission.Request) admission.Response {
	if err := json.Unmarshal(req.Object.Raw, &v1alpha1.RateLimitPolicy{}); err != nil {
		return admission.Allowed("left to the schema: " + err.Error())
	}
	return h.Handler.Handle(ctx, req)
}

// Defaulter writes into the stored policy every value the controller would otherwise assume, so
// that `kubectl get -o yaml` shows what runs.
type Defaulter struct {
	// Defaults are the manager's images.
	Defaults render.Defaults
}

var _ admission.Defaulter[*v1alpha1.RateLimitPolicy] = &Defaulter{}

// Default fills in what depends on the manager or on other fields. Constant defaults (cost,
// mode, path type, defaultFailureMode, Redis mode, passwordKey, maxMemory) are the schema's,
// which the API server applies before this webhook runs; setting them here again would only turn
// an explicit invalid value such as mode: "" into a valid one, which a standalone enforcer's
// loader, judging by the schema alone, would refuse. A rule without a failureMode follows
// defaultFailureMode when compiled, so that changing defaultFailureMode changes every such rule.
// It runs before the schema is checked, so it must not assume that the policy is valid.
func (d *Defaulter) Default(_ context.Context, p *v1alpha1.RateLimitPolicy) error {
	s := &p.Spec
	if st := s.Storage; st != nil {
		if r := st.Redis; r != nil && r.Timeout == nil {
			r.Timeout = ptr.To(v1alpha1.DefaultRedisTimeout)
		}
		if m := st.ManagedRedis; m != nil && m.Image == "" {
			m.Image = d.Defaults.RedisImage
		}
	}
	if s.Enforcer == nil {
		s.Enforcer = &v1alpha1.EnforcerSpec{}
	}
	if s.Enforcer.Replicas == nil {
		s.Enforcer.Replicas = ptr.To(render.Replicas(p))
	}
	if s.Enforcer.Image == "" {
		s.Enforcer.Image = d.Defaults.EnforcerImage
	}
	return nil
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
