package architecture

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// Tests wait on events, not on clocks: a time.Sleep in a test lets real time pass on purpose (a
// real timeout, a pace of traffic or polls, a slow upstream) and says so in a comment on its line
// or on one of the two lines before it. A sleep with none is taken for one that orders events.
func TestTestsWhenTheySleepThenTheSleepSaysWhy(t *testing.T) {
	root := testenv.RepoRoot()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata" || d.Name() == "bin") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		lines := strings.Split(string(data), "\n")
		for i, line := range lines {
			if !strings.Contains(line, "time.Sleep(") || strings.HasPrefix(strings.TrimSpace(line), "//") {
				continue
			}
			said := false
			for _, l := range lines[max(0, i-2) : i+1] {
				said = said || strings.Contains(l, "//")
			}
			if !said {
				rel, _ := filepath.Rel(root, path)
				t.Errorf("%s:%d: a time.Sleep without a comment saying what real time it lets pass: %s", rel, i+1, strings.TrimSpace(line))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
