package controllers

import (
	"errors"
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// An apply error no retry can fix is Stalled, and the policy is no longer Reconciling; a transient
// one keeps it Reconciling, so kstatus waits.
func TestComputeStatusWhenApplyFailsThenStalledOnlyWhenFinal(t *testing.T) {
	cases := []struct {
		name                 string
		obs                  observation
		stalled, reconciling bool
	}{
		{"when the error is final then Stalled and not Reconciling",
			observation{applyErr: errors.New("ConfigMap x exists and is not owned by this policy"), stalled: true}, true, false},
		{"when the error is transient then Reconciling and not Stalled",
			observation{applyErr: errors.New("etcdserver: request timed out")}, false, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := &v1alpha1.RateLimitPolicy{}
			st := computeStatus(p, c.obs, false)
			if got := meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionStalled); got != c.stalled {
				t.Errorf("Stalled = %v, want %v", got, c.stalled)
			}
			if got := meta.IsStatusConditionTrue(st.Conditions, v1alpha1.ConditionReconciling); got != c.reconciling {
				t.Errorf("Reconciling = %v, want %v", got, c.reconciling)
			}
			if prog := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionProgrammed); prog == nil || prog.Reason != v1alpha1.ReasonApplyFailed {
				t.Errorf("Programmed = %+v, want False ApplyFailed", prog)
			}
		})
	}
}
