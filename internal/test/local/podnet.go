package local

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"syscall"
)

// PodNetwork is the pod network of a test process that RunInPodNetwork started: every address
// of it is local, in a network namespace of the test's own that reaches nothing else.
var PodNetwork = netip.MustParsePrefix("10.244.0.0/16")

// podNetworkEnv tells the re-executed test binary that it runs inside its network namespace.
const podNetworkEnv = "SLUICE_POD_NETWORK"

// InPodNetwork reports whether this process runs in the network namespace RunInPodNetwork made.
func InPodNetwork() bool { return os.Getenv(podNetworkEnv) == PodNetwork.String() }

// RunInPodNetwork runs this test binary again, with the same arguments and environment plus
// env, in a new network namespace whose loopback interface holds PodNetwork as local addresses
// (a route of type local, as kube-proxy's IPVS mode gives service addresses), and returns its
// exit status. Inside, pods get addresses that EndpointSlices accept, and a gateway routes to
// them as it does in a cluster; loopback works as before, and nothing outside the machine, or
// outside the namespace, can be reached. Needs unshare (util-linux), ip (iproute2) and the
// privilege to make a network namespace (root).
func RunInPodNetwork(env ...string) (int, error) {
	if InPodNetwork() {
		return 0, errors.New("already in the pod network")
	}
	script := `ip link set lo up && ip route add local "$` + podNetworkEnv + `" dev lo`
	return InNetworkNamespace(script, append(env, podNetworkEnv+"="+PodNetwork.String())...)
}

// InNetworkNamespace runs this test binary again, with the same arguments and environment plus
// env, in a new network namespace that the shell script sets up first, and returns its exit
// status. The namespace dies with this process.
func InNetworkNamespace(script string, env ...string) (int, error) {
	cmd := exec.Command("unshare", append([]string{"--net", "--", "/bin/sh", "-ec", script + "\nexec \"$@\"", "sh"}, os.Args...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err := cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode(), nil
	}
	if err != nil {
		return 1, fmt.Errorf("run the tests in a network namespace of their own (unshare --net): %w", err)
	}
	return 0, nil
}
