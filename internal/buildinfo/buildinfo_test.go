package buildinfo

import (
	"runtime/debug"
	"testing"
)

func TestReadWhenTheBuildRecordsWhatItCanThenEachFieldComesFromTheBestSource(t *testing.T) {
	stamped := &debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Version: "v0.0.0-20261204040000-abcdef123456"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abcdef1234567890"}, {Key: "vcs.modified", Value: "false"}}}
	dirty := &debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Version: "(devel)"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abcdef1234567890"}, {Key: "vcs.modified", Value: "true"}}}
	cases := []struct {
		name            string
		bi              *debug.BuildInfo
		version, commit string
		want            Info
	}{
		{"when Go recorded the VCS state then version and commit are Go's", stamped, "", "",
			Info{"v0.0.0-20261204040000-abcdef123456", "abcdef1234567890", "go1.26.0"}},
		{"when the tree was modified then the commit says dirty", dirty, "", "",
			Info{"(devel)", "abcdef1234567890-dirty", "go1.26.0"}},
		{"when the linker set them then the linker's win", stamped, "v0.3.0", "0123abc",
			Info{"v0.3.0", "0123abc", "go1.26.0"}},
		{"when nothing was recorded then unknown", &debug.BuildInfo{GoVersion: "go1.26.0"}, "", "",
			Info{Unknown, Unknown, "go1.26.0"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := read(c.bi, true, c.version, c.commit); got != c.want {
				t.Errorf("read = %+v, want %+v", got, c.want)
			}
		})
	}
}
