package controllers

import (
	"context"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// +kubebuilder:rbac:groups="",resources=events,verbs=list

// mounts finds why a pod waits for its volumes. A Secret or ConfigMap that a pod mounts and that
// does not exist leaves its containers waiting as ContainerCreating, which says nothing of why:
// the kubelet tells it only in FailedMount events of the pod ("MountVolume.SetUp failed for
// volume ...: secret "x" not found"). Only for such a pod, and at most once an interval, the
// manager lists them from the API server: it caches no events.
type mounts struct {
	reader   client.Reader
	interval time.Duration

	mu   sync.Mutex
	seen map[types.UID]mountRead
}

// mountRead is what a pod's events said when they were last listed.
type mountRead struct {
	at      time.Time
	failure string
}

// failedMount is the reason of the kubelet's event for a volume it cannot mount.
const failedMount = "FailedMount"

func newMounts(reader client.Reader, interval time.Duration) *mounts {
	return &mounts{reader: reader, interval: interval, seen: map[types.UID]mountRead{}}
}

// failure is the message of the pod's latest FailedMount event while it waits for its volumes, or
// "". An error listing the events is no failure of the pod's: it says nothing.
func (m *mounts) failure(ctx context.Context, pod *corev1.Pod, now time.Time) string {
	if m == nil || m.reader == nil || !waitsForVolumes(pod) {
		return ""
	}
	m.mu.Lock()
	last, ok := m.seen[pod.UID]
	m.mu.Unlock()
	if ok && now.Sub(last.at) < m.interval {
		return last.failure
	}
	var events corev1.EventList
	err := m.reader.List(ctx, &events, client.InNamespace(pod.Namespace), client.MatchingFieldsSelector{Selector: fields.AndSelectors(
		fields.OneTermEqualSelector("involvedObject.uid", string(pod.UID)),
		fields.OneTermEqualSelector("reason", failedMount),
	)})
	if err != nil {
		return last.failure
	}
	read := mountRead{at: now}
	if latest := slices.MaxFunc(append(events.Items, corev1.Event{}), func(a, b corev1.Event) int {
		return eventTime(a).Compare(eventTime(b))
	}); latest.Message != "" {
		read.failure = failedMount + ": " + latest.Message
	}
	m.mu.Lock()
	m.seen[pod.UID] = read
	m.mu.Unlock()
	return read.failure
}

// forget drops what is remembered of pods that are gone: those not in live.
func (m *mounts) forget(live map[types.UID]bool) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for uid := range m.seen {
		if !live[uid] {
			delete(m.seen, uid)
		}
	}
}

// waitsForVolumes tells whether a scheduled pod's containers wait to be created, as they do while
// the kubelet cannot mount a volume.
func waitsForVolumes(pod *corev1.Pod) bool {
	for _, s := range slices.Concat(pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses) {
		if w := s.State.Waiting; w != nil && (w.Reason == "ContainerCreating" || w.Reason == "PodInitializing") {
			return true
		}
	}
	return false
}

// eventTime is when an event last happened, in whichever field its reporter filled.
func eventTime(e corev1.Event) time.Time {
	switch {
	case e.Series != nil:
		return e.Series.LastObservedTime.Time
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	}
	return e.FirstTimestamp.Time
}
