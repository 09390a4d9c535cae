package controllers

import (
	"context"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
)

// Whoever may create events in a pod's namespace can write a FailedMount event of their own, of
// any length and dated in the future: the kubelet's alone are read, and what is told of one is
// bounded, so that no event can make a policy's status too long for the API server to take (a
// hostile review found a 40,000-byte event refusing every status write of the pool's policies).
func TestMountsWhenEventsAreForgedOrLongThenOnlyTheKubeletsAreToldAndBounded(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "sluice-p-1", UID: "pod-uid"}, Status: creating}
	now := time.Now()
	event := func(name, source, msg string, at time.Time) *corev1.Event {
		return &corev1.Event{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name},
			InvolvedObject: corev1.ObjectReference{Kind: "Pod", Name: pod.Name, UID: pod.UID}, Reason: failedMount,
			Source: corev1.EventSource{Component: source}, Message: msg, LastTimestamp: metav1.NewTime(at)}
	}
	kubelet := `MountVolume.SetUp failed for volume "redis-credentials" : secret "absent" not found`
	cases := []struct {
		name   string
		events []client.Object
		want   string
	}{
		{"when the kubelet tells a failure then it is told", []client.Object{event("a", "kubelet", kubelet, now)}, failedMount + ": " + kubelet},
		{"when someone else writes a later one then the kubelet's is told",
			[]client.Object{event("a", "kubelet", kubelet, now), event("b", "someone", "see https://evil.example", now.AddDate(50, 0, 0))},
			failedMount + ": " + kubelet},
		{"when the kubelet's is longer than a line then it is cut between two characters",
			[]client.Object{event("a", "kubelet", strings.Repeat("é", 40000), now)},
			failedMount + ": " + strings.Repeat("é", (maxMountMessage-len("…"))/2) + "…"},
		{"when there is none then nothing is told", nil, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			reader := fake.NewClientBuilder().WithObjects(c.events...).
				WithIndex(&corev1.Event{}, "involvedObject.uid", func(o client.Object) []string { return []string{string(o.(*corev1.Event).InvolvedObject.UID)} }).
				WithIndex(&corev1.Event{}, "reason", func(o client.Object) []string { return []string{o.(*corev1.Event).Reason} }).
				WithIndex(&corev1.Event{}, "source", func(o client.Object) []string { return []string{o.(*corev1.Event).Source.Component} }).
				Build()
			got := newMounts(reader, time.Minute).failure(context.Background(), pod, now)
			if got != c.want || !utf8.ValidString(got) || len(got) > len(failedMount+": ")+maxMountMessage {
				t.Errorf("failure = %d bytes %.80q, want %d bytes %.80q", len(got), got, len(c.want), c.want)
			}
		})
	}
}

// A condition's message is cut to what the API server takes, between two characters: one longer
// would refuse the whole status.
func TestConditionSetterWhenAMessageIsTooLongThenItIsCutToWhatTheAPIServerTakes(t *testing.T) {
	var conds []metav1.Condition
	conditionSetter(&conds, 1, time.Now())("Ready", false, "Unavailable", strings.Repeat("€", maxConditionMessage))
	msg := conds[0].Message
	if len(msg) > maxConditionMessage || !utf8.ValidString(msg) || !strings.HasSuffix(msg, "€…") {
		t.Errorf("message of %d bytes (valid UTF-8: %v) ending %q, want at most %d ending in an ellipsis", len(msg), utf8.ValidString(msg), msg[len(msg)-8:], maxConditionMessage)
	}
}

// cut keeps a text of n bytes whole and cuts one of n+1 to at most n, ending in an ellipsis.
func TestCutWhenATextIsAtOrOnePastTheBoundThenOnlyTheLongerIsCut(t *testing.T) {
	const n = 16
	cases := []struct{ name, s, want string }{
		{"when the text is n bytes then it is whole", strings.Repeat("x", n), strings.Repeat("x", n)},
		{"when the text is n+1 bytes then it is cut to n", strings.Repeat("x", n+1), strings.Repeat("x", n-len("…")) + "…"},
		{"when the cut falls inside a character then the character is left out", "x" + strings.Repeat("é", n/2), "x" + strings.Repeat("é", (n-len("…")-1)/2) + "…"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := cut(c.s, n); got != c.want || len(got) > n || !utf8.ValidString(got) {
				t.Errorf("cut(%q, %d) = %q (%d bytes), want %q", c.s, n, got, len(got), c.want)
			}
		})
	}
}
