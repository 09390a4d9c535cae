// Command kube-controller-manager is the upstream controller manager, built from Go modules so that
// the test control plane runs the real Deployment, ReplicaSet, garbage-collector and
// PodDisruptionBudget controllers without a download outside the Go module proxy.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	os.Exit(cli.Run(app.NewControllerManagerCommand()))
}
