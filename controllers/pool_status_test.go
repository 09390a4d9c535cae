package controllers

import (
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/report"
)

// Every condition and reason of a pool, from the observations that lead to it, and the policies
// and replicas its status lists.
func TestComputePoolStatusWhenObservedThenConditionsPoliciesAndReplicas(t *testing.T) {
	dep := func(replicas int32) *appsv1.Deployment {
		return &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Generation: 1},
			Status: appsv1.DeploymentStatus{ObservedGeneration: 1, Replicas: replicas, UpdatedReplicas: replicas, AvailableReplicas: replicas}}
	}
	rep := func(pod string, synced bool, served []string, refused ...string) replica {
		r := &report.Report{Synced: synced, Store: report.Store{Connected: true}}
		for _, id := range served {
			r.Policies = append(r.Policies, report.PolicyServed{Policy: id, Revision: "r"})
		}
		for _, id := range refused {
			r.Refused = append(r.Refused, report.PolicyRefused{Policy: id, Reason: "does not load"})
		}
		return replica{pod: pod, ready: true, report: r}
	}
	observe := func(d *appsv1.Deployment, pods ...replica) poolObservation {
		return poolObservation{progress: progress{programmed: true, replicas: 2, deployment: d, pods: pods}, image: "img", storage: "redis-standalone", service: "sluice-pool-x"}
	}
	down := rep("p-b", true, []string{"a/1"})
	down.report.Store = report.Store{Cause: report.CauseAuthentication, Message: "WRONGPASS"}
	type cond struct {
		status         metav1.ConditionStatus
		reason, prefix string
	}
	cases := []struct {
		name     string
		obs      poolObservation
		want     map[string]cond
		policies *v1alpha1.PoolPolicies
	}{
		{"when every replica is ready and synced then Ready, counting the policies all serve", observe(dep(2), rep("p-a", true, []string{"a/1", "a/2"}), rep("p-b", true, []string{"a/1", "a/2", "a/3"})),
			map[string]cond{v1alpha1.ConditionReady: {"True", v1alpha1.ReasonAvailable, "2/2 replicas serve the pool's policies"},
				v1alpha1.ConditionDegraded: {"False", v1alpha1.ReasonAsExpected, ""}, v1alpha1.ConditionReconciling: {"False", v1alpha1.ReasonAvailable, ""}},
			&v1alpha1.PoolPolicies{Served: 2}},
		{"when a replica has not loaded the pool's policies then Unavailable, naming it", observe(dep(2), rep("p-a", true, nil), rep("p-b", false, nil)),
			map[string]cond{v1alpha1.ConditionReady: {"False", v1alpha1.ReasonUnavailable, "1/2 replicas serve the pool's policies; p-b has not loaded"}},
			&v1alpha1.PoolPolicies{}},
		{"when a replica does not report then Unavailable, saying why", observe(dep(2), rep("p-a", true, nil), replica{pod: "p-b", ready: true, err: errors.New("connection refused")}),
			map[string]cond{v1alpha1.ConditionReady: {"False", v1alpha1.ReasonUnavailable, "1/2 replicas serve the pool's policies; p-b did not report: connection refused"}},
			&v1alpha1.PoolPolicies{}},
		{"when a replica refuses a policy then Degraded PoliciesRefused, listing it", observe(dep(2), rep("p-a", true, []string{"a/1"}, "a/9"), rep("p-b", true, []string{"a/1"})),
			map[string]cond{v1alpha1.ConditionReady: {"True", v1alpha1.ReasonAvailable, ""},
				v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonPoliciesRefused, "replica p-a refused 1 policies' configs"}},
			&v1alpha1.PoolPolicies{Served: 1, Refused: 1, RefusedPolicies: []v1alpha1.RefusedPolicy{{Policy: "a/9", Message: "does not load"}}}},
		{"when a replica's store refuses it then Degraded in its words", observe(dep(2), rep("p-a", true, []string{"a/1"}), down),
			map[string]cond{v1alpha1.ConditionDegraded: {"True", v1alpha1.ReasonRedisAuthenticationFailed, "replica p-b: WRONGPASS"}},
			&v1alpha1.PoolPolicies{Served: 1}},
		{"when the spec is invalid then not Accepted and Stalled", poolObservation{invalid: "spec.storage.redis.timeout: too long"},
			map[string]cond{v1alpha1.ConditionAccepted: {"False", v1alpha1.ReasonInvalid, ""}, v1alpha1.ConditionStalled: {"True", v1alpha1.ReasonInvalid, ""},
				v1alpha1.ConditionReady: {"False", v1alpha1.ReasonNotProgrammed, ""}}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pool := &v1alpha1.EnforcerPool{ObjectMeta: metav1.ObjectMeta{Generation: 4}}
			st := computePoolStatus(pool, c.obs, true, t0)
			for typ, want := range c.want {
				got := meta.FindStatusCondition(st.Conditions, typ)
				if got == nil || got.Status != want.status || got.Reason != want.reason || got.ObservedGeneration != 4 ||
					len(got.Message) < len(want.prefix) || got.Message[:len(want.prefix)] != want.prefix {
					t.Errorf("%s = %+v, want %s %s %q...", typ, got, want.status, want.reason, want.prefix)
				}
			}
			if diff := cmp.Diff(c.policies, st.Policies); diff != "" {
				t.Errorf("status.policies (-want +got):\n%s", diff)
			}
			if c.obs.programmed && (len(st.ReplicaStatuses) != len(c.obs.pods) || st.Replicas != 2 || st.ServiceName != "sluice-pool-x") {
				t.Errorf("status %+v", st)
			}
		})
	}
}
