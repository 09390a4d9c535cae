package controllers

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// poolObservation is what one reconcile of a pool learned. Its status is a pure function of it.
type poolObservation struct {
	// invalid is the validation error, if the spec is invalid.
	invalid string
	progress
	image, storage, service string
}

// maxRefusedListed bounds status.policies.refusedPolicies, as its schema does.
const maxRefusedListed = 16

// computePoolStatus derives a pool's status from an observation made at now, as computeStatus
// does a policy's: conditions that change status transition at now.
func computePoolStatus(pool *v1alpha1.EnforcerPool, obs poolObservation, reconciled bool, now time.Time) v1alpha1.EnforcerPoolStatus {
	st := *pool.Status.DeepCopy()
	set := conditionSetter(&st.Conditions, pool.Generation, now)
	rejection := ""
	if obs.invalid != "" {
		rejection = v1alpha1.ReasonInvalid
	}
	rd := obs.readiness(poolServes, "replicas serve the pool's policies")
	degraded, why, text := poolDegradation(obs)
	st.Reason = setConditions(set, rejection, obs.invalid, obs.progress, "the pool's objects are applied", rd, degraded, why, text)
	if obs.programmed {
		st.ServiceName, st.Replicas, st.Image, st.Storage = obs.service, obs.replicas, obs.image, obs.storage
		st.ReadyReplicas, st.Ready = rd.serving, fmt.Sprintf("%d/%d", rd.serving, obs.replicas)
		st.Policies, st.ReplicaStatuses = poolPolicies(obs.pods), poolReplicas(obs.pods)
	}
	if reconciled {
		st.ObservedGeneration = pool.Generation
	}
	return st
}

// poolServes is what a replica does with the pool's policies: it serves them once it has loaded
// every one the API server held when it started watching.
func poolServes(r replica) service {
	if !r.report.Synced {
		return service{missing: r.pod + " has not loaded the pool's policies yet"}
	}
	return service{serves: true}
}

// poolDegradation tells what weakens the pool: a replica's store that does not answer, in its
// words, or a policy a replica refused.
func poolDegradation(obs poolObservation) (bool, string, string) {
	pods := byName(obs.pods)
	if reason, msg := storeDegradation(pods); reason != "" {
		return true, reason, msg
	}
	for _, r := range pods {
		if r.report != nil && len(r.report.Refused) > 0 {
			f := r.report.Refused[0]
			return true, v1alpha1.ReasonPoliciesRefused, fmt.Sprintf("replica %s refused %d policies' configs, the others are served; %s: %s",
				r.pod, len(r.report.Refused), f.Policy, f.Reason)
		}
	}
	return false, v1alpha1.ReasonAsExpected, ""
}

// poolPolicies counts the policies every reporting replica serves, and those any refuses.
func poolPolicies(pods []replica) *v1alpha1.PoolPolicies {
	served := map[string]int{}
	reporting := 0
	refused := map[string]string{}
	for _, r := range pods {
		if r.report == nil {
			continue
		}
		reporting++
		for _, s := range r.report.Policies {
			served[s.Policy]++
		}
		for _, f := range r.report.Refused {
			if _, ok := refused[f.Policy]; !ok {
				refused[f.Policy] = f.Reason
			}
		}
	}
	if reporting == 0 {
		return nil
	}
	out := &v1alpha1.PoolPolicies{Refused: int32(len(refused))}
	for _, n := range served {
		if n == reporting {
			out.Served++
		}
	}
	ids := make([]string, 0, len(refused))
	for id := range refused {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids[:min(len(ids), maxRefusedListed)] {
		msg := refused[id]
		if len(msg) > 1024 {
			msg = msg[:1020] + "..."
		}
		out.RefusedPolicies = append(out.RefusedPolicies, v1alpha1.RefusedPolicy{Policy: id, Message: msg})
	}
	return out
}

// maxReplicasListed bounds status.replicaStatuses, as its schema does.
const maxReplicasListed = 100

// poolReplicas lists the pool's pods as they report, by name.
func poolReplicas(pods []replica) []v1alpha1.PoolReplica {
	var out []v1alpha1.PoolReplica
	for _, r := range pods {
		rs := v1alpha1.PoolReplica{Name: r.pod}
		switch {
		case r.err != nil:
			rs.Store = "did not report: " + r.err.Error()
		case r.report.Store.Connected:
			rs.Ready, rs.Store = r.ready && r.report.Synced, "connected"
		default:
			rs.Ready, rs.Store = r.ready && r.report.Synced, r.report.Store.Message
		}
		if r.report != nil {
			rs.Policies, rs.Refused = int32(len(r.report.Policies)), int32(len(r.report.Refused))
		}
		if len(rs.Store) > 1024 {
			rs.Store = rs.Store[:1020] + "..."
		}
		out = append(out, rs)
	}
	slices.SortFunc(out, func(a, b v1alpha1.PoolReplica) int { return strings.Compare(a.Name, b.Name) })
	return out[:min(len(out), maxReplicasListed)]
}

// poolNoticeable tells whether a pool's status change is one to write at once, rather than moved
// counts or reworded messages.
func poolNoticeable(old, cur *v1alpha1.EnforcerPoolStatus) bool {
	if old.ObservedGeneration != cur.ObservedGeneration || len(old.Conditions) != len(cur.Conditions) || old.ReadyReplicas != cur.ReadyReplicas ||
		old.Replicas != cur.Replicas || old.Image != cur.Image || old.Storage != cur.Storage || old.ServiceName != cur.ServiceName ||
		len(old.ReplicaStatuses) != len(cur.ReplicaStatuses) {
		return true
	}
	for _, c := range cur.Conditions {
		o := meta.FindStatusCondition(old.Conditions, c.Type)
		if o == nil || o.Status != c.Status || o.Reason != c.Reason || o.ObservedGeneration != c.ObservedGeneration {
			return true
		}
	}
	return false
}
