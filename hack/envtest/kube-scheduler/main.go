// Command kube-scheduler is the upstream scheduler, built from Go modules like the test control
// plane, so that the real-node tier's pods are placed (or left Unschedulable) as in a cluster.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	os.Exit(cli.Run(app.NewSchedulerCommand()))
}
