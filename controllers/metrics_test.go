package controllers_test

import (
	"context"
	"syscall"
	"testing"

	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// metric reads a series of the manager's registry, the one its /metrics serves: its value, and
// whether it exists.
func metric(t *testing.T, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	families, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for k, v := range labels {
				if !hasLabel(m, k, v) {
					continue series
				}
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue(), true
			}
			return m.GetCounter().GetValue(), true
		}
	}
	return 0, false
}

func hasLabel(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue() == value
		}
	}
	return false
}

// The manager exports what an operator alerts on: each policy's desired and serving replicas and
// its conditions, under the policy's namespace and name as labels apart, reports it could not read,
// and reconciles that failed, by reason. A policy's series go with it.
func TestMetricsWhenPoliciesAndReplicasChangeThenTheManagerExportsThem(t *testing.T) {
	ctx := context.Background()
	ns := testenv.Namespace(t, k8s, "metrics")
	targetService(t, ns, "api")
	p := newPolicy(ns, "api-limits", "api")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	kubelet := runEnforcers(t, ns)
	waitCondition(t, p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAvailable)
	id := map[string]string{"namespace": ns, "policy": "api-limits"}
	gauge := func(name string, labels map[string]string) float64 {
		v, ok := metric(t, name, labels)
		if !ok {
			t.Fatalf("no %s%v", name, labels)
		}
		return v
	}
	if d, s := gauge("sluice_policy_replicas_desired", id), gauge("sluice_policy_replicas_serving", id); d != 3 || s != 3 {
		t.Errorf("replicas desired %v, serving %v; want 3 and 3", d, s)
	}
	if v := gauge("sluice_policy_condition", map[string]string{"namespace": ns, "policy": "api-limits", "condition": "Ready", "reason": v1alpha1.ReasonAvailable}); v != 1 {
		t.Errorf("Ready condition = %v, want 1", v)
	}

	// A replica that stops answering: its report times out, and status and metrics say so.
	timeouts := gauge("sluice_manager_report_failures_total", map[string]string{"reason": "timeout"})
	var pods corev1.PodList
	if err := k8s.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels(render.PodLabels(p))); err != nil || len(pods.Items) == 0 {
		t.Fatalf("pods: %v", err)
	}
	if err := kubelet.Signal(pods.Items[0].Name, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kubelet.Signal(pods.Items[0].Name, syscall.SIGCONT) })
	eventually(t, "a timed-out report counted and 2 of 3 serving", func() (bool, string) {
		now := gauge("sluice_manager_report_failures_total", map[string]string{"reason": "timeout"})
		serving := gauge("sluice_policy_replicas_serving", id)
		return now > timeouts && serving == 2, ""
	})
	if err := kubelet.Signal(pods.Items[0].Name, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}

	if err := k8s.Delete(ctx, p); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the deleted policy's series gone", func() (bool, string) {
		_, desired := metric(t, "sluice_policy_replicas_desired", id)
		_, cond := metric(t, "sluice_policy_condition", id)
		return !desired && !cond, ""
	})
}

// Every reason of a failed reconcile is a series from the start, at zero, so that an alert on
// increase() sees the first failure.
func TestMetricsWhenTheManagerStartsThenEveryFailureReasonIsASeries(t *testing.T) {
	for _, reason := range []string{"ReadFailed", "RenderFailed", "ApplyFailed", "ApplyRejected", "ObjectInTheWay", "StatusWriteFailed"} {
		if _, ok := metric(t, "sluice_manager_reconcile_errors_total", map[string]string{"reason": reason}); !ok {
			t.Errorf("no sluice_manager_reconcile_errors_total{reason=%q}", reason)
		}
	}
	for _, reason := range []string{"timeout", "unreachable", "http_status", "invalid"} {
		if _, ok := metric(t, "sluice_manager_report_failures_total", map[string]string{"reason": reason}); !ok {
			t.Errorf("no sluice_manager_report_failures_total{reason=%q}", reason)
		}
	}
}
