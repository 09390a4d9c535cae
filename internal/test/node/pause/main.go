// Command pause is the node tier's pod sandbox: the process that holds a pod's namespaces, as
// Kubernetes's own pause image does (which cannot be pulled here). It waits for SIGTERM or
// SIGINT, reaping any child handed to it meanwhile.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			return
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
