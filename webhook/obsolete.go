package webhook

import (
	"context"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
)

// ObsoleteDefaultingWebhook is the MutatingWebhookConfiguration that earlier versions installed
// for their defaulting webhook. Left behind by an upgrade, it would send every write of a policy
// to a path no manager serves, with a caBundle no manager renews, and fail it.
const ObsoleteDefaultingWebhook = "sluice-mutating-webhook-configuration"

// +kubebuilder:rbac:groups=admissionregistration.k8s.io,resources=mutatingwebhookconfigurations,resourceNames=sluice-mutating-webhook-configuration,verbs=delete

// RemoveObsolete deletes the ObsoleteDefaultingWebhook configuration when a manager starts. Every
// replica runs it, leader or not: until it is gone, policies cannot be written.
type RemoveObsolete struct {
	Client client.Client
	Name   string
}

// NeedLeaderElection is false: see RemoveObsolete.
func (RemoveObsolete) NeedLeaderElection() bool { return false }

// Start deletes the configuration, if it exists. A failure is logged, not fatal: the webhook that
// validates policies works either way.
func (r RemoveObsolete) Start(ctx context.Context) error {
	cfg := &admissionregistrationv1.MutatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: r.Name}}
	switch err := r.Client.Delete(ctx, cfg); {
	case err == nil:
		logf.FromContext(ctx).Info("Deleted the obsolete defaulting webhook configuration of an earlier version", "name", r.Name)
	case client.IgnoreNotFound(err) != nil:
		logf.FromContext(ctx).Error(err, "Unable to delete the obsolete defaulting webhook configuration; delete it by hand, or writes of policies fail", "name", r.Name)
	}
	return nil
}
