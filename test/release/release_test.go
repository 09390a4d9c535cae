// Package release_test runs what .github/workflows/release.yaml builds for a tag, on a machine with
// no Docker and no access to ghcr.io: the tag check, the Dockerfile's build stage for every
// platform the workflow releases, the multi-arch images, and the chart packaged by the same make
// target, both pushed to a registry of the test's own with the same helm push. Only the pushes
// to ghcr.io (and docker buildx itself) stay untested, as the workflow marks them.
package release_test

import (
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	yaml3 "go.yaml.in/yaml/v3"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/internal/buildinfo"
	"github.com/sluice-dev/sluice/internal/test/image"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// workflow is the part of the release workflow the test reads. It is read as YAML 1.2, as GitHub
// reads it: in YAML 1.1, which sigs.k8s.io/yaml speaks, "on" is true.
type workflow struct {
	On struct {
		Push struct {
			Tags []string `yaml:"tags"`
		} `yaml:"push"`
	} `yaml:"on"`
	Jobs map[string]struct {
		Steps []struct {
			Name string `yaml:"name"`
			Uses string `yaml:"uses"`
			Run  string `yaml:"run"`
		} `yaml:"steps"`
	} `yaml:"jobs"`
}

const workflowFile = ".github/workflows/release.yaml"

// TestReleaseWorkflowWhenATagIsPushedThenItBuildsWhatTheChartInstalls runs the workflow's steps
// that need neither Docker nor ghcr.io.
func TestReleaseWorkflowWhenATagIsPushedThenItBuildsWhatTheChartInstalls(t *testing.T) {
	tier.Needs(t, "helm and builds of both binaries for every platform")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	root := testenv.RepoRoot()
	wf, raw := readWorkflow(t)
	if !slices.Contains(wf.On.Push.Tags, "v*") {
		t.Fatalf("%s runs on tags %q, want v*", workflowFile, wf.On.Push.Tags)
	}
	runs := steps(wf)
	tag := buildinfo.Release

	// The tag check: the chart's appVersion passes, another tag fails.
	check := find(t, runs, "make release-check")
	if out, err := shell(ctx, root, check, "GITHUB_REF_NAME="+tag); err != nil {
		t.Fatalf("%s with tag %s: %v\n%s", check, tag, err, out)
	}
	if out, err := shell(ctx, root, check, "GITHUB_REF_NAME=v0.0.0-not-the-chart"); err == nil {
		t.Errorf("%s with another tag than the chart's appVersion passed: %s", check, out)
	}

	// The images, for every platform docker buildx builds: the Dockerfile's build stage run for
	// each, assembled into one index per image.
	buildx := find(t, runs, "make docker-buildx")
	platforms := regexp.MustCompile(`PLATFORMS=(\S+)`).FindStringSubmatch(buildx)
	if platforms == nil || !strings.Contains(platforms[1], "linux/amd64") || !strings.Contains(platforms[1], "linux/arm64") {
		t.Fatalf("%s: want PLATFORMS with linux/amd64 and linux/arm64", buildx)
	}
	reg := httptest.NewServer(registry.New())
	defer reg.Close()
	host := strings.TrimPrefix(reg.URL, "http://")
	indexes := map[string]v1.ImageIndex{"manager": empty.Index, "enforcer": empty.Index}
	for _, platform := range strings.Split(platforms[1], ",") {
		goos, arch, _ := strings.Cut(platform, "/")
		images, err := image.Build(ctx, image.Options{
			Dockerfile: filepath.Join(root, "Dockerfile"), Dir: t.TempDir(),
			Args: map[string]string{"TARGETOS": goos, "TARGETARCH": arch, "VERSION": tag, "COMMIT": "release-test"},
		}, host, tag)
		if err != nil {
			t.Fatalf("%s: %v", platform, err)
		}
		for _, img := range images {
			checkMachine(t, img, arch)
			indexes[img.Target] = mutate.AppendManifests(indexes[img.Target], mutate.IndexAddendum{
				Add: img.Image, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: goos, Architecture: arch}},
			})
		}
	}
	for target, idx := range indexes {
		ref, err := name.NewTag(fmt.Sprintf("%s/sluice-%s:%s", host, target, tag))
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.WriteIndex(ref, idx); err != nil {
			t.Fatalf("push %s: %v", ref, err)
		}
		pulled, err := remote.Index(ref)
		if err != nil {
			t.Fatal(err)
		}
		manifest, err := pulled.IndexManifest()
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, m := range manifest.Manifests {
			got = append(got, m.Platform.OS+"/"+m.Platform.Architecture)
		}
		slices.Sort(got)
		if want := strings.Split(platforms[1], ","); !slices.Equal(got, sorted(want)) {
			t.Errorf("%s holds %q, want %q", ref, got, want)
		}
	}

	// The chart: packaged by the workflow's make target, pushed with its helm push to the test's
	// registry, and what it installs is the images just pushed.
	pkg := find(t, runs, "make chart-package")
	dist := t.TempDir()
	if out, err := shell(ctx, root, pkg+" DIST="+dist); err != nil {
		t.Fatalf("%s: %v\n%s", pkg, err, out)
	}
	charts, _ := filepath.Glob(filepath.Join(dist, "sluice-*.tgz"))
	if len(charts) != 1 {
		t.Fatalf("%s made %q, want one chart", pkg, charts)
	}
	push := find(t, runs, "helm\" push")
	if !strings.Contains(raw, "Push the chart # untested") || !strings.Contains(push, "oci://") {
		t.Fatalf("the chart's push step %q: want helm push to an oci:// registry, marked untested", push)
	}
	helm, err := local.Tool("helm")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.CommandContext(ctx, helm, "push", charts[0], "oci://"+host+"/charts", "--plain-http").CombinedOutput(); err != nil {
		t.Fatalf("helm push: %v\n%s", err, out)
	}
	shown, err := exec.CommandContext(ctx, helm, "show", "chart", "oci://"+host+"/charts/sluice", "--plain-http").Output()
	if err != nil {
		t.Fatalf("helm show chart: %v", err)
	}
	var chart struct{ AppVersion string }
	if err := yaml.Unmarshal(shown, &chart); err != nil || chart.AppVersion != tag {
		t.Fatalf("the pushed chart's appVersion %q (%v), want the tag %s", chart.AppVersion, err, tag)
	}
	rendered, err := exec.CommandContext(ctx, helm, "template", "sluice", "oci://"+host+"/charts/sluice", "--plain-http",
		"--set", "manager.image.repository="+host+"/sluice-manager", "--set", "enforcer.image.repository="+host+"/sluice-enforcer").Output()
	if err != nil {
		t.Fatalf("helm template of the pushed chart: %v", err)
	}
	for _, want := range []string{host + "/sluice-manager:" + tag, host + "/sluice-enforcer:" + tag} {
		if !strings.Contains(string(rendered), want) {
			t.Errorf("the pushed chart does not install %s, the image the workflow pushed", want)
		}
		ref, err := name.ParseReference(want)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := remote.Index(ref); err != nil {
			t.Errorf("the chart's image %s: %v", want, err)
		}
	}
}

// TestReleaseWhenTheChartInstallYAMLAndManagerNameAReleaseThenItIsTheSame holds the release's
// name together: the chart's appVersion, the images dist/install.yaml installs, and the
// manager's default enforcer image.
func TestReleaseWhenTheChartInstallYAMLAndManagerNameAReleaseThenItIsTheSame(t *testing.T) {
	root := testenv.RepoRoot()
	data, err := os.ReadFile(filepath.Join(root, "charts", "sluice", "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var chart struct{ AppVersion string }
	if err := yaml.Unmarshal(data, &chart); err != nil {
		t.Fatal(err)
	}
	if chart.AppVersion != buildinfo.Release {
		t.Errorf("Chart.yaml's appVersion %q, buildinfo.Release %q: one release, one name", chart.AppVersion, buildinfo.Release)
	}
	install, err := os.ReadFile(filepath.Join(root, "dist", "install.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"image: ghcr.io/sluice-dev/sluice-manager:" + buildinfo.Release, "--enforcer-image=ghcr.io/sluice-dev/sluice-enforcer:" + buildinfo.Release} {
		if !strings.Contains(string(install), want) {
			t.Errorf("dist/install.yaml lacks %q", want)
		}
	}
	if n := strings.Count(string(install), ":latest"); n > 0 {
		t.Errorf("dist/install.yaml names %d images :latest", n)
	}
}

func readWorkflow(t *testing.T) (*workflow, string) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), workflowFile))
	if err != nil {
		t.Fatal(err)
	}
	var wf workflow
	if err := yaml3.Unmarshal(data, &wf); err != nil {
		t.Fatalf("%s: %v", workflowFile, err)
	}
	return &wf, string(data)
}

// steps are the run lines of every job's steps.
func steps(wf *workflow) []string {
	var runs []string
	for _, job := range wf.Jobs {
		for _, s := range job.Steps {
			for _, line := range strings.Split(s.Run, "\n") {
				if line = strings.TrimSpace(line); line != "" {
					runs = append(runs, line)
				}
			}
		}
	}
	return runs
}

// find is the workflow's run line that contains what.
func find(t *testing.T, runs []string, what string) string {
	t.Helper()
	for _, r := range runs {
		if strings.Contains(r, what) {
			return r
		}
	}
	t.Fatalf("%s runs no %q", workflowFile, what)
	return ""
}

// shell runs a workflow line with bash in dir, with env, as the runner does.
func shell(ctx context.Context, dir, line string, env ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "bash", "-ec", line)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	return cmd.CombinedOutput()
}

// checkMachine checks that the image's binary was built for arch.
func checkMachine(t *testing.T, img image.Image, arch string) {
	t.Helper()
	want := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[arch]
	data, err := image.ReadFile(img.Image, img.Target)
	if err != nil {
		t.Fatal(err)
	}
	f, err := elf.NewFile(bytes.NewReader(data))
	if err != nil {
		t.Fatalf("%s for %s: %v", img.Target, arch, err)
	}
	if f.Machine != want {
		t.Errorf("%s for %s is built for %v", img.Target, arch, f.Machine)
	}
}

func sorted(s []string) []string { s = slices.Clone(s); slices.Sort(s); return s }
