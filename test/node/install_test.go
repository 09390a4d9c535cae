package node_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/node"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// The release the tests install, as the README's quick start names it.
const (
	release   = "sluice"
	system    = "sluice-system"
	quickNS   = "default"
	quickName = "quickstart"
)

// TestInstall installs Sluice as users do and runs it on the node: the README's quick start, then
// a rollout of a spec change and of a manager upgrade under traffic, an enforcer pod deleted,
// and helm uninstall. Each step builds on the one before.
func TestInstall(t *testing.T) {
	steps := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"quick start", quickStart},
		{"rollouts under traffic drop nothing", rollouts},
		{"a deleted enforcer pod is replaced", podReplaced},
		{"helm uninstall leaves nothing behind", uninstall},
	}
	for _, s := range steps {
		if !t.Run(s.name, s.run) {
			t.Fatalf("%s failed: the steps after it need it", s.name)
		}
	}
}

// quickStart runs the README's quick start, for a Service my-api of the user's: the images
// stand built by the Dockerfile's steps and imported (the README builds and pushes them with
// docker, which is not here), so REGISTRY names the node's own.
func quickStart(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	// The namespaces hold the restricted Pod Security profile: every pod of Sluice's passes it.
	for _, ns := range []string{quickNS, system} {
		if out, err := cluster.Kubectl(ctx, nil, "create", "namespace", ns); err != nil && !strings.Contains(err.Error(), "AlreadyExists") {
			t.Fatalf("%v: %s", err, out)
		}
		if out, err := cluster.Kubectl(ctx, nil, "label", "--overwrite", "namespace", ns,
			"pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest"); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
	}
	apply(t, echo(quickNS, "my-api", 2))
	waitAvailable(t, quickNS, "my-api")

	for _, step := range readmeQuickStart(t) {
		t.Logf("README: %s", step)
		runStep(t, step)
	}

	// The manager's two replicas are Ready, and both serve the webhook through its Service: an
	// invalid policy is refused with a message that names the field, however often it is sent.
	waitAvailable(t, system, "sluice-manager")
	for range 6 {
		out, err := cluster.Kubectl(ctx, strings.NewReader(invalidPolicy), "apply", "--dry-run=server", "-f", "-")
		if err == nil || !strings.Contains(err.Error(), "spec.rules[0].fixedWindow.window") || !strings.Contains(err.Error(), "admission webhook") && !strings.Contains(err.Error(), "Invalid value") {
			t.Fatalf("an invalid policy: %v %s; want it refused naming spec.rules[0].fixedWindow.window", err, out)
		}
	}
	// The enforcer runs as pods under the restricted profile, from the image the chart names.
	p := waitReady(t, quickNS, quickName)
	pods := enforcerPods(t, quickNS, quickName)
	for _, pod := range pods {
		if got, want := pod.Spec.Containers[0].Image, registry+"/sluice-enforcer:"+appVersion; got != want {
			t.Errorf("enforcer pod %s runs %s, want %s (the chart's appVersion)", pod.Name, got, want)
		}
	}
	if p.Status.Enforcer == nil || p.Status.Enforcer.ReadyReplicas != int32(len(pods)) || len(pods) == 0 {
		t.Fatalf("status.enforcer %+v with %d pods: want every pod's report counted", p.Status.Enforcer, len(pods))
	}

	// A burst of one client: every request reaches my-api's pods until the limit, then 429 with
	// every documented field.
	svc := clusterIP(t, quickNS, "sluice-"+quickName)
	before := upstreamCount(t, quickNS, "my-api")
	var passed, refused int
	for i := range 8 {
		resp, err := get(ctx, "http://"+svc+"/", http.Header{"X-Client": {"burst"}})
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
			passed++
		case http.StatusTooManyRequests:
			refused++
			checkRefusal(t, resp, body)
		default:
			t.Fatalf("request %d: %s %s", i, resp.Status, body)
		}
	}
	if passed != 5 || refused != 3 {
		t.Errorf("a burst of 8 on a limit of 5: %d passed, %d refused; want 5 and 3", passed, refused)
	}
	if got := upstreamCount(t, quickNS, "my-api") - before; got != int64(passed) {
		t.Errorf("my-api's pods served %d requests of the burst, want the %d that passed", got, passed)
	}
	// The policy counts what its pods decided.
	poll.WaitFor(t, time.Minute, func() error {
		p := policy(t, quickNS, quickName)
		for _, r := range p.Status.Rules {
			if r.Allowed >= int64(passed) && r.Limited >= int64(refused) {
				return nil
			}
		}
		return fmt.Errorf("status.rules %+v: want %d allowed and %d limited counted from the pods' reports", p.Status.Rules, passed, refused)
	})
}

// checkRefusal checks a 429 for every field docs/enforcer.md promises.
func checkRefusal(t *testing.T, resp *http.Response, body []byte) {
	t.Helper()
	for _, h := range []string{"Retry-After", "RateLimit", "RateLimit-Policy"} {
		if resp.Header.Get(h) == "" {
			t.Errorf("429 without %s: %v", h, resp.Header)
		}
	}
	var problem struct {
		Type, Title, Policy, Rule, Detail string
		Status, RetryAfter                int
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/problem+json" || json.Unmarshal(body, &problem) != nil {
		t.Fatalf("429 body %s (%s): want application/problem+json", body, ct)
	}
	if problem.Status != 429 || problem.Policy != quickNS+"/"+quickName || problem.Rule == "" || problem.RetryAfter < 1 ||
		!strings.HasSuffix(problem.Type, "/rate-limited") {
		t.Errorf("429 body %s: want status 429, the policy %s/%s, the rule, retryAfter and type rate-limited", body, quickNS, quickName)
	}
}

// invalidPolicy has a zero window, which CEL or the webhook refuses naming the field.
const invalidPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: invalid, namespace: default}
spec:
  targetRef: {name: my-api, port: 80}
  rules:
  - name: zero
    fixedWindow: {limit: 1, window: 0s}
`

// readmeQuickStart is the README's quick start: the shell lines of the block after the
// "quick-start" marker, with REGISTRY set to the node's registry.
func readmeQuickStart(t *testing.T) []string {
	t.Helper()
	f, err := os.Open(filepath.Join(testenv.RepoRoot(), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	var lines []string
	marker, in := false, false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.Contains(line, "<!-- quick-start: test/node runs this block -->"):
			marker = true
		case marker && !in && strings.HasPrefix(line, "```"):
			in = true
		case in && strings.HasPrefix(line, "```"):
			return joinContinued(lines)
		case in:
			lines = append(lines, line)
		}
	}
	t.Fatal("README.md has no quick start block after <!-- quick-start: test/node runs this block -->")
	return nil
}

// joinContinued joins lines ending in a backslash with the next, and drops comments.
func joinContinued(lines []string) []string {
	var out []string
	var cur string
	for _, l := range lines {
		if i := strings.Index(l, " #"); i >= 0 {
			l = l[:i]
		}
		l = strings.TrimSpace(l)
		if strings.HasSuffix(l, `\`) {
			cur += strings.TrimSuffix(l, `\`) + " "
			continue
		}
		if cur += l; strings.TrimSpace(cur) != "" {
			out = append(out, strings.TrimSpace(cur))
		}
		cur = ""
	}
	return out
}

// runStep runs one line of the quick start: the registry's assignment, the image build (which
// the test did from the same Dockerfile), helm and kubectl as users run them, and curl as a GET
// through the cluster's DNS.
func runStep(t *testing.T, line string) {
	t.Helper()
	ctx := context.Background()
	line = strings.ReplaceAll(line, "$REGISTRY", registry)
	fields := strings.Fields(line)
	switch {
	case strings.HasPrefix(line, "REGISTRY="):
	case fields[0] == "make" && strings.Contains(line, "docker-build"):
		// Built by the Dockerfile's own steps without Docker (internal/test/image) and imported.
	case fields[0] == "helm":
		// Docker Hub cannot be reached here: the managed Redis runs Debian's redis-server.
		args := append(slices.Clone(fields[1:]), "--set", "managedRedis.image="+redisImage, "--wait", "--timeout=5m")
		if out, err := runHelm(ctx, args...); err != nil {
			t.Fatalf("%s: %v\n%s\n%s", line, err, out, podStates(system))
		}
	case fields[0] == "kubectl":
		out, err := cluster.Kubectl(ctx, nil, fields[1:]...)
		if err != nil {
			t.Fatalf("%s: %v\n%s\n%s", line, err, out, podStates(quickNS))
		}
	case fields[0] == "curl":
		curl(t, line, fields[1:])
	default:
		t.Fatalf("the quick start's line %q is not one the test knows how to run", line)
	}
}

// curl sends the quick start's GET as curl would with the flags it names: -i, and --retry N with
// --retry-connrefused, which retries a refused connection N times after 1 s, 2 s, 4 s and so on.
// Kubernetes routes a Service to a pod some time after the pod is Ready (the EndpointSlice, then
// each node's kube-proxy), so a refused connection right after kubectl wait is Kubernetes' lag,
// which the README's line waits out as a user's would.
func curl(t *testing.T, line string, args []string) {
	t.Helper()
	retries, connRefused := 0, false
	for i := 0; i < len(args)-1; i++ {
		switch args[i] {
		case "-i":
		case "--retry-connrefused":
			connRefused = true
		case "--retry":
			i++
			n, err := strconv.Atoi(args[i])
			if err != nil {
				t.Fatalf("%s: --retry %q: %v", line, args[i], err)
			}
			retries = n
		default:
			t.Fatalf("%s: the test does not know curl's flag %q", line, args[i])
		}
	}
	url := args[len(args)-1]
	delay := time.Second
	for attempt := 0; ; attempt++ {
		resp, err := getByName(context.Background(), url)
		if err != nil && connRefused && attempt < retries && errors.Is(err, syscall.ECONNREFUSED) {
			t.Logf("%s: %v; retrying in %s", line, err, delay)
			time.Sleep(delay) // curl's --retry wait: 1 s, then twice the last
			delay *= 2
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", line, err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %s", line, resp.Status)
		}
		return
	}
}

func runHelm(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, helm, append(args, "--kubeconfig", cluster.Kubeconfig)...)
	cmd.Dir = testenv.RepoRoot()
	return cmd.CombinedOutput()
}

// getByName sends a GET to url, resolving its host through the cluster's DNS, as a pod would.
func getByName(ctx context.Context, url string) (*http.Response, error) {
	resolver := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, node.NodeIP+":53")
	}}
	dialer := &net.Dialer{Resolver: resolver}
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		if !strings.HasSuffix(host, ".cluster.local") {
			host += ".cluster.local"
		}
		return dialer.DialContext(ctx, network, net.JoinHostPort(host, port))
	}}, Timeout: 10 * time.Second}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	return c.Do(req)
}

// rollouts changes the policy's spec, then upgrades the manager to another image, while clients
// send requests all along: every request is answered 200 or 429, none fails.
func rollouts(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	traffic := startTraffic(t, "http://"+clusterIP(t, quickNS, "sluice-"+quickName)+"/")
	defer traffic.stop(t)

	p := policy(t, quickNS, quickName)
	patch := fmt.Sprintf(`{"spec":{"rules":[{"name":%q,"fixedWindow":{"limit":1000,"window":"10s"},"key":[{"type":"Header","name":"X-Client"}]}]}}`, p.Spec.Rules[0].Name)
	if out, err := cluster.Kubectl(ctx, nil, "patch", "rlp", quickName, "-n", quickNS, "--type=merge", "-p", patch); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	waitGeneration(t, quickNS, quickName)
	traffic.expectRunning(t, 3*time.Second)

	pods := podUIDs(t, quickNS, quickName)
	if out, err := runHelm(ctx, "upgrade", release, "charts/sluice", "--namespace", system, "--reuse-values",
		"--set", "manager.image.tag="+appVersion+nextTag, "--wait", "--timeout=5m"); err != nil {
		t.Fatalf("helm upgrade: %v\n%s", err, out)
	}
	waitAvailable(t, system, "sluice-manager")
	for _, pod := range managerPods(t) {
		if !strings.HasSuffix(pod.Spec.Containers[0].Image, nextTag) {
			t.Errorf("manager pod %s runs %s after the upgrade", pod.Name, pod.Spec.Containers[0].Image)
		}
	}
	waitReady(t, quickNS, quickName)
	traffic.expectRunning(t, 3*time.Second)
	// A manager upgrade that renders the same enforcer rolls no enforcer pod.
	if after := podUIDs(t, quickNS, quickName); !sameSet(pods, after) {
		t.Errorf("the manager's upgrade re-created enforcer pods: %v before, %v after", pods, after)
	}
}

// podReplaced deletes an enforcer pod under traffic: the Deployment replaces it, nothing fails,
// and the policy is Ready again from the new pod's report.
func podReplaced(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	traffic := startTraffic(t, "http://"+clusterIP(t, quickNS, "sluice-"+quickName)+"/")
	defer traffic.stop(t)
	pods := enforcerPods(t, quickNS, quickName)
	if err := k8s.Delete(ctx, &pods[0]); err != nil {
		t.Fatal(err)
	}
	poll.WaitFor(t, 3*time.Minute, func() error {
		now := enforcerPods(t, quickNS, quickName)
		for _, p := range now {
			if p.UID == pods[0].UID {
				return fmt.Errorf("pod %s not gone yet", p.Name)
			}
		}
		if len(now) != len(pods) {
			return fmt.Errorf("%d enforcer pods, want %d", len(now), len(pods))
		}
		return nil
	})
	p := waitReady(t, quickNS, quickName)
	if int(p.Status.Enforcer.ReadyReplicas) != len(pods) {
		t.Errorf("status.enforcer.readyReplicas %d, want %d", p.Status.Enforcer.ReadyReplicas, len(pods))
	}
	traffic.expectRunning(t, 3*time.Second)
}

// uninstall deletes the policy, then the release: nothing of Sluice's is left but the CRDs, which
// the chart keeps by default (crds.keep), and the namespace.
func uninstall(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	if out, err := cluster.Kubectl(ctx, nil, "delete", "rlp", "--all", "--all-namespaces", "--wait", "--timeout=2m"); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if out, err := runHelm(ctx, "uninstall", release, "--namespace", system, "--wait", "--timeout=5m"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	poll.WaitFor(t, 3*time.Minute, func() error {
		left := leftovers(t)
		if len(left) > 0 {
			return fmt.Errorf("left behind: %s", strings.Join(left, ", "))
		}
		return nil
	})
	out, err := cluster.Kubectl(ctx, nil, "get", "crd", "-o", "name")
	if err != nil || !strings.Contains(string(out), "ratelimitpolicies.ratelimit.sluice.dev") {
		t.Errorf("after uninstall the CRDs: %s %v; want them kept (crds.keep)", out, err)
	}
}

// leftovers lists every object in the cluster that names Sluice, but the CRDs (and the APIService
// the API server keeps for their group while they exist) and the namespace, which helm leaves.
func leftovers(t *testing.T) []string {
	t.Helper()
	out, err := cluster.Kubectl(context.Background(), nil, "api-resources", "--verbs=list", "-o", "name")
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	sluice := regexp.MustCompile(`sluice`)
	for _, kind := range strings.Fields(string(out)) {
		switch kind {
		case "customresourcedefinitions.apiextensions.k8s.io", "apiservices.apiregistration.k8s.io", "namespaces", "events", "events.events.k8s.io":
			continue
		}
		objs, err := cluster.Kubectl(context.Background(), nil, "get", kind, "--all-namespaces", "-o", "name", "--ignore-not-found")
		if err != nil {
			continue
		}
		for _, o := range strings.Fields(string(objs)) {
			if sluice.MatchString(o) || strings.Contains(o, quickName) {
				left = append(left, o)
			}
		}
	}
	return left
}

// traffic is clients sending requests to a URL until stopped, counting what came back.
type traffic struct {
	stopOnce sync.Once
	done     chan struct{}
	wg       sync.WaitGroup
	answered atomic.Int64
	mu       sync.Mutex
	failures []string
}

// startTraffic starts 4 clients, each with keep-alive connections as real clients have, sending a
// request every 20 ms under a client key of its own.
func startTraffic(t *testing.T, url string) *traffic {
	t.Helper()
	tr := &traffic{done: make(chan struct{})}
	for i := range 4 {
		c := &http.Client{Timeout: 10 * time.Second}
		tr.wg.Go(func() {
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-tr.done:
					return
				case <-tick.C:
				}
				req, _ := http.NewRequest(http.MethodGet, url, nil)
				req.Header.Set("X-Client", fmt.Sprintf("traffic-%d", i))
				resp, err := c.Do(req)
				if err != nil {
					tr.fail(err.Error())
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusTooManyRequests {
					tr.fail(resp.Status)
					continue
				}
				tr.answered.Add(1)
			}
		})
	}
	return tr
}

func (tr *traffic) fail(what string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.failures = append(tr.failures, time.Now().Format("15:04:05.000")+" "+what)
}

// expectRunning fails the test unless requests are still being answered over the next d.
func (tr *traffic) expectRunning(t *testing.T, d time.Duration) {
	t.Helper()
	before := tr.answered.Load()
	time.Sleep(d) // the traffic runs on its own clock; this only lets some of it happen
	if tr.answered.Load() == before {
		t.Errorf("no request answered in %v", d)
	}
}

// stop stops the clients and fails the test for every request that was not answered.
func (tr *traffic) stop(t *testing.T) {
	t.Helper()
	tr.stopOnce.Do(func() { close(tr.done) })
	tr.wg.Wait()
	t.Logf("%d requests answered", tr.answered.Load())
	if len(tr.failures) > 0 {
		t.Errorf("%d requests failed of %d: %s", len(tr.failures), int64(len(tr.failures))+tr.answered.Load(), strings.Join(tr.failures[:min(10, len(tr.failures))], "; "))
	}
}

func policy(t *testing.T, ns, name string) *v1alpha1.RateLimitPolicy {
	t.Helper()
	p := &v1alpha1.RateLimitPolicy{}
	if err := k8s.Get(context.Background(), key(ns, name), p); err != nil {
		t.Fatal(err)
	}
	return p
}

// waitReady waits until the policy is Ready for its current generation.
func waitReady(t *testing.T, ns, name string) *v1alpha1.RateLimitPolicy {
	t.Helper()
	var p *v1alpha1.RateLimitPolicy
	poll.WaitFor(t, 3*time.Minute, func() error {
		p = policy(t, ns, name)
		c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || c.Status != metav1.ConditionTrue || c.ObservedGeneration != p.Generation {
			return fmt.Errorf("policy %s/%s not Ready: %+v%s", ns, name, c, podStates(ns))
		}
		return nil
	})
	return p
}

// waitGeneration waits until every enforcer of the policy serves its current generation.
func waitGeneration(t *testing.T, ns, name string) { t.Helper(); waitReady(t, ns, name) }

func enforcerPods(t *testing.T, ns, policyName string) []corev1.Pod {
	t.Helper()
	return livePods(t, ns, client.MatchingLabels{"app.kubernetes.io/name": "sluice-enforcer", "app.kubernetes.io/instance": policyName})
}

func managerPods(t *testing.T) []corev1.Pod {
	t.Helper()
	return livePods(t, system, client.MatchingLabels{"app.kubernetes.io/component": "manager"})
}

// livePods are the pods of ns with labels that are not being deleted.
func livePods(t *testing.T, ns string, labels client.MatchingLabels) []corev1.Pod {
	t.Helper()
	var pods corev1.PodList
	if err := k8s.List(context.Background(), &pods, client.InNamespace(ns), labels); err != nil {
		t.Fatal(err)
	}
	var live []corev1.Pod
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			live = append(live, p)
		}
	}
	return live
}

func podUIDs(t *testing.T, ns, policyName string) []string {
	t.Helper()
	var uids []string
	for _, p := range enforcerPods(t, ns, policyName) {
		uids = append(uids, string(p.UID))
	}
	return uids
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	seen := map[string]bool{}
	for _, x := range a {
		seen[x] = true
	}
	for _, x := range b {
		if !seen[x] {
			return false
		}
	}
	return true
}

// upstreamCount adds up what the Deployment's pods answered, asking each for its count.
func upstreamCount(t *testing.T, ns, name string) int64 {
	t.Helper()
	var dep appsv1.Deployment
	if err := k8s.Get(context.Background(), key(ns, name), &dep); err != nil {
		t.Fatal(err)
	}
	var pods corev1.PodList
	if err := k8s.List(context.Background(), &pods, client.InNamespace(ns), client.MatchingLabels(dep.Spec.Selector.MatchLabels)); err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, p := range pods.Items {
		resp, err := get(context.Background(), "http://"+net.JoinHostPort(p.Status.PodIP, "8080")+"/count", nil)
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		_, err = fmt.Fscan(resp.Body, &n)
		_ = resp.Body.Close()
		if err != nil {
			t.Fatal(errors.Join(fmt.Errorf("count of pod %s", p.Name), err))
		}
		total += n
	}
	return total
}
