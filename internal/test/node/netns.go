package node

import (
	"errors"
	"os"

	"github.com/sluice-dev/sluice/internal/test/local"
)

// nodeNetworkEnv tells the re-executed test binary that it runs inside the node network.
const nodeNetworkEnv = "SLUICE_NODE_NETWORK"

// InNodeNetwork reports whether this process runs in the network namespace RunInNodeNetwork made.
func InNodeNetwork() bool { return os.Getenv(nodeNetworkEnv) == NodeIP }

// RunInNodeNetwork runs this test binary again, with the same arguments, in a new network
// namespace, and returns its exit status. Inside, the bridge the pods join holds the node's
// address, packets are forwarded and bridged packets pass iptables (as kube-proxy needs), and
// Service addresses route to the bridge. Nothing outside the machine can be reached, and the
// namespace, kube-proxy's rules with it, goes when the test process ends. Needs unshare
// (util-linux), ip (iproute2) and root.
func RunInNodeNetwork() (int, error) {
	if InNodeNetwork() {
		return 0, errors.New("already in the node network")
	}
	script := `ip link set lo up
ip link add ` + Bridge + ` type bridge
ip addr add ` + NodeIP + `/16 dev ` + Bridge + `
ip link set ` + Bridge + ` up
ip route add ` + ServiceCIDR + ` dev ` + Bridge + `
echo 1 > /proc/sys/net/ipv4/ip_forward
echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables`
	return local.InNetworkNamespace(script, nodeNetworkEnv+"="+NodeIP)
}
