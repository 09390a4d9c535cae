package crd_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// The bounds of targetRef.bypassProtection admit what is at them; one past each is refused by
// the corpus of test/testdata/invalid (bypass-*.yaml).
func TestBypassProtectionWhenAtItsBoundsThenAccepted(t *testing.T) {
	ns := testenv.Namespace(t, k8s, "bypass-bounds")
	labels := map[string]string{}
	for i := range 8 {
		labels[fmt.Sprintf("l%d", i)] = strings.Repeat("v", 63)
	}
	sixteen := make([]v1alpha1.BypassSource, 16)
	for i := range sixteen {
		sixteen[i] = v1alpha1.BypassSource{Namespace: fmt.Sprintf("ns-%d", i)}
	}
	cases := []struct {
		name    string
		sources []v1alpha1.BypassSource
	}{
		{"when no source is listed then the enforcer alone is admitted", nil},
		{"when 16 sources are listed", sixteen},
		{"when a source has 8 pod labels", []v1alpha1.BypassSource{{PodLabels: labels}}},
		{"when a namespace name has 63 characters", []v1alpha1.BypassSource{{Namespace: strings.Repeat("a", 63), PodLabels: map[string]string{"a": "b"}}}},
		{"when a source is an IPv6 CIDR", []v1alpha1.BypassSource{{CIDR: "fd00::/8"}}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := &v1alpha1.RateLimitPolicy{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: fmt.Sprintf("bounds-%d", i)},
				Spec: v1alpha1.RateLimitPolicySpec{
					TargetRef: v1alpha1.TargetRef{Name: "api", Port: 8080, BypassProtection: &v1alpha1.BypassProtection{AllowedSources: c.sources}},
					Rules:     []v1alpha1.Rule{{Name: "a", FixedWindow: &v1alpha1.Window{Limit: 10, Window: "1s"}}},
				},
			}
			if err := k8s.Create(context.Background(), p); err != nil {
				t.Fatal(err)
			}
		})
	}
}
