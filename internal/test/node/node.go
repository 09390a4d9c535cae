// Package node runs a small real cluster on this machine for the tests that only a container
// runtime can answer: etcd, kube-apiserver, kube-controller-manager and kube-scheduler, CoreDNS,
// and one node of containerd and runc (Debian's), a kubelet and kube-proxy, every Kubernetes
// binary built from Go modules by hack/envtest.sh. Pods run from images imported into
// containerd, get addresses on a bridge from Debian's CNI plugins, resolve Service names through
// CoreDNS, and are reached through Service ClusterIPs as kube-proxy programs them.
//
// Everything runs inside the network namespace of the test process, which RunInNodeNetwork
// makes: the node's address, the bridge, the pods' routes and kube-proxy's rules live and die
// with it, and no traffic leaves the machine. The state of containerd and the kubelet lives in
// a temporary directory, the pods' cgroups under a cgroup root of the cluster's own; Stop kills
// the pods and removes all three. It needs root, as a kubelet does.
package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// The cluster's addresses, inside the network namespace RunInNodeNetwork makes.
const (
	// NodeIP is the node's address: the bridge's, where the API server, the kubelet and CoreDNS
	// listen, and the pods' gateway.
	NodeIP = "10.88.0.1"
	// PodCIDR is the bridge's network, from which pods get their addresses.
	PodCIDR = "10.88.0.0/16"
	// ServiceCIDR is where Services get their ClusterIPs.
	ServiceCIDR = "10.96.0.0/16"
	// NodeName is the node's name.
	NodeName = "node-0"
	// Bridge is the bridge's interface.
	Bridge  = "cni0"
	apiPort = 6443
)

// Cluster is a running cluster of one node.
type Cluster struct {
	// Config is a cluster administrator's; Kubeconfig its file, for kubectl and helm.
	Config     *rest.Config
	Kubeconfig string
	Client     kubernetes.Interface
	// Bin holds the Kubernetes binaries (hack/envtest.sh), kubectl among them.
	Bin string
	// Dir holds the cluster's state; each component's log is <name>.log in it.
	Dir string

	cgroup string
	procs  []*local.Process
	logs   []*os.File
}

// Start starts the cluster with the binaries in bin and waits until its node is Ready. The
// caller must be in the node network (RunInNodeNetwork) and root.
func Start(ctx context.Context, bin string) (_ *Cluster, err error) {
	if !InNodeNetwork() {
		return nil, errors.New("the node tier runs in a network namespace of its own: call RunInNodeNetwork from TestMain")
	}
	sweep()
	dir, err := os.MkdirTemp("", "sluice-node-")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil { //nolint:gosec // a pid
		return nil, err
	}
	c := &Cluster{Bin: bin, Dir: dir, cgroup: "/" + filepath.Base(dir)}
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, c.Logs())
			_ = c.Stop()
		}
	}()
	p, err := newPKI(filepath.Join(dir, "pki"))
	if err != nil {
		return nil, err
	}
	if err := c.controlPlane(ctx, p); err != nil {
		return nil, err
	}
	if err := c.dns(ctx, p); err != nil {
		return nil, err
	}
	if err := c.node(ctx, p); err != nil {
		return nil, err
	}
	return c, nil
}

// server is the API server's URL.
var server = fmt.Sprintf("https://%s:%d", NodeIP, apiPort)

// controlPlane starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler, and makes
// the administrator's client.
func (c *Cluster) controlPlane(ctx context.Context, p *pki) error {
	if err := certificates(p); err != nil {
		return err
	}
	saKey, saPub, err := p.serviceAccountKey()
	if err != nil {
		return err
	}
	if err := c.apiServer(ctx, p, saKey, saPub); err != nil {
		return err
	}
	kcm, err := p.kubeconfig("controller-manager", server)
	if err != nil {
		return err
	}
	if err := c.start("kube-controller-manager", "kube-controller-manager",
		"--kubeconfig="+kcm, "--authentication-kubeconfig="+kcm, "--authorization-kubeconfig="+kcm,
		"--root-ca-file="+p.caFile(), "--service-account-private-key-file="+saKey,
		"--use-service-account-credentials=true", "--controllers=*", "--leader-elect=false",
		"--bind-address=127.0.0.1", "--cluster-name=sluice",
		"--kube-api-qps=100", "--kube-api-burst=200", "--concurrent-gc-syncs=5"); err != nil {
		return err
	}
	sched, err := p.kubeconfig("scheduler", server)
	if err != nil {
		return err
	}
	return c.start("kube-scheduler", "kube-scheduler",
		"--kubeconfig="+sched, "--authentication-kubeconfig="+sched, "--authorization-kubeconfig="+sched,
		"--leader-elect=false", "--bind-address=127.0.0.1")
}

// certificates issues the serving certificates of the API server and the kubelet, and the client
// certificates of every component and the administrator.
func certificates(p *pki) error {
	ip := net.ParseIP(NodeIP)
	firstServiceIP := net.ParseIP("10.96.0.1")
	errs := []error{
		p.serving("apiserver", []string{"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local", "localhost"}, ip, firstServiceIP, net.ParseIP("127.0.0.1")),
		p.serving("kubelet-serving", []string{NodeName}, ip),
		p.client("admin", "sluice-admin", "system:masters"),
		p.client("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"),
		p.client("controller-manager", "system:kube-controller-manager"),
		p.client("scheduler", "system:kube-scheduler"),
		p.client("kubelet", "system:node:"+NodeName, "system:nodes"),
		p.client("kube-proxy", "system:kube-proxy"),
	}
	return errors.Join(errs...)
}

// apiServer starts etcd and kube-apiserver, makes the administrator's client and waits for the
// API server to be ready.
func (c *Cluster) apiServer(ctx context.Context, p *pki, saKey, saPub string) error {
	if err := c.start("etcd", "etcd",
		"--data-dir="+filepath.Join(c.Dir, "etcd"),
		"--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380", "--unsafe-no-fsync", "--log-level=warn"); err != nil {
		return err
	}
	crt, key := p.files("apiserver")
	kcrt, kkey := p.files("apiserver-kubelet-client")
	if err := c.start("kube-apiserver", "kube-apiserver",
		"--etcd-servers=http://127.0.0.1:2379",
		"--bind-address="+NodeIP, "--advertise-address="+NodeIP, fmt.Sprintf("--secure-port=%d", apiPort),
		"--service-cluster-ip-range="+ServiceCIDR,
		"--tls-cert-file="+crt, "--tls-private-key-file="+key, "--client-ca-file="+p.caFile(),
		"--kubelet-client-certificate="+kcrt, "--kubelet-client-key="+kkey,
		"--kubelet-preferred-address-types=InternalIP",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+saPub, "--service-account-signing-key-file="+saKey,
		"--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
		"--allow-privileged=true", "--profiling=false", "--event-ttl=10m"); err != nil {
		return err
	}
	admin, err := p.kubeconfig("admin", server)
	if err != nil {
		return err
	}
	c.Kubeconfig = admin
	if c.Config, err = clientcmd.BuildConfigFromFlags("", admin); err != nil {
		return err
	}
	c.Config.QPS, c.Config.Burst = 100, 200
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		return err
	}
	if err := poll.Until(time.Minute, func() error {
		_, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err
	}); err != nil {
		return fmt.Errorf("kube-apiserver not ready: %w", err)
	}
	return nil
}

// dns starts CoreDNS on the node's address as the cluster's DNS, serving cluster.local from the
// API server.
func (c *Cluster) dns(_ context.Context, _ *pki) error {
	corefile := filepath.Join(c.Dir, "Corefile")
	conf := fmt.Sprintf(`.:53 {
    errors
    health 127.0.0.1:8080
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig %s sluice
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
`, c.Kubeconfig)
	if err := os.WriteFile(corefile, []byte(conf), 0o644); err != nil { //nolint:gosec // a config file
		return err
	}
	return c.start("coredns", "coredns", "-conf", corefile)
}

// node starts containerd, the kubelet and kube-proxy, and waits until the node is Ready.
func (c *Cluster) node(ctx context.Context, p *pki) error {
	if err := c.cgroups(); err != nil {
		return err
	}
	if err := c.containerd(ctx); err != nil {
		return err
	}
	kubelet, err := p.kubeconfig("kubelet", server)
	if err != nil {
		return err
	}
	crt, key := p.files("kubelet-serving")
	resolv := filepath.Join(c.Dir, "resolv.conf")
	if err := os.WriteFile(resolv, nil, 0o644); err != nil { //nolint:gosec // a config file
		return err
	}
	config := filepath.Join(c.Dir, "kubelet.yaml")
	if err := os.WriteFile(config, fmt.Appendf(nil, kubeletConfig, c.cgroup, c.socket(), NodeIP, crt, key, p.caFile(), NodeIP, resolv,
		filepath.Join(c.Dir, "pod-logs")), 0o644); err != nil { //nolint:gosec // a config file
		return err
	}
	if err := os.MkdirAll("/var/log/containers", 0o755); err != nil {
		return err
	}
	if err := c.start("kubelet", "kubelet",
		"--config="+config, "--kubeconfig="+kubelet, "--root-dir="+filepath.Join(c.Dir, "kubelet"),
		"--hostname-override="+NodeName, "--node-ip="+NodeIP, "-v=1"); err != nil {
		return err
	}
	proxy, err := p.kubeconfig("kube-proxy", server)
	if err != nil {
		return err
	}
	proxyConfig := filepath.Join(c.Dir, "kube-proxy.yaml")
	if err := os.WriteFile(proxyConfig, fmt.Appendf(nil, kubeProxyConfig, proxy, PodCIDR, NodeName), 0o644); err != nil { //nolint:gosec // a config file
		return err
	}
	if err := c.start("kube-proxy", "kube-proxy", "--config="+proxyConfig); err != nil {
		return err
	}
	return poll.Every(time.Second, 2*time.Minute, func() error {
		n, err := c.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
				return nil
			} else if cond.Type == corev1.NodeReady {
				return fmt.Errorf("node %s not Ready: %s: %s", NodeName, cond.Reason, cond.Message)
			}
		}
		return fmt.Errorf("node %s has no Ready condition yet", NodeName)
	})
}

// kubeletConfig is the kubelet's configuration: cgroupfs on this machine's cgroup v1 (which
// kubelets from 1.35 on refuse unless told), authentication by the cluster's CA and authorization
// by the API server, the cluster's DNS on the node, and no eviction or image garbage collection
// that a busy test machine could set off.
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: %s
containerRuntimeEndpoint: unix://%s
address: %s
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
tlsCertFile: %s
tlsPrivateKeyFile: %s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization: {mode: Webhook}
clusterDNS: [%s]
clusterDomain: cluster.local
resolvConf: %s
podLogsDir: %s
failSwapOn: false
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%%, imagefs.available: 1%%, nodefs.inodesFree: 1%%}
syncFrequency: 10s
fileCheckFrequency: 5s
nodeStatusReportFrequency: 10s
shutdownGracePeriod: 0s
`

// kubeProxyConfig is kube-proxy's configuration, in iptables mode, with the conntrack sysctls
// left as they are: they are the machine's, not the network namespace's.
const kubeProxyConfig = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %s}
mode: iptables
clusterCIDR: %s
hostnameOverride: %s
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
`

// start starts the component name from the binary bin of c.Bin (or of PATH), logging to
// <name>.log; it dies with the test process.
func (c *Cluster) start(name, bin string, args ...string) error {
	path := filepath.Join(c.Bin, bin)
	if _, err := os.Stat(path); err != nil {
		if path, err = exec.LookPath(bin); err != nil {
			return fmt.Errorf("%s: no %s in %s nor on PATH (hack/envtest.sh builds the Kubernetes binaries; containerd comes from Debian)", name, bin, c.Bin)
		}
	}
	log, err := os.Create(filepath.Join(c.Dir, name+".log"))
	if err != nil {
		return err
	}
	pr, err := local.Start(name, log, path, args...)
	if err != nil {
		_ = log.Close()
		return err
	}
	c.procs, c.logs = append(c.procs, pr), append(c.logs, log)
	return nil
}

// Logs is the last lines of every component's log, for a failure's message.
func (c *Cluster) Logs() string {
	var b strings.Builder
	for _, p := range c.procs {
		data, _ := os.ReadFile(filepath.Join(c.Dir, p.Name+".log"))
		lines := strings.Split(strings.TrimSpace(string(data)), "\n")
		if len(lines) > 15 {
			lines = lines[len(lines)-15:]
		}
		state := "running"
		if p.Exited() {
			state = fmt.Sprintf("exited: %v", p.Wait())
		}
		fmt.Fprintf(&b, "--- %s (%s), last lines of %s:\n%s\n", p.Name, state, filepath.Join(c.Dir, p.Name+".log"), strings.Join(lines, "\n"))
	}
	return b.String()
}

// Kubectl runs kubectl against the cluster as its administrator, in the repository's root, and
// returns its output.
func (c *Cluster) Kubectl(ctx context.Context, stdin io.Reader, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(c.Bin, "kubectl"), append([]string{"--kubeconfig=" + c.Kubeconfig}, args...)...)
	cmd.Dir = testenv.RepoRoot()
	cmd.Stdin = stdin
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return out.Bytes(), nil
}

// Get sends a GET to url, which a ClusterIP or a pod address may serve, from the node.
func Get(ctx context.Context, url string, header http.Header) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header = header
	return http.DefaultClient.Do(req)
}
