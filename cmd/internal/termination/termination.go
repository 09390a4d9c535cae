// Package termination tells Kubernetes why a binary exits: the kubelet reads the container's
// termination message file (/dev/termination-log, its terminationMessagePath by default) into the
// pod's status, where `kubectl describe` and Sluice's own status show it beside the exit code.
package termination

import (
	"errors"
	"io/fs"
	"os"
	"strings"
)

// Path is the termination message file the kubelet mounts by default.
const Path = "/dev/termination-log"

// maxBytes is what the kubelet keeps of a termination message.
const maxBytes = 4096

// Write writes msg, cut to what the kubelet keeps, to the file at path when it exists: outside a
// container there is none, and nothing is written or created.
func Write(path, msg string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if len(msg) > maxBytes {
		msg = strings.ToValidUTF8(msg[:maxBytes], "") // cut between two characters
	}
	_, err = f.WriteString(msg)
	return errors.Join(err, f.Close())
}
