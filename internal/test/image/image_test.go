package image_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"

	"github.com/sluice-dev/sluice/internal/test/image"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// TestDockerfileBuildsBothImagesInItsOwnContext builds what `docker build` builds: both binaries
// from exactly what the Dockerfile copies, and the final stages' images with their user and
// entrypoint. The binaries run, and say the version they were built with.
func TestDockerfileBuildsBothImagesInItsOwnContext(t *testing.T) {
	tier.Needs(t, "a build of both binaries")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	dir := t.TempDir()
	images, err := image.Build(ctx, image.Options{
		Dockerfile: filepath.Join(testenv.RepoRoot(), "Dockerfile"),
		Dir:        dir,
		Args:       map[string]string{"VERSION": "v9.8.7", "COMMIT": "abc123"},
	}, "sluice.test", "v9.8.7")
	if err != nil {
		t.Fatal(err)
	}
	var targets []string
	for _, img := range images {
		targets = append(targets, img.Target)
		cf, err := img.Image.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.Config.User != "65532:65532" {
			t.Errorf("%s: user %q, want 65532:65532", img.Target, cf.Config.User)
		}
		if want := []string{"/" + img.Target}; !slices.Equal(cf.Config.Entrypoint, want) {
			t.Errorf("%s: entrypoint %q, want %q", img.Target, cf.Config.Entrypoint, want)
		}
		// The tarball is what containerd imports: read the binary back from it and run it.
		loaded, err := tarball.ImageFromPath(img.Tarball, nil)
		if err != nil {
			t.Fatal(err)
		}
		bin := filepath.Join(dir, img.Target+"-from-image")
		data, err := image.ReadFile(loaded, img.Target)
		if err != nil {
			t.Fatalf("%s: %v", img.Target, err)
		}
		if err := os.WriteFile(bin, data, 0o755); err != nil { //nolint:gosec // a binary to run
			t.Fatal(err)
		}
		out, err := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
		if err != nil {
			t.Fatalf("%s --version: %v\n%s", img.Target, err, out)
		}
		if !strings.Contains(string(out), "v9.8.7") || !strings.Contains(string(out), "abc123") {
			t.Errorf("%s --version = %q, want the build's VERSION v9.8.7 and COMMIT abc123", img.Target, out)
		}
	}
	slices.Sort(targets)
	if !slices.Equal(targets, []string{"enforcer", "manager"}) {
		t.Errorf("final stages %q, want enforcer and manager", targets)
	}
}

// TestWhenTheBuildStageMissesACopyThenTheBuildFails is the failure the test above exists for: the
// Dockerfile without the COPY of config/ (imported by the enforcer for the CRD's schema) built
// nothing for days while every test passed.
func TestWhenTheBuildStageMissesACopyThenTheBuildFails(t *testing.T) {
	tier.Needs(t, "a build of both binaries")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	st, err := image.Parse(filepath.Join(testenv.RepoRoot(), "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	before := len(st.Build.Commands)
	st.Build.Commands = slices.DeleteFunc(st.Build.Commands, func(c instructions.Command) bool {
		cp, ok := c.(*instructions.CopyCommand)
		return ok && slices.Contains(cp.SourcePaths, "config/")
	})
	if len(st.Build.Commands) != before-1 {
		t.Fatalf("the Dockerfile has no COPY config/ to leave out")
	}
	_, err = st.RunBuild(ctx, image.Options{Dockerfile: filepath.Join(testenv.RepoRoot(), "Dockerfile"), Dir: t.TempDir()})
	if err == nil || !strings.Contains(err.Error(), "config/crd") {
		t.Fatalf("build without COPY config/: err = %v, want the missing package config/crd named", err)
	}
}
