// Package buildinfo tells which build of Sluice runs, for the --version flag and the
// sluice_build_info metric of both binaries: its version, its commit and the Go version that
// built it.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// version and commit are set by the linker where the build records no VCS information, as in the
// images' builds, which have no .git: -ldflags "-X github.com/sluice-dev/sluice/internal/buildinfo.version=v0.3.0".
// Left empty, they come from what Go records in the binary (runtime/debug.ReadBuildInfo).
var version, commit string

// Release is the release this source is: the chart's appVersion, the tag of the images that
// dist/install.yaml and the chart install, and so the tag of the enforcer image the manager runs
// by default. A test holds the three together.
const Release = "v0.1.0"

// Unknown is the version or commit of a build that records neither.
const Unknown = "unknown"

// Info is a build's identity.
type Info struct {
	// Version is the module version: a release tag, Go's pseudo-version of the commit, or
	// "(devel)".
	Version string
	// Commit is the VCS revision, with "-dirty" when the tree had uncommitted changes.
	Commit string
	// GoVersion is the Go release that built the binary.
	GoVersion string
}

// Read returns the running binary's Info.
func Read() Info {
	bi, ok := debug.ReadBuildInfo()
	return read(bi, ok, version, commit)
}

func read(bi *debug.BuildInfo, ok bool, version, commit string) Info {
	i := Info{Version: version, Commit: commit, GoVersion: runtime.Version()}
	if ok {
		i.GoVersion = bi.GoVersion
		if i.Version == "" {
			i.Version = bi.Main.Version
		}
		if i.Commit == "" {
			var rev, modified string
			for _, s := range bi.Settings {
				switch s.Key {
				case "vcs.revision":
					rev = s.Value
				case "vcs.modified":
					modified = s.Value
				}
			}
			if rev != "" && modified == "true" {
				rev += "-dirty"
			}
			i.Commit = rev
		}
	}
	if i.Version == "" {
		i.Version = Unknown
	}
	if i.Commit == "" {
		i.Commit = Unknown
	}
	return i
}

// String is the line --version prints after the binary's name.
func (i Info) String() string {
	return fmt.Sprintf("version %s, commit %s, %s", i.Version, i.Commit, i.GoVersion)
}

// Collector is the gauge sluice_build_info, 1, with the build's version, commit and Go version
// as labels: joined on pod or instance, it tells which build each replica runs.
func (i Info) Collector() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "sluice_build_info",
		Help:        "1, with the version, commit and Go version of the running build as labels.",
		ConstLabels: prometheus.Labels{"version": i.Version, "commit": i.Commit, "go_version": i.GoVersion},
	})
	g.Set(1)
	return g
}
