// Command kubelet is the upstream kubelet, built from Go modules like the test control plane, so
// that the real-node tier runs Sluice's images as pods on a real node.
package main

import (
	"context"
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	os.Exit(cli.Run(app.NewKubeletCommand(context.Background())))
}
