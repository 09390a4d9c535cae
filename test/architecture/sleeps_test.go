package architecture

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// Tests wait on events, not on clocks: a time.Sleep in a test lets real time pass on purpose (a
// real timeout, a pace of traffic or polls, a slow upstream) and says so in a comment on its line
// or on the line above. A sleep with none is taken for one that orders events. The tests are the
// files git tracks: an untracked tree in the checkout is nobody's test.
func TestTestsWhenTheySleepThenTheSleepSaysWhy(t *testing.T) {
	root := testenv.RepoRoot()
	files, err := trackedTests(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("git tracks no test file")
	}
	for _, rel := range files {
		src, err := os.ReadFile(filepath.Join(root, rel))
		if errors.Is(err, fs.ErrNotExist) {
			continue // deleted in the work tree, not yet in the index
		}
		if err != nil {
			t.Fatal(err)
		}
		lines, err := unexplainedSleeps(rel, src)
		if err != nil {
			t.Error(err)
			continue
		}
		for _, line := range lines {
			t.Errorf("%s:%d: a time.Sleep without a comment on its line or the line above saying what real time it lets pass", rel, line)
		}
	}
}

// trackedTests lists the Go test files that git tracks under root, relative to it.
func trackedTests(root string) ([]string, error) {
	cmd := exec.Command("git", "ls-files", "-z", "--", "*_test.go")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("git ls-files in %s: %w", root, err)
	}
	var files []string
	for f := range strings.SplitSeq(string(out), "\x00") {
		if f != "" && !slices.Contains(strings.Split(filepath.ToSlash(f), "/"), "testdata") {
			files = append(files, f)
		}
	}
	return files, nil
}

// unexplainedSleeps returns the lines of src where time.Sleep is named (called or passed on)
// with no comment on that line or the line above. Comments are the parser's: a "//" inside a
// string is none, and a sleep in a comment is no sleep.
func unexplainedSleeps(name string, src []byte) ([]int, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, name, src, parser.ParseComments|parser.SkipObjectResolution)
	if err != nil {
		return nil, err
	}
	timePkg := ""
	for _, imp := range f.Imports {
		if path, _ := strconv.Unquote(imp.Path.Value); path == "time" {
			timePkg = "time"
			if imp.Name != nil {
				timePkg = imp.Name.Name
			}
		}
	}
	if timePkg == "" || timePkg == "_" || timePkg == "." {
		return nil, nil
	}
	commented := map[int]bool{}
	for _, g := range f.Comments {
		for _, c := range g.List {
			for l := fset.Position(c.Pos()).Line; l <= fset.Position(c.End()).Line; l++ {
				commented[l] = true
			}
		}
	}
	var lines []int
	ast.Inspect(f, func(n ast.Node) bool {
		sel, ok := n.(*ast.SelectorExpr)
		if !ok || sel.Sel.Name != "Sleep" {
			return true
		}
		if pkg, ok := sel.X.(*ast.Ident); ok && pkg.Name == timePkg {
			if l := fset.Position(sel.Pos()).Line; !commented[l] && !commented[l-1] {
				lines = append(lines, l)
			}
		}
		return true
	})
	return lines, nil
}

func TestUnexplainedSleepsWhenASourceIsReadThenOnlySleepsWithoutACommentNearAreFound(t *testing.T) {
	for _, c := range []struct {
		name string
		body string
		want []int // lines of the body, the first being 1
	}{
		{"when the sleep's line has a comment then it is explained", "time.Sleep(d) // a pace", nil},
		{"when the line above has a comment then it is explained", "// a pace\ntime.Sleep(d)", nil},
		{"when a block comment ends on the line above then it is explained", "/* a real\ntimeout */\ntime.Sleep(d)", nil},
		{"when a block comment precedes it on its line then it is explained", "/* a pace */ time.Sleep(d)", nil},
		{"when the comment is two lines above then it is not", "// a pace\nx := 1\ntime.Sleep(d); _ = x", []int{3}},
		{"when the comment is on the line below then it is not", "time.Sleep(d)\n// a pace", []int{1}},
		{"when the only // is in a string then it is not", `time.Sleep(d); _ = "http://x"`, []int{1}},
		{"when the only // is in a raw string then it is not", "time.Sleep(d); _ = `//`", []int{1}},
		{"when the sleep is in a comment then it is no sleep", "// time.Sleep(d)", nil},
		{"when the sleep is in a string then it is no sleep", `_ = "time.Sleep(d)"`, nil},
		{"when time.Sleep is passed on then it needs a comment too", "f := time.Sleep; f(d)", []int{1}},
		{"when another package's Sleep is called then it is no sleep", "clk.Sleep(d)", nil},
		{"when two sleeps follow one comment then the second, two lines below it, is found", "// a pace\ntime.Sleep(d)\ntime.Sleep(d)", []int{3}},
	} {
		t.Run(c.name, func(t *testing.T) {
			// The body starts on line 8 of the file: the line numbers are the body's plus 7.
			src := "package p\n\nimport \"time\"\n\nvar d time.Duration\n\nfunc f(clk interface{ Sleep(time.Duration) }) {\n" + c.body + "\n}\n"
			got, err := unexplainedSleeps("p_test.go", []byte(src))
			if err != nil {
				t.Fatal(err)
			}
			var want []int
			for _, l := range c.want {
				want = append(want, l+7)
			}
			if !slices.Equal(got, want) {
				t.Errorf("lines %v, want %v in:\n%s", got, want, src)
			}
		})
	}

	t.Run("when time is imported under another name then its Sleep is found", func(t *testing.T) {
		src := "package p\n\nimport clock \"time\"\n\nfunc f() {\n\tclock.Sleep(1)\n}\n"
		if got, err := unexplainedSleeps("p_test.go", []byte(src)); err != nil || !slices.Equal(got, []int{6}) {
			t.Errorf("lines %v, %v; want [6]", got, err)
		}
	})
	t.Run("when time is not imported then a time.Sleep is another name's", func(t *testing.T) {
		src := "package p\n\nfunc f(time interface{ Sleep(int) }) {\n\ttime.Sleep(1)\n}\n"
		if got, err := unexplainedSleeps("p_test.go", []byte(src)); err != nil || got != nil {
			t.Errorf("lines %v, %v; want none", got, err)
		}
	})
	t.Run("when the source does not parse then it says so", func(t *testing.T) {
		if _, err := unexplainedSleeps("p_test.go", []byte("package p\nfunc {")); err == nil {
			t.Error("no error")
		}
	})
}

// Only what git tracks is a test: an untracked tree beside it (a scratch module, another
// checkout) is not read.
func TestTrackedTestsWhenAGoTreeIsUntrackedThenItIsNotListed(t *testing.T) {
	dir := t.TempDir()
	git := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	git("init", "--quiet")
	for _, f := range []string{"a/a_test.go", "a/a.go", "a/testdata/b_test.go", "scratch/c_test.go"} {
		if err := os.MkdirAll(filepath.Join(dir, filepath.Dir(f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), []byte("package x\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	git("add", "a")
	got, err := trackedTests(dir)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"a/a_test.go"}; !slices.Equal(got, want) {
		t.Errorf("listed %v, want %v: tracked test files outside testdata", got, want)
	}
}
