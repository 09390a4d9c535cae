package architecture

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// frontEnds are the enforcer's front ends' packages: the fasthttp proxy, the net/http proxy,
// the check API and Envoy's rate limit service.
const frontEnds = module + "enforcer/internal/front/"

// list lists the packages of a pattern, each with its direct imports of this module.
func list(t *testing.T, pattern string) map[string][]string {
	t.Helper()
	cmd := exec.Command("go", "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, pattern)
	cmd.Dir = testenv.RepoRoot()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list %s: %v", pattern, err)
	}
	pkgs := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		for _, imp := range fields[1:] {
			if strings.HasPrefix(imp, module) {
				pkgs[fields[0]] = append(pkgs[fields[0]], imp)
			}
		}
		if _, ok := pkgs[fields[0]]; !ok {
			pkgs[fields[0]] = nil
		}
	}
	return pkgs
}

// The enforcer is front ends around the decision seam (enforcer/internal/seam). Following every
// import, no front end reaches another, and none of what they share (the seam, connections,
// panics, forwarded fields, the limiter, the store) reaches a front end: only the wiring
// (package enforcer) assembles them. A front end's own imports name neither the store, which it
// reaches through the limiter, nor the config sources. golangci-lint's depguard says the same of
// direct imports.
func TestEnforcerWhenItsImportsAreFollowedThenEachFrontEndStandsAloneOnTheSeam(t *testing.T) {
	pkgs := list(t, "./enforcer/internal/...")
	fronts := 0
	for pkg, imports := range pkgs {
		own, isFront := strings.CutPrefix(pkg, frontEnds)
		if isFront {
			fronts++
			for _, imp := range imports {
				if strings.HasPrefix(imp, module+"enforcer/internal/store") || strings.HasPrefix(imp, module+"enforcer/internal/config") {
					t.Errorf("front end %s imports %s: it decides through the seam and serves the policies in force", own, imp)
				}
			}
		}
		for _, dep := range deps(t, pkg) {
			other, reaches := strings.CutPrefix(dep, frontEnds)
			switch {
			case !reaches || other == own:
			case isFront:
				t.Errorf("front end %s reaches front end %s: what two front ends share belongs below them", own, other)
			default:
				t.Errorf("%s reaches front end %s: the front ends sit on top of what they share", pkg, other)
			}
		}
	}
	if fronts != 4 {
		t.Errorf("%d front ends under %s, want 4 (fastproxy, netproxy, check, rls)", fronts, frontEnds)
	}
}
