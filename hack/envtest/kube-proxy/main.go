// Command kube-proxy is the upstream kube-proxy, built from Go modules like the test control plane,
// so that the real-node tier reaches pods through Service ClusterIPs.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	"k8s.io/kubernetes/cmd/kube-proxy/app"
)

func main() {
	os.Exit(cli.Run(app.NewProxyCommand()))
}
