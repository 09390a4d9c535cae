package node_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/internal/test/poll"
)

// TestNodeRunsImagesAsPodsReachableThroughServices is the node itself: a Deployment's pods are
// scheduled on it, started from an imported image, and answer through their Service's ClusterIP,
// each of them.
func TestNodeRunsImagesAsPodsReachableThroughServices(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, "node", false)
	apply(t, echo(ns, "echo", 2))
	waitAvailable(t, ns, "echo")
	svc := clusterIP(t, ns, "echo")
	seen := map[string]bool{}
	poll.WaitFor(t, time.Minute, func() error {
		resp, err := get(ctx, "http://"+svc+"/", nil)
		if err != nil {
			return err
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		seen[strings.TrimSpace(string(body))] = true
		if len(seen) < 2 {
			return fmt.Errorf("answered by %d pods of 2 so far", len(seen))
		}
		return nil
	})
}

// namespace makes a namespace for one test, with the restricted Pod Security profile enforced
// when restricted, and deletes it after.
func namespace(t *testing.T, name string, restricted bool) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if restricted {
		ns.Labels = map[string]string{"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}
	}
	if err := k8s.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), ns) })
	return name
}

// echo is a Deployment of the echo upstream and its Service on port 80.
func echo(ns, name string, replicas int) string {
	return fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: %[2]s, namespace: %[1]s}
spec:
  replicas: %[3]d
  selector: {matchLabels: {app: %[2]s}}
  template:
    metadata: {labels: {app: %[2]s}}
    spec:
      securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
      containers:
      - name: echo
        image: %[4]s
        imagePullPolicy: IfNotPresent
        ports: [{name: http, containerPort: 8080}]
        readinessProbe: {httpGet: {path: /count, port: http}, periodSeconds: 1}
        securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
---
apiVersion: v1
kind: Service
metadata: {name: %[2]s, namespace: %[1]s}
spec:
  selector: {app: %[2]s}
  ports: [{name: http, port: 80, targetPort: http}]
`, ns, name, replicas, echoImage)
}

// apply applies manifests with kubectl, server-side, as users do.
func apply(t *testing.T, manifests string) {
	t.Helper()
	if out, err := cluster.Kubectl(context.Background(), strings.NewReader(manifests), "apply", "--server-side", "-f", "-"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

// waitAvailable waits until the Deployment has its two replicas available, both of its current
// revision.
func waitAvailable(t *testing.T, ns, name string) {
	t.Helper()
	const replicas = 2
	poll.WaitFor(t, 3*time.Minute, func() error {
		var d appsv1.Deployment
		if err := k8s.Get(context.Background(), key(ns, name), &d); err != nil {
			return err
		}
		s := d.Status
		if s.ObservedGeneration != d.Generation || s.UpdatedReplicas != replicas || s.AvailableReplicas != replicas || s.Replicas != replicas {
			return fmt.Errorf("deployment %s/%s: %d updated, %d available, %d in all, want %d: %s", ns, name, s.UpdatedReplicas, s.AvailableReplicas, s.Replicas, replicas, podStates(ns))
		}
		return nil
	})
}

// podStates says what each pod of ns is waiting for, for a failure's message.
func podStates(ns string) string {
	var pods corev1.PodList
	if err := k8s.List(context.Background(), &pods, inNamespace(ns)); err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, p := range pods.Items {
		fmt.Fprintf(&b, "\n  pod %s: %s", p.Name, p.Status.Phase)
		for _, c := range p.Status.Conditions {
			if c.Status != corev1.ConditionTrue {
				fmt.Fprintf(&b, " %s=%s(%s: %s)", c.Type, c.Status, c.Reason, c.Message)
			}
		}
		for _, c := range p.Status.ContainerStatuses {
			if w := c.State.Waiting; w != nil {
				fmt.Fprintf(&b, " %s waiting: %s: %s", c.Name, w.Reason, w.Message)
			}
			if c.RestartCount > 0 {
				fmt.Fprintf(&b, " %s restarted %d times", c.Name, c.RestartCount)
			}
		}
	}
	return b.String()
}

// clusterIP is the "address:port" of the Service's first port.
func clusterIP(t *testing.T, ns, name string) string {
	t.Helper()
	var svc corev1.Service
	if err := k8s.Get(context.Background(), key(ns, name), &svc); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%s:%d", svc.Spec.ClusterIP, svc.Spec.Ports[0].Port)
}

// get sends a GET with header, on a new connection, with a deadline.
func get(ctx context.Context, url string, header http.Header) (*http.Response, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	if header != nil {
		req.Header = header
	}
	resp, err := noKeepAlive.Do(req)
	if err != nil {
		cancel()
		return nil, err
	}
	body := resp.Body
	resp.Body = struct {
		io.Reader
		io.Closer
	}{body, closer(func() error { defer cancel(); return body.Close() })}
	return resp, nil
}

type closer func() error

func (c closer) Close() error { return c() }

// noKeepAlive opens a connection a request, so that a Service spreads them over its pods.
var noKeepAlive = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

func key(ns, name string) client.ObjectKey { return client.ObjectKey{Namespace: ns, Name: name} }

func inNamespace(ns string) client.ListOption { return client.InNamespace(ns) }
