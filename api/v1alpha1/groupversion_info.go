// Package v1alpha1 contains the v1alpha1 API of the ratelimit.sluice.dev group.
//
// +kubebuilder:object:generate=true
// +groupName=ratelimit.sluice.dev
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var (
	// GroupVersion is the group and version of the objects in this package.
	GroupVersion = schema.GroupVersion{Group: "ratelimit.sluice.dev", Version: "v1alpha1"}

	// SchemeBuilder registers the types of this package with a scheme.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)

	// AddToScheme adds the types of this package to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &RateLimitPolicy{}, &RateLimitPolicyList{}, &EnforcerPool{}, &EnforcerPoolList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
