package buildinfo_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// make build and the images stamp the version and commit with the linker, as the Makefile's
// LDFLAGS and the Dockerfile say: a renamed variable would leave them "unknown" without a word.
// Both binaries are built with the Makefile's flags and asked for --version.
func TestLinkerFlagsWhenTheMakefileStampsABuildThenVersionPrintsThem(t *testing.T) {
	tier.Needs(t, "the go command, to build both binaries")
	root := testenv.RepoRoot()
	makefile, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^LDFLAGS := (.+)$`).FindSubmatch(makefile)
	if m == nil {
		t.Fatal("the Makefile has no LDFLAGS")
	}
	ldflags := strings.NewReplacer("$(VERSION)", "v9.9.9-test", "$(COMMIT)", "0123abc").Replace(string(m[1]))
	dockerfile, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range []string{"-X github.com/sluice-dev/sluice/internal/buildinfo.version=", "-X github.com/sluice-dev/sluice/internal/buildinfo.commit="} {
		if !strings.Contains(ldflags, x) || !strings.Contains(string(dockerfile), x) {
			t.Errorf("the Makefile's LDFLAGS or the Dockerfile lacks %q", x)
		}
	}
	for _, name := range []string{"manager", "enforcer"} {
		bin := filepath.Join(t.TempDir(), name)
		build := local.GoBuild(context.Background(), root, "-ldflags", ldflags, "-o", bin, "./cmd/"+name)
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("go build ./cmd/%s: %v\n%s", name, err, out)
		}
		out, err := exec.Command(bin, "--version").Output()
		if err != nil {
			t.Fatalf("%s --version: %v", name, err)
		}
		if want := name + " version v9.9.9-test, commit 0123abc, go"; !strings.HasPrefix(string(out), want) {
			t.Errorf("%s --version: %q, want it to start with %q", name, out, want)
		}
	}
}
