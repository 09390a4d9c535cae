// Command enforcer is the Sluice data plane. The server is not built yet: this binary only says
// so, and exits with an error rather than pretend to enforce anything.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "sluice enforcer: the data-plane server is not built yet; nothing is enforced")
	os.Exit(2)
}
