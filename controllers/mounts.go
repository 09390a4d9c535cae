package controllers

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
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
// manager lists them from the API server: it caches no events. Whoever may create events in the
// pod's namespace can write one too, and say it is the kubelet: what is taken is bounded
// (maxMountEvents events that name the kubelet as their source, maxMountMessage bytes of the
// latest), so that no event can make a status too long to write.
type mounts struct {
	reader   client.Reader
	interval time.Duration
	// flight lists a pod's events once, however many of its policies ask at once.
	flight singleflight.Group

	mu   sync.Mutex
	seen map[types.UID]mountRead
}

const (
	// maxMountEvents is how many FailedMount events of a pod are listed: the kubelet counts a
	// repeated failure in one event, so a pod has one per volume.
	maxMountEvents = 16
	// maxMountMessage is how much of an event's message is told: the kubelet's are one line.
	maxMountMessage = 1024
)

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
	v, err, _ := m.flight.Do(string(pod.UID), func() (any, error) {
		failure, err := m.list(ctx, pod)
		if err == nil {
			m.mu.Lock()
			m.seen[pod.UID] = mountRead{at: now, failure: failure}
			m.mu.Unlock()
		}
		return failure, err
	})
	if err != nil {
		return last.failure
	}
	return v.(string)
}

// list reads the message of the pod's latest FailedMount event from the kubelet, or "".
func (m *mounts) list(ctx context.Context, pod *corev1.Pod) (string, error) {
	var events corev1.EventList
	err := m.reader.List(ctx, &events, client.InNamespace(pod.Namespace), client.Limit(maxMountEvents),
		client.MatchingFieldsSelector{Selector: fields.AndSelectors(
			fields.OneTermEqualSelector("involvedObject.uid", string(pod.UID)),
			fields.OneTermEqualSelector("reason", failedMount),
			fields.OneTermEqualSelector("source", "kubelet"),
		)})
	if err != nil {
		return "", err
	}
	latest := slices.MaxFunc(append(events.Items, corev1.Event{}), func(a, b corev1.Event) int {
		return eventTime(a).Compare(eventTime(b))
	})
	if latest.Message == "" {
		return "", nil
	}
	return failedMount + ": " + cut(latest.Message, maxMountMessage), nil
}

// cut is s, or, when it is longer than n bytes, as much of it as fits in n with an ellipsis, cut
// between two characters.
func cut(s string, n int) string {
	const ellipsis = "…"
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n-len(ellipsis)], "") + ellipsis
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
