package termination_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sluice-dev/sluice/cmd/internal/termination"
)

func TestWrite(t *testing.T) {
	dir := t.TempDir()
	existing := filepath.Join(dir, "termination-log")
	if err := os.WriteFile(existing, []byte("an older, longer message"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, path, msg, want string
	}{
		{"when the file exists then it holds the message alone", existing, "--redis-ca-file: no PEM certificate found", "--redis-ca-file: no PEM certificate found"},
		{"when the message is as long as the kubelet keeps then it is whole", existing, strings.Repeat("x", 4096), strings.Repeat("x", 4096)},
		{"when the message is one byte longer than the kubelet keeps then it is cut", existing, strings.Repeat("x", 4097), strings.Repeat("x", 4096)},
		{"when the cut falls inside a character then the character is left out", existing, "x" + strings.Repeat("é", 3000), "x" + strings.Repeat("é", 2047)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := termination.Write(c.path, c.msg); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(c.path)
			if string(got) != c.want {
				t.Errorf("file holds %d bytes %.60q, want %d bytes %.60q", len(got), got, len(c.want), c.want)
			}
		})
	}
	t.Run("when there is no file then none is made", func(t *testing.T) {
		absent := filepath.Join(dir, "absent")
		if err := termination.Write(absent, "message"); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(absent); !os.IsNotExist(err) {
			t.Errorf("Write made %s: %v", absent, err)
		}
	})
}
