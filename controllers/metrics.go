package controllers

import (
	"errors"
	"net"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// Reasons a reconcile failed, the values of sluice_manager_reconcile_errors_total's reason label.
const (
	// errRead: reading the policy's objects, its target or its pods from the API server.
	errRead = "ReadFailed"
	// errRender: the policy could not be rendered into enforcer objects.
	errRender = "RenderFailed"
	// errApply: the API server did not take an enforcer object; retried with backoff.
	errApply = "ApplyFailed"
	// errRejected: the API server refused an enforcer object as invalid; no retry helps.
	errRejected = "ApplyRejected"
	// errInTheWay: an object the policy needs exists and belongs to someone else.
	errInTheWay = "ObjectInTheWay"
	// errStatus: the status could not be written.
	errStatus = "StatusWriteFailed"
)

// Reasons a report could not be read, the values of sluice_manager_report_failures_total's
// reason label.
const (
	// reportTimeoutReason: the enforcer did not answer within reportTimeout.
	reportTimeoutReason = "timeout"
	// reportUnreachable: no connection to the pod's admin port.
	reportUnreachable = "unreachable"
	// reportStatus: the admin port answered with a status other than 200.
	reportStatus = "http_status"
	// reportInvalid: the body was not a report of the version the manager reads.
	reportInvalid = "invalid"
)

// The manager's metrics, beside controller-runtime's own (reconcile totals, latencies, work
// queues), on the same endpoint. Per-policy series carry the policy's namespace and name as the
// enforcers' metrics do, in the labels namespace and policy.
var (
	reconcileErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_manager_reconcile_errors_total",
		Help: "Reconciles of RateLimitPolicies that failed, by reason (ReadFailed, RenderFailed, ApplyFailed, ApplyRejected, ObjectInTheWay, StatusWriteFailed).",
	}, []string{"reason"})
	reportFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_manager_report_failures_total",
		Help: "Enforcer reports the manager could not read, by reason (timeout, unreachable, http_status, invalid).",
	}, []string{"reason"})
	reportReads = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "sluice_manager_report_reads_total",
		Help: "Enforcer reports the manager asked for: each enforcer pod's every report interval, and in reconciles that find no read of a moment ago.",
	})
	appliesTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_manager_applies_total",
		Help: "Server-side apply requests the manager sent for enforcer objects, by kind.",
	}, []string{"kind"})
	replicasDesired = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "sluice_policy_replicas_desired",
		Help: "Enforcer replicas a policy asks for, once its objects are programmed.",
	}, []string{"namespace", "policy"})
	replicasServing = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "sluice_policy_replicas_serving",
		Help: "Enforcer replicas of a policy that are ready and report serving its current configuration revision.",
	}, []string{"namespace", "policy"})
	policyCondition = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "sluice_policy_condition",
		Help: "1 when a policy's condition (Accepted, Programmed, Ready, Degraded) has status True, 0 otherwise; reason is the condition's reason.",
	}, []string{"namespace", "policy", "condition", "reason"})
)

func init() {
	metrics.Registry.MustRegister(reconcileErrors, reportFailures, reportReads, appliesTotal, replicasDesired, replicasServing, policyCondition)
	// Every reason at zero from the start: an alert on increase() sees the first failure.
	for _, r := range []string{errRead, errRender, errApply, errRejected, errInTheWay, errStatus} {
		reconcileErrors.WithLabelValues(r)
	}
	for _, r := range []string{reportTimeoutReason, reportUnreachable, reportStatus, reportInvalid} {
		reportFailures.WithLabelValues(r)
	}
}

// reportError is a report that was read but could not be used.
type reportError struct {
	reason string
	err    error
}

func (e *reportError) Error() string { return e.err.Error() }
func (e *reportError) Unwrap() error { return e.err }

// reportFailureReason classifies why a report could not be read.
func reportFailureReason(err error) string {
	var re *reportError
	var ne net.Error
	switch {
	case errors.As(err, &re):
		return re.reason
	case errors.As(err, &ne) && ne.Timeout():
		return reportTimeoutReason
	}
	return reportUnreachable
}

// exportStatus sets a policy's gauges from the status it was just given. The series it set last
// time are remembered, so that an unchanged status costs a comparison and a changed one touches
// only its own series: deleting by a partial match walks every policy's series.
func exportStatus(key types.NamespacedName, st *v1alpha1.RateLimitPolicyStatus) {
	next := exportedStatus{}
	for _, c := range st.Conditions {
		next.conditions = append(next.conditions, exportedCondition{c.Type, c.Reason, c.Status == metav1.ConditionTrue})
	}
	if e := st.Enforcer; e != nil {
		next.enforcer, next.desired, next.serving = true, e.Replicas, e.ReadyReplicas
	}
	prev, ok := exported.Load(key)
	if ok && prev.(exportedStatus).equal(next) {
		return
	}
	ns, name := key.Namespace, key.Name
	if ok {
		for _, c := range prev.(exportedStatus).conditions {
			policyCondition.DeleteLabelValues(ns, name, c.typ, c.reason)
		}
	}
	for _, c := range next.conditions {
		v := 0.0
		if c.true {
			v = 1
		}
		policyCondition.WithLabelValues(ns, name, c.typ, c.reason).Set(v)
	}
	if next.enforcer {
		replicasDesired.WithLabelValues(ns, name).Set(float64(next.desired))
		replicasServing.WithLabelValues(ns, name).Set(float64(next.serving))
	} else {
		replicasDesired.DeleteLabelValues(ns, name)
		replicasServing.DeleteLabelValues(ns, name)
	}
	exported.Store(key, next)
}

// exported is the last exportedStatus of each policy.
var exported sync.Map // types.NamespacedName -> exportedStatus

// exportedStatus is what exportStatus set for one policy.
type exportedStatus struct {
	conditions       []exportedCondition
	enforcer         bool
	desired, serving int32
}

type exportedCondition struct {
	typ, reason string
	true        bool
}

func (a exportedStatus) equal(b exportedStatus) bool {
	return slices.Equal(a.conditions, b.conditions) && a.enforcer == b.enforcer && a.desired == b.desired && a.serving == b.serving
}

// forgetStatus removes the gauges of a policy that is gone.
func forgetStatus(key types.NamespacedName) {
	prev, ok := exported.LoadAndDelete(key)
	if !ok {
		return // nothing exported, or forgotten already: the lookup of a deleted policy costs nothing
	}
	ns, name := key.Namespace, key.Name
	for _, c := range prev.(exportedStatus).conditions {
		policyCondition.DeleteLabelValues(ns, name, c.typ, c.reason)
	}
	replicasDesired.DeleteLabelValues(ns, name)
	replicasServing.DeleteLabelValues(ns, name)
}
