// Package architecture holds the import graph to the architecture: the control plane shares the
// compiled model (internal/policy, internal/algorithm) and the report contract (internal/report)
// with the data plane and never imports the enforcer; the API imports apimachinery and the core
// types only. golangci-lint's depguard says the same of direct imports; this test follows every
// import, through any package in between.
package architecture

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/sluice-dev/sluice/internal/test/testenv"
)

const module = "github.com/sluice-dev/sluice/"

// deps lists every package that pkg imports, directly or not, with the standard library left out.
func deps(t *testing.T, pkg string) []string {
	t.Helper()
	cmd := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", pkg)
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	return strings.Fields(string(out))
}

func TestControlPlaneWhenItsImportsAreFollowedThenNoneIsTheDataPlane(t *testing.T) {
	for _, pkg := range []string{"./cmd/manager", "./controllers", "./webhook", "./internal/render", "./internal/certs"} {
		for _, dep := range deps(t, pkg) {
			if strings.HasPrefix(dep, module+"enforcer") {
				t.Errorf("%s imports %s: the control plane shares internal/policy, internal/algorithm and internal/report with the enforcer, never the enforcer", pkg, dep)
			}
		}
	}
}

func TestAPIWhenItsImportsAreFollowedThenOnlyApimachineryAndCoreTypes(t *testing.T) {
	cmd := exec.Command("go", "list", "-f", "{{join .Imports \"\\n\"}}", "./api/...")
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list ./api/...: %v", err)
	}
	for _, imp := range strings.Fields(string(out)) {
		if !strings.Contains(imp, ".") { // the standard library
			continue
		}
		if !strings.HasPrefix(imp, "k8s.io/apimachinery/") && !strings.HasPrefix(imp, "k8s.io/api/core/") {
			t.Errorf("api imports %s: the API imports apimachinery and the core types only", imp)
		}
	}
	// Everything the API pulls in comes through those two: nothing of Sluice's but the API itself.
	for _, dep := range deps(t, "./api/...") {
		if strings.HasPrefix(dep, module) && !strings.HasPrefix(dep, module+"api/") {
			t.Errorf("api depends on %s", dep)
		}
	}
}
