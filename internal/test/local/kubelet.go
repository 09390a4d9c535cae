package local

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/render"
)

// Kubelet plays the kubelet for the enforcer pods of one namespace, so that the test control
// plane, which has no nodes, runs what a cluster runs: the pods the ReplicaSet controller
// creates from the rendered Deployment. It binds each pod to its node, and runs one real
// enforcer process per pod, with the pod spec's arguments and environment (Secret references
// resolved), its ConfigMap and Secret volumes written to files, a service-account token for the
// API server, and an address of its own as the pod IP: a loopback address (127.x.y.z), or one
// of PodNetwork. It registers its Node, and sets the pod's
// status from the process and its readiness probe, and stops the process when the pod is
// deleted, as a kubelet does: SIGTERM, then the grace period.
//
// An enforcer that exits is started again, as with restartPolicy Always, after a back-off of a
// second rather than the kubelet's 10 s and more; meanwhile its pod is not ready and its container
// waits in CrashLoopBackOff, with how it last ended, as the kubelet writes it.
//
// What it does not do: it runs the binary it was given rather than the pod's image, it points
// --upstream at Upstream (there is no cluster DNS), and it hands the token over through
// $KUBECONFIG rather than the service-account mount. It probes a ready pod every periodSeconds,
// as the kubelet does, but one not yet ready on every sync, and marks a pod unready at its first
// failed probe rather than at failureThreshold.
type Kubelet struct {
	opts KubeletOptions
	k8s  client.Client
	// watched holds the namespace's enforcer pods from a watch, as the kubelet watches its
	// pods: listing a thousand pods from the API server ten times a second would load it more
	// than everything it tests.
	watched cache.Cache
	cfg     *rest.Config
	bin     string

	mu   sync.Mutex
	pods map[types.UID]*podRun
	stop context.CancelFunc
	done chan struct{}
}

// KubeletOptions configure a Kubelet.
type KubeletOptions struct {
	// Namespace whose enforcer pods it runs.
	Namespace string
	// Upstream replaces every pod's --upstream.
	Upstream string
	// Dir holds the pods' files.
	Dir string
	// Log receives the enforcers' output.
	Log io.Writer
	// FileRefresh is how often mounted ConfigMaps are brought up to date, as the kubelet's
	// sync does, about once a minute by default.
	FileRefresh time.Duration
	// PodNetwork is where pod IPs come from; 127.0.0.0/8 when unset. The API server refuses
	// loopback addresses in EndpointSlices, so a test that routes to a Service's endpoints (a
	// gateway does) needs another network whose every address is local: see RunInPodNetwork.
	PodNetwork netip.Prefix
}

// Node is the node every pod is bound to.
const Node = "local"

// podRun is one running pod.
type podRun struct {
	uid      types.UID
	name     string
	ip       string
	proc     *Process
	readyURL string
	ready    bool
	// probePeriod is the readiness probe's periodSeconds; probed is when it last ran.
	probePeriod time.Duration
	probed      time.Time
	mounts      map[string]string // mount path -> directory
	refreshed   time.Time
	started     time.Time
	restarts    int32
	stopping    bool
	// last is how its enforcer ended, while it waits to be started again; lastState how the one
	// before it did.
	last, lastState *corev1.ContainerStateTerminated
}

// StartKubelet starts running the enforcer pods of opts.Namespace with the enforcer binary bin.
func StartKubelet(ctx context.Context, k8s client.Client, cfg *rest.Config, bin string, opts KubeletOptions) (*Kubelet, error) {
	if opts.FileRefresh <= 0 {
		opts.FileRefresh = time.Minute
	}
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	if !opts.PodNetwork.IsValid() {
		opts.PodNetwork = netip.MustParsePrefix("127.0.0.0/8")
	}
	// A kubelet registers its Node; the EndpointSlice controller skips pods on a Node it cannot find.
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: Node}}
	if err := k8s.Create(ctx, node); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("register node %s: %w", Node, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	watched, err := cache.New(cfg, cache.Options{
		Scheme:            k8s.Scheme(),
		DefaultNamespaces: map[string]cache.Config{opts.Namespace: {}},
		ByObject: map[client.Object]cache.ByObject{&corev1.Pod{}: {
			Label: labels.SelectorFromSet(labels.Set{render.EnforcerPodLabelKey: render.EnforcerPodLabelValue}),
		}},
	})
	if err != nil {
		cancel()
		return nil, err
	}
	if _, err := watched.GetInformer(ctx, &corev1.Pod{}); err != nil {
		cancel()
		return nil, err
	}
	go func() { _ = watched.Start(ctx) }()
	if !watched.WaitForCacheSync(ctx) {
		cancel()
		return nil, errors.New("the kubelet's watch of pods did not sync")
	}
	k := &Kubelet{opts: opts, k8s: k8s, watched: watched, cfg: cfg, bin: bin, pods: map[types.UID]*podRun{}, stop: cancel, done: make(chan struct{})}
	go k.loop(ctx)
	return k, nil
}

// Stop stops every pod's process and the kubelet.
func (k *Kubelet) Stop() {
	k.stop()
	<-k.done
	k.mu.Lock()
	defer k.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range k.pods {
		wg.Go(p.proc.Stop)
	}
	wg.Wait()
}

// Signal sends sig to the enforcer process of the named pod.
func (k *Kubelet) Signal(pod string, sig os.Signal) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, p := range k.pods {
		if p.name == pod {
			return p.proc.Signal(sig)
		}
	}
	return fmt.Errorf("pod %s does not run here", pod)
}

func (k *Kubelet) loop(ctx context.Context) {
	defer close(k.done)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		k.sync(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// podWorkers is how many pods are synced at once.
const podWorkers = 8

// sync brings every pod one step closer to its spec.
func (k *Kubelet) sync(ctx context.Context) {
	// The cache's own pods, read only: the sync runs ten times a second, and copying a thousand
	// pods each time is work of the test bed, not of what it tests.
	var pods corev1.PodList
	if err := k.watched.List(ctx, &pods, client.InNamespace(k.opts.Namespace), client.UnsafeDisableDeepCopy); err != nil {
		return
	}
	seen := map[types.UID]bool{}
	// Pods are synced by a few workers at once, as the kubelet's pod workers do: one pod's
	// start, probe or status write does not wait for a thousand others'. A pod is synced by one
	// worker at a time, and each sync waits for all of them.
	var wg sync.WaitGroup
	work := make(chan *corev1.Pod)
	for range podWorkers {
		wg.Go(func() {
			for pod := range work {
				if err := k.syncPod(ctx, pod); err != nil && ctx.Err() == nil {
					_, _ = fmt.Fprintf(k.opts.Log, "kubelet: pod %s: %v\n", pod.Name, err)
				}
			}
		})
	}
	for i := range pods.Items {
		seen[pods.Items[i].UID] = true
		work <- &pods.Items[i]
	}
	close(work)
	wg.Wait()
	// A pod deleted with no grace (or by a namespace's deletion) is gone already: stop its process.
	k.mu.Lock()
	defer k.mu.Unlock()
	for uid, p := range k.pods {
		if !seen[uid] && !p.stopping {
			p.stopping = true
			go p.proc.Stop()
			delete(k.pods, uid)
		}
	}
}

func (k *Kubelet) syncPod(ctx context.Context, pod *corev1.Pod) error {
	k.mu.Lock()
	run := k.pods[pod.UID]
	k.mu.Unlock()
	switch {
	case pod.DeletionTimestamp != nil:
		return k.terminate(ctx, pod, run)
	case pod.Spec.NodeName == "":
		return k.k8s.SubResource("binding").Create(ctx, pod, &corev1.Binding{
			ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace},
			Target:     corev1.ObjectReference{Kind: "Node", Name: Node},
		})
	case pod.Spec.NodeName != Node:
		return nil
	case run == nil:
		return k.run(ctx, pod)
	}
	if time.Since(run.refreshed) >= k.opts.FileRefresh {
		if err := k.writeVolumes(ctx, pod, run.mounts); err != nil {
			return err
		}
		run.refreshed = time.Now()
	}
	if run.proc.Exited() {
		return k.restart(ctx, pod, run)
	}
	// A ready pod whose status says so is probed every periodSeconds, as the kubelet probes;
	// one not yet ready on every sync, sooner than the kubelet would, so that tests need not wait
	// a period for each pod. Probing a thousand ready pods ten times a second took more of this
	// machine's two cores than the control plane.
	if run.ready && podReady(pod) && pod.Status.PodIP == run.ip && time.Since(run.probed) < run.probePeriod {
		return nil
	}
	run.probed = time.Now()
	ready := probe(run.readyURL)
	if ready == run.ready && podReady(pod) == ready && pod.Status.PodIP == run.ip {
		return nil
	}
	run.ready = ready
	return k.setStatus(ctx, pod, run)
}

// crashBackOff is how long the stand-in waits before it starts an exited enforcer again: the
// kubelet's first back-off is 10 s, doubling up to 5 minutes; tests do not wait so long.
const crashBackOff = time.Second

// restart handles an enforcer that exited, as the kubelet does with restartPolicy Always: the
// pod is not ready, its container waits in CrashLoopBackOff with how it last ended, and it is
// started again after the back-off.
func (k *Kubelet) restart(ctx context.Context, pod *corev1.Pod, run *podRun) error {
	if run.last == nil {
		code := run.proc.cmd.ProcessState.ExitCode()
		run.ready, run.last = false, &corev1.ContainerStateTerminated{ExitCode: int32(code), Reason: "Error",
			StartedAt: metav1.NewTime(run.started), FinishedAt: metav1.Now(), ContainerID: "local://" + strconv.Itoa(run.proc.cmd.Process.Pid)}
		if code == 0 {
			run.last.Reason = "Completed"
		}
		return k.setStatus(ctx, pod, run)
	}
	if time.Since(run.last.FinishedAt.Time) < crashBackOff {
		return nil
	}
	k.mu.Lock()
	delete(k.pods, pod.UID)
	k.mu.Unlock()
	if err := k.run(ctx, pod); err != nil {
		return err
	}
	k.mu.Lock()
	if r := k.pods[pod.UID]; r != nil {
		r.restarts, r.lastState = run.restarts+1, run.last
	}
	k.mu.Unlock()
	return nil
}

// run prepares a pod's files, address and token and starts its enforcer.
func (k *Kubelet) run(ctx context.Context, pod *corev1.Pod) error {
	if len(pod.Spec.Containers) != 1 {
		return fmt.Errorf("%d containers; an enforcer pod has one", len(pod.Spec.Containers))
	}
	ctr := pod.Spec.Containers[0]
	dir := filepath.Join(k.opts.Dir, pod.Name)
	mounts := map[string]string{}
	for _, m := range ctr.VolumeMounts {
		mounts[m.MountPath] = filepath.Join(dir, "volumes", m.Name)
	}
	if err := k.writeVolumes(ctx, pod, mounts); err != nil {
		return err
	}
	env, err := k.env(ctx, pod.Namespace, ctr)
	if err != nil {
		return err
	}
	if ptr.Deref(pod.Spec.AutomountServiceAccountToken, true) {
		kubeconfig, err := k.token(ctx, pod, dir)
		if err != nil {
			return err
		}
		env = append(env, "KUBECONFIG="+kubeconfig)
	}
	ip, err := freeIP(k.opts.PodNetwork, ctr.Ports)
	if err != nil {
		return err
	}
	proc, err := StartWithEnv("enforcer pod "+pod.Name, k.opts.Log, env, k.bin, k.args(ctr.Args, ip, mounts)...)
	if err != nil {
		return err
	}
	run := &podRun{uid: pod.UID, name: pod.Name, ip: ip, proc: proc, mounts: mounts, refreshed: time.Now(), started: time.Now()}
	if p := ctr.ReadinessProbe; p != nil && p.HTTPGet != nil {
		run.readyURL = "http://" + net.JoinHostPort(ip, strconv.Itoa(containerPort(ctr, p.HTTPGet.Port.String()))) + p.HTTPGet.Path
		run.probePeriod = time.Duration(p.PeriodSeconds) * time.Second
		if run.probePeriod <= 0 {
			run.probePeriod = 10 * time.Second // the API server's default
		}
	}
	k.mu.Lock()
	k.pods[pod.UID] = run
	k.mu.Unlock()
	return k.setStatus(ctx, pod, run)
}

// env is the container's environment: its values, and its Secret keys read from the API server.
func (k *Kubelet) env(ctx context.Context, namespace string, ctr corev1.Container) ([]string, error) {
	env := []string{}
	for _, e := range ctr.Env {
		value := e.Value
		if ref := e.ValueFrom; ref != nil && ref.SecretKeyRef != nil {
			var secret corev1.Secret
			if err := k.k8s.Get(ctx, client.ObjectKey{Namespace: namespace, Name: ref.SecretKeyRef.Name}, &secret); err != nil {
				return nil, fmt.Errorf("env %s: %w", e.Name, err)
			}
			v, ok := secret.Data[ref.SecretKeyRef.Key]
			if !ok {
				return nil, fmt.Errorf("env %s: Secret %s has no key %s", e.Name, ref.SecretKeyRef.Name, ref.SecretKeyRef.Key)
			}
			value = string(v)
		} else if ref != nil {
			return nil, fmt.Errorf("env %s: only values and Secret keys are supported", e.Name)
		}
		env = append(env, e.Name+"="+value)
	}
	return env, nil
}

// args are the container's arguments as the process runs them here: --upstream is the stand-in's
// upstream, a listen address ":port" is on the pod's ip, and a path under a mount is under the
// mount's local directory.
func (k *Kubelet) args(args []string, ip string, mounts map[string]string) []string {
	out := make([]string, 0, len(args))
	for _, arg := range args {
		name, value, ok := strings.Cut(arg, "=")
		switch {
		case !ok:
		case name == "--upstream":
			value = k.opts.Upstream
		case strings.HasPrefix(value, ":"):
			value = ip + value
		default:
			for path, local := range mounts {
				if rest, ok := strings.CutPrefix(value, path+"/"); ok {
					value = filepath.Join(local, rest)
				}
			}
		}
		if ok {
			arg = name + "=" + value
		}
		out = append(out, arg)
	}
	return out
}

// terminate stops a deleted pod's process within its grace period, then removes the pod, as the
// kubelet confirms a deletion.
func (k *Kubelet) terminate(ctx context.Context, pod *corev1.Pod, run *podRun) error {
	if run != nil {
		k.mu.Lock()
		if run.stopping {
			k.mu.Unlock()
			return nil
		}
		run.stopping = true
		k.mu.Unlock()
		grace := time.Duration(ptr.Deref(pod.DeletionGracePeriodSeconds, 30)) * time.Second
		go func() {
			_ = run.proc.Signal(syscall.SIGTERM)
			select {
			case <-run.proc.done:
			case <-time.After(grace):
				_ = run.proc.cmd.Process.Kill()
				<-run.proc.done
			}
			err := k.k8s.Delete(context.WithoutCancel(ctx), pod, client.GracePeriodSeconds(0), client.Preconditions{UID: &pod.UID})
			if err != nil && !apierrors.IsNotFound(err) {
				_, _ = fmt.Fprintf(k.opts.Log, "kubelet: delete pod %s: %v\n", pod.Name, err)
			}
			k.mu.Lock()
			delete(k.pods, pod.UID)
			k.mu.Unlock()
		}()
		return nil
	}
	return client.IgnoreNotFound(k.k8s.Delete(ctx, pod, client.GracePeriodSeconds(0), client.Preconditions{UID: &pod.UID}))
}

// writeVolumes writes the pod's ConfigMap and Secret volumes into their directories, each file
// replaced atomically, as the kubelet's symlink swap does.
func (k *Kubelet) writeVolumes(ctx context.Context, pod *corev1.Pod, mounts map[string]string) error {
	for _, m := range pod.Spec.Containers[0].VolumeMounts {
		var files map[string][]byte
		for _, v := range pod.Spec.Volumes {
			if v.Name == m.Name {
				var err error
				if files, err = k.volumeFiles(ctx, pod.Namespace, v); err != nil {
					return fmt.Errorf("volume %s: %w", v.Name, err)
				}
			}
		}
		if files == nil {
			continue // a projected service-account token: handed over as $KUBECONFIG
		}
		if err := writeFiles(mounts[m.MountPath], files); err != nil {
			return err
		}
	}
	return nil
}

// volumeFiles are the files of a ConfigMap or Secret volume by name, or nil for another kind.
func (k *Kubelet) volumeFiles(ctx context.Context, namespace string, v corev1.Volume) (map[string][]byte, error) {
	switch {
	case v.ConfigMap != nil:
		var cm corev1.ConfigMap
		if err := k.k8s.Get(ctx, client.ObjectKey{Namespace: namespace, Name: v.ConfigMap.Name}, &cm); err != nil {
			return nil, err
		}
		files := map[string][]byte{}
		for key, data := range cm.Data {
			files[key] = []byte(data)
		}
		return files, nil
	case v.Secret != nil:
		var secret corev1.Secret
		if err := k.k8s.Get(ctx, client.ObjectKey{Namespace: namespace, Name: v.Secret.SecretName}, &secret); err != nil {
			return nil, err
		}
		if len(v.Secret.Items) == 0 {
			return secret.Data, nil
		}
		files := map[string][]byte{}
		for _, item := range v.Secret.Items {
			files[item.Path] = secret.Data[item.Key]
		}
		return files, nil
	}
	return nil, nil
}

// writeFiles writes files into dir, each replaced atomically unless it holds its data already.
func writeFiles(dir string, files map[string][]byte) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	for name, data := range files {
		path := filepath.Join(dir, name)
		if old, err := os.ReadFile(path); err == nil && string(old) == string(data) {
			continue
		}
		if err := os.WriteFile(path+".tmp", data, 0o600); err != nil {
			return err
		}
		if err := os.Rename(path+".tmp", path); err != nil {
			return err
		}
	}
	return nil
}

// token asks the API server for a token of the pod's service account, bound to the pod, and
// writes a kubeconfig that uses it.
func (k *Kubelet) token(ctx context.Context, pod *corev1.Pod, dir string) (string, error) {
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Spec.ServiceAccountName}}
	if sa.Name == "" {
		sa.Name = "default"
	}
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		ExpirationSeconds: ptr.To[int64](3600),
		BoundObjectRef:    &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}
	if err := k.k8s.SubResource("token").Create(ctx, sa, req); err != nil {
		return "", fmt.Errorf("token of service account %s: %w", sa.Name, err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["cluster"] = &clientcmdapi.Cluster{Server: k.cfg.Host, CertificateAuthorityData: k.cfg.CAData}
	cfg.AuthInfos["pod"] = &clientcmdapi.AuthInfo{Token: req.Status.Token}
	cfg.Contexts["pod"] = &clientcmdapi.Context{Cluster: "cluster", AuthInfo: "pod", Namespace: pod.Namespace}
	cfg.CurrentContext = "pod"
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	path := filepath.Join(dir, "kubeconfig")
	return path, clientcmd.WriteToFile(*cfg, path)
}

// setStatus reports the pod Running at its IP, ready as its probe says.
func (k *Kubelet) setStatus(ctx context.Context, pod *corev1.Pod, run *podRun) error {
	ready := corev1.ConditionFalse
	if run.ready {
		ready = corev1.ConditionTrue
	}
	now := metav1.Now()
	start := metav1.NewTime(run.started)
	pod = pod.DeepCopy()
	pod.Status.Phase = corev1.PodRunning
	pod.Status.HostIP, pod.Status.PodIP = "127.0.0.1", run.ip
	pod.Status.HostIPs, pod.Status.PodIPs = []corev1.HostIP{{IP: "127.0.0.1"}}, []corev1.PodIP{{IP: run.ip}}
	pod.Status.StartTime = &start
	pod.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: start},
		{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: start},
		{Type: corev1.ContainersReady, Status: ready, LastTransitionTime: now},
		{Type: corev1.PodReady, Status: ready, LastTransitionTime: now},
	}
	ctr := pod.Spec.Containers[0]
	status := corev1.ContainerStatus{
		Name: ctr.Name, Image: ctr.Image, ImageID: "local://" + k.bin, ContainerID: "local://" + strconv.Itoa(run.proc.cmd.Process.Pid),
		Ready: run.ready, Started: ptr.To(true), RestartCount: run.restarts,
		State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: start}},
	}
	if run.lastState != nil {
		status.LastTerminationState = corev1.ContainerState{Terminated: run.lastState}
	}
	if run.last != nil {
		// In the kubelet's words: the container waits, and the state it left is its last.
		status.Started = ptr.To(false)
		status.State = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff",
			Message: fmt.Sprintf("back-off %s restarting failed container=%s pod=%s_%s(%s)", crashBackOff, ctr.Name, pod.Name, pod.Namespace, pod.UID)}}
		status.LastTerminationState = corev1.ContainerState{Terminated: run.last}
	}
	pod.Status.ContainerStatuses = []corev1.ContainerStatus{status}
	return k.k8s.Status().Update(ctx, pod)
}

func podReady(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// containerPort resolves a probe's port, a number or a port name.
func containerPort(ctr corev1.Container, port string) int {
	for _, p := range ctr.Ports {
		if p.Name == port {
			return int(p.ContainerPort)
		}
	}
	n, _ := strconv.Atoi(port)
	return n
}

// probe tells whether url answers 200 within a second.
func probe(url string) bool {
	if url == "" {
		return true
	}
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return false
	}
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// freeIP picks an address of network, neither its first nor its last, on which every container
// port is free.
func freeIP(network netip.Prefix, ports []corev1.ContainerPort) (string, error) {
	base := network.Masked().Addr().As4()
	hostBits := 32 - network.Bits()
	if !network.Addr().Is4() || hostBits < 2 {
		return "", fmt.Errorf("pod network %s: an IPv4 network with room for pods is needed", network)
	}
	for range 100 {
		n := binary.BigEndian.Uint32(base[:]) + 1 + rand.Uint32N(uint32(1)<<hostBits-2)
		var a [4]byte
		binary.BigEndian.PutUint32(a[:], n)
		// Neither a subnet's network nor broadcast address, nor 127.0.x.y, where the tests' own
		// servers listen.
		if a[3] == 0 || a[3] == 255 || (a[0] == 127 && a[1] == 0) {
			continue
		}
		ip := netip.AddrFrom4(a).String()
		free := true
		for _, p := range ports {
			l, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(int(p.ContainerPort))))
			if err != nil {
				free = false
				break
			}
			_ = l.Close()
		}
		if free {
			return ip, nil
		}
	}
	return "", fmt.Errorf("no address of %s with the pod's ports free", network)
}

// EnforcerPods returns the running enforcer pods of a policy that have an IP, by name.
func EnforcerPods(ctx context.Context, k8s client.Client, namespace, policy string) ([]corev1.Pod, error) {
	var pods corev1.PodList
	if err := k8s.List(ctx, &pods, client.InNamespace(namespace),
		client.MatchingLabels(render.PodLabels(&v1alpha1.RateLimitPolicy{ObjectMeta: metav1.ObjectMeta{Name: policy}}))); err != nil {
		return nil, err
	}
	var out []corev1.Pod
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil && p.Status.PodIP != "" && p.Status.Phase == corev1.PodRunning {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// PodURL is the URL of a port of an enforcer pod run by a Kubelet: "proxy", "check" or "admin".
func PodURL(pod *corev1.Pod, port string) string {
	return "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(containerPort(pod.Spec.Containers[0], port)))
}
