package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sluice-dev/sluice/internal/test/poll"
)

// cgroupRoot is where cgroup v1 controllers are mounted; the kubelet's pods go under c.cgroup in
// each.
const cgroupRoot = "/sys/fs/cgroup"

// cgroups makes the cluster's cgroup root in every cgroup v1 controller, as the kubelet wants it
// to exist; a cpuset gets its parent's CPUs and memory nodes, which a new cpuset lacks.
func (c *Cluster) cgroups() error {
	for _, ctrl := range cgroupControllers() {
		dir := filepath.Join(cgroupRoot, ctrl, c.cgroup)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("make the cluster's cgroup root: %w", err)
		}
		if ctrl == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(cgroupRoot, ctrl, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil { //nolint:gosec // a cgroup file
					return err
				}
			}
		}
	}
	return nil
}

// cgroupControllers are the cgroup v1 hierarchies mounted on this machine.
func cgroupControllers() []string {
	entries, _ := os.ReadDir(cgroupRoot)
	var ctrls []string
	for _, e := range entries {
		if e.IsDir() && e.Name() != "unified" {
			ctrls = append(ctrls, e.Name())
		}
	}
	return ctrls
}

// socket is containerd's socket.
func (c *Cluster) socket() string { return filepath.Join(c.Dir, "containerd.sock") }

// containerd starts containerd with its state in the cluster's directory, the CRI plugin's pause
// image the one Import brings (PauseImage), and the pods on the bridge.
func (c *Cluster) containerd(ctx context.Context) error {
	cni := filepath.Join(c.Dir, "cni")
	if err := os.MkdirAll(filepath.Join(cni, "net.d"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(cni, "net.d", "10-sluice.conflist"), fmt.Appendf(nil, cniConfig, Bridge, PodCIDR, NodeIP, filepath.Join(cni, "ipam")), 0o644); err != nil { //nolint:gosec // a config file
		return err
	}
	config := filepath.Join(c.Dir, "containerd.toml")
	data := fmt.Sprintf(containerdConfig, filepath.Join(c.Dir, "containerd", "root"), filepath.Join(c.Dir, "containerd", "state"),
		c.socket(), PauseImage, filepath.Join(cni, "net.d"))
	if err := os.WriteFile(config, []byte(data), 0o644); err != nil { //nolint:gosec // a config file
		return err
	}
	if err := c.start("containerd", "containerd", "--config="+config); err != nil {
		return err
	}
	if err := poll.Until(30*time.Second, func() error {
		_, err := os.Stat(c.socket())
		return err
	}); err != nil {
		return fmt.Errorf("containerd did not open %s: %w", c.socket(), err)
	}
	return c.importPause(ctx)
}

// containerdConfig is containerd 1.6's configuration: the CRI plugin with runc and cgroupfs, the
// overlayfs snapshotter, and Debian's CNI plugins; the pods' network namespaces are mounted under
// its state directory rather than /var/run/netns, so that they go with the cluster. The OOM scores the kubelet asks for are held
// to containerd's own, as kind's nodes hold them: this machine gives root no CAP_SYS_RESOURCE, so
// runc may not lower a score (a pod sandbox's -998 failed every pod with "can't get final child's
// PID from pipe").
const containerdConfig = `version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
`

// cniConfig puts pods on the bridge, which is the node's address and their gateway, with
// addresses from host-local; hairpin mode lets a pod reach itself through its Service.
const cniConfig = `{
  "cniVersion": "1.0.0",
  "name": "sluice",
  "plugins": [
    {
      "type": "bridge", "bridge": %q, "isGateway": true, "isDefaultGateway": true, "hairpinMode": true, "ipMasq": false,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": %q, "rangeStart": "10.88.1.0", "gateway": %q}]], "dataDir": %q}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

// Import imports image tarballs (as image.Write writes them) into containerd, where the kubelet
// finds them: a pod that names one with imagePullPolicy IfNotPresent runs it.
func (c *Cluster) Import(ctx context.Context, tarballs ...string) error {
	for _, t := range tarballs {
		cmd := exec.CommandContext(ctx, "ctr", "--address", c.socket(), "--namespace", "k8s.io", "images", "import", "--snapshotter", "overlayfs", t)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("ctr images import %s: %w: %s", t, err, out)
		}
	}
	return nil
}

// Stop stops the cluster and removes what it left on the machine: the pods' processes, the
// containerd shims, the mounts and cgroups, and the state directory.
func (c *Cluster) Stop() error {
	// The kubelet first, so that it restarts nothing; then every pod's process, and the shims.
	c.stop("kubelet", "kube-proxy")
	killPods(c.cgroup)
	killShims(c.socket())
	var order []string
	for i := len(c.procs) - 1; i >= 0; i-- {
		order = append(order, c.procs[i].Name)
	}
	c.stop(order...)
	for _, log := range c.logs {
		_ = log.Close()
	}
	return cleanUp(c.Dir)
}

// ownerFile names the process that runs the cluster of a state directory.
const ownerFile = "owner.pid"

// sweep cleans up after the clusters of earlier test processes that died without stopping them
// (a test binary killed by its timeout): their pods, shims, mounts, cgroups and directories. A
// directory whose owner still runs is another test's, and left alone.
func sweep() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "sluice-node-*"))
	for _, dir := range dirs {
		data, err := os.ReadFile(filepath.Join(dir, ownerFile))
		if err != nil {
			continue
		}
		if pid, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && syscall.Kill(pid, 0) == nil {
			continue
		}
		killPods("/" + filepath.Base(dir))
		killShims(filepath.Join(dir, "containerd.sock"))
		_ = cleanUp(dir)
	}
}

// cleanUp removes the mounts, cgroups and state directory of the cluster in dir, whose processes
// are gone.
func cleanUp(dir string) error {
	errs := []error{unmountUnder(dir)}
	for _, ctrl := range cgroupControllers() {
		errs = append(errs, removeCgroups(filepath.Join(cgroupRoot, ctrl, filepath.Base(dir))))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("clean up the node (state left in %s): %w", dir, err)
	}
	return os.RemoveAll(dir)
}

// stop ends the named components: SIGTERM, then SIGKILL after 10 seconds.
func (c *Cluster) stop(names ...string) {
	for _, name := range names {
		for _, p := range c.procs {
			if p.Name == name {
				p.Stop()
			}
		}
	}
}

// killPods kills every process in the cgroups under root, until none is left.
func killPods(root string) {
	for range 50 {
		pids := map[int]bool{}
		for _, ctrl := range cgroupControllers() {
			_ = filepath.WalkDir(filepath.Join(cgroupRoot, ctrl, root), func(p string, d os.DirEntry, err error) error {
				if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
					return nil
				}
				data, _ := os.ReadFile(p)
				for _, f := range strings.Fields(string(data)) {
					if pid, err := strconv.Atoi(f); err == nil {
						pids[pid] = true
					}
				}
				return nil
			})
		}
		if len(pids) == 0 {
			return
		}
		for pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond) // the kernel takes a moment to empty the cgroups of killed processes
	}
}

// killShims kills the containerd shims started for the containerd at socket.
func killShims(socket string) {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		args := strings.Split(string(cmdline), "\x00")
		if len(args) > 0 && strings.Contains(args[0], "containerd-shim") && slices.Contains(args, socket) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// unmountUnder unmounts every mount below dir, deepest first.
func unmountUnder(dir string) error {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	var mounts []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], dir+"/") {
			mounts = append(mounts, fields[4])
		}
	}
	slices.SortFunc(mounts, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, m := range mounts {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	return errors.Join(errs...)
}

// removeCgroups removes the cgroup dir and every cgroup below it, deepest first.
func removeCgroups(dir string) error {
	var dirs []string
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	slices.SortFunc(dirs, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, d := range dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
