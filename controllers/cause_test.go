package controllers

import (
	"errors"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/report"
)

// Pod statuses as the scheduler and a kubelet write them, for the causes status names.
var (
	unschedulable = corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{{
		Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonUnschedulable,
		Message: "0/2 nodes are available: 2 Insufficient cpu. preemption: 0/2 nodes are available: 2 No preemption victims found for incoming pod.",
	}}}
	imagePullBackOff = waiting("ImagePullBackOff", `Back-off pulling image "example.com/sluice-enforcer:nope"`)
	errImagePull     = waiting("ErrImagePull", `failed to pull and unpack image "example.com/sluice-enforcer:nope": not found`)
	configError      = waiting("CreateContainerConfigError", `secret "redis-creds" not found`)
	crashLoop        = func() corev1.PodStatus {
		st := waiting("CrashLoopBackOff", "back-off 20s restarting failed container=enforcer pod=sluice-p-7d9f_ns(0f0e)")
		st.ContainerStatuses[0].RestartCount = 3
		st.ContainerStatuses[0].LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
			ExitCode: 2, Reason: "Error", Message: "flag provided but not defined: -redis-urll",
		}}
		return st
	}()
	creating = waiting("ContainerCreating", "")
	// A running container whose readiness probe fails.
	unready = corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: corev1.ConditionFalse, Reason: "ContainersNotReady"},
	}, ContainerStatuses: []corev1.ContainerStatus{{Name: "enforcer", State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}}}
)

// waiting is the status of a scheduled pod whose enforcer container waits for reason.
func waiting(reason, msg string) corev1.PodStatus {
	return corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
		{Type: corev1.PodReady, Status: corev1.ConditionFalse, Reason: "ContainersNotReady", Message: "containers with unready status: [enforcer]"},
	}, ContainerStatuses: []corev1.ContainerStatus{{Name: "enforcer", Image: "example.com/sluice-enforcer:nope",
		State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: reason, Message: msg}}}}}
}

// A pod that is not ready is named with its cause in its status's own words, and the cause gives
// Ready its reason.
func TestCauseOfWhenAPodIsNotReadyThenItsStatusNamesWhy(t *testing.T) {
	const mountFailure = `FailedMount: MountVolume.SetUp failed for volume "redis-credentials" : secret "redis-creds" not found`
	cases := []struct {
		name, reason, text string
		status             corev1.PodStatus
		// mountFailure is the pod's latest FailedMount event.
		mountFailure string
	}{
		{"when no node fits then Unschedulable in the scheduler's words", v1alpha1.ReasonUnschedulable,
			"pod sluice-p-7d9f: Unschedulable: 0/2 nodes are available: 2 Insufficient cpu.", unschedulable, ""},
		{"when the image cannot be pulled then ImagePullFailed in the kubelet's words", v1alpha1.ReasonImagePullFailed,
			`pod sluice-p-7d9f: ImagePullBackOff: Back-off pulling image "example.com/sluice-enforcer:nope"`, imagePullBackOff, ""},
		{"when the pull fails then ImagePullFailed too", v1alpha1.ReasonImagePullFailed, "pod sluice-p-7d9f: ErrImagePull: failed to pull", errImagePull, ""},
		{"when a Secret the container needs is missing then ContainerConfigError", v1alpha1.ReasonContainerConfigError,
			`pod sluice-p-7d9f: CreateContainerConfigError: secret "redis-creds" not found`, configError, ""},
		{"when the container keeps exiting then CrashLooping with its last exit", v1alpha1.ReasonCrashLooping,
			"pod sluice-p-7d9f: CrashLoopBackOff: back-off 20s restarting failed container=enforcer pod=sluice-p-7d9f_ns(0f0e); " +
				"container enforcer last exited with code 2 (Error): flag provided but not defined: -redis-urll", crashLoop, ""},
		{"when the container is being created then its reason is told and no cause", "", "pod sluice-p-7d9f: ContainerCreating", creating, ""},
		{"when a volume cannot be mounted then ContainerConfigError in the kubelet's event's words", v1alpha1.ReasonContainerConfigError,
			"pod sluice-p-7d9f: ContainerCreating: " + mountFailure, creating, mountFailure},
		{"when a running pod had a mount failure once then it is not named", "", "", unready, mountFailure},
		{"when a running container is not ready then nothing is named", "", "", unready, ""},
		{"when the pod is ready then nothing is named", "", "", corev1.PodStatus{Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := causeOf(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "sluice-p-7d9f"}, Status: c.status}, c.mountFailure)
			if got.reason != c.reason || !strings.HasPrefix(got.text, c.text) || c.text == "" && got.text != "" {
				t.Errorf("cause = %+v, want reason %q and text %q...", got, c.reason, c.text)
			}
		})
	}
}

// Ready names the first pod that does not serve, with its cause; Degraded tells a store that
// does not answer whatever else fails; status.reason is the first failing condition's.
func TestComputeStatusWhenPodsOrTheStoreFailThenStatusNamesTheCause(t *testing.T) {
	dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Generation: 1},
		Status: appsv1.DeploymentStatus{ObservedGeneration: 1, Replicas: 2, UpdatedReplicas: 2, AvailableReplicas: 2}}
	pod := func(name string, st corev1.PodStatus) replica {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: st}
		return replica{pod: name, ready: podReady(p), object: p}
	}
	serving := func(name string, connected bool) replica {
		return replica{pod: name, ready: true, revision: "r1", report: &report.Report{Revision: "r1",
			Store: report.Store{Connected: connected, Cause: report.CauseUnreachable, Message: "dial tcp 10.0.0.9:6379: connect: connection refused"}}}
	}
	observe := func(pods ...replica) observation {
		return observation{verdict: verdict{home: testHome()}, revision: "r1", progress: progress{programmed: true, replicas: 2, deployment: dep, pods: pods}}
	}
	missingTarget := observe(serving("p-a", false), serving("p-b", true))
	missingTarget.targetMissing = true
	stalled := observe(serving("p-a", false))
	stalled.applyErr, stalled.stalled = errors.New("Deployment sluice-p exists and is not owned by this policy"), true
	probed := observe(pod("p-a", unschedulable))
	probed.redisUnreachable = "the manager cannot reach Redis at redis:6379"
	cases := []struct {
		name                  string
		obs                   observation
		ready, readyText      string
		degraded, reason, hea string
	}{
		{"when no pod can be pulled then ImagePullFailed naming the pod in the kubelet's words",
			observe(pod("p-a", imagePullBackOff), pod("p-b", imagePullBackOff)), v1alpha1.ReasonImagePullFailed,
			`0/2 replicas serve revision r1; pod p-a: ImagePullBackOff: Back-off pulling image "example.com/sluice-enforcer:nope" (and 1 more)`,
			v1alpha1.ReasonAsExpected, v1alpha1.ReasonImagePullFailed, ""},
		{"when one pod is unschedulable then Unschedulable naming it before a pod merely not ready",
			observe(pod("p-a", unready), pod("p-b", unschedulable)), v1alpha1.ReasonUnschedulable,
			"0/2 replicas serve revision r1; pod p-b: Unschedulable: 0/2 nodes are available", v1alpha1.ReasonAsExpected, v1alpha1.ReasonUnschedulable, ""},
		{"when a pod's Secret is missing then ContainerConfigError", observe(serving("p-a", true), pod("p-b", configError)),
			v1alpha1.ReasonContainerConfigError, `1/2 replicas serve revision r1; pod p-b: CreateContainerConfigError: secret "redis-creds" not found`,
			v1alpha1.ReasonAsExpected, v1alpha1.ReasonContainerConfigError, v1alpha1.StoreConnected},
		{"when a pod crash-loops then CrashLooping with its last exit", observe(serving("p-a", true), pod("p-b", crashLoop)),
			v1alpha1.ReasonCrashLooping, "1/2 replicas serve revision r1; pod p-b: CrashLoopBackOff: back-off 20s", v1alpha1.ReasonAsExpected, v1alpha1.ReasonCrashLooping,
			v1alpha1.StoreConnected},
		{"when the target is missing and the store down then Degraded tells the store, and the target too", missingTarget,
			v1alpha1.ReasonAvailable, "2/2 replicas serve revision r1", v1alpha1.ReasonRedisUnreachable, v1alpha1.ReasonRedisUnreachable, v1alpha1.ReasonRedisUnreachable},
		{"when applying stalls and the store is down then Programmed fails first, and Degraded still tells the store", stalled,
			v1alpha1.ReasonUnavailable, "1/2 replicas serve revision r1", v1alpha1.ReasonRedisUnreachable, v1alpha1.ReasonApplyFailed, v1alpha1.ReasonRedisUnreachable},
		{"when no pod reports and the probe fails then Ready names the pod and Degraded the probe", probed,
			v1alpha1.ReasonUnschedulable, "0/2 replicas serve revision r1; pod p-a: Unschedulable", v1alpha1.ReasonRedisUnreachable, v1alpha1.ReasonUnschedulable,
			v1alpha1.ReasonRedisUnreachable},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := &v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Generation: 3}, Spec: v1alpha1.RateLimitPolicySpec{TargetRef: v1alpha1.TargetRef{Name: "api"}}}
			st := computeStatus(p, c.obs, true, t0)
			if r := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionReady); r.Reason != c.ready || !strings.HasPrefix(r.Message, c.readyText) {
				t.Errorf("Ready = %s %q, want %s %q...", r.Reason, r.Message, c.ready, c.readyText)
			}
			d := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionDegraded)
			if d.Reason != c.degraded || (c.obs.targetMissing && !strings.Contains(d.Message, "Service api does not exist")) {
				t.Errorf("Degraded = %s %q, want %s", d.Reason, d.Message, c.degraded)
			}
			if st.Reason != c.reason {
				t.Errorf("status.reason = %q, want %q", st.Reason, c.reason)
			}
			if st.Enforcer.StoreHealth != c.hea {
				t.Errorf("status.enforcer.storeHealth = %q, want %q", st.Enforcer.StoreHealth, c.hea)
			}
		})
	}
}
