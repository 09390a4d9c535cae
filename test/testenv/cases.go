package testenv

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
)

// ReadObjects decodes every YAML document of a file.
func ReadObjects(t testing.TB, path string) []*unstructured.Unstructured {
	t.Helper()
	objs, err := DecodeFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// DecodeFile decodes every YAML document of a file.
func DecodeFile(path string) ([]*unstructured.Unstructured, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	var objs []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bufio.NewReader(f), 4096)
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return objs, nil
			}
			return nil, fmt.Errorf("decode %s: %w", path, err)
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
}

// InvalidCase is a file of invalid policies: one policy and the field and message it must be
// rejected with, from its "# field:" and "# message:" header lines.
type InvalidCase struct {
	File, Field, Message string
}

// ReadInvalidCases reads every *.yaml of dir.
func ReadInvalidCases(t testing.TB, dir string) []InvalidCase {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	var cases []InvalidCase
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		c := InvalidCase{File: file}
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "# field: "); ok {
				c.Field = v
			}
			if v, ok := strings.CutPrefix(line, "# message: "); ok {
				c.Message = v
			}
		}
		if c.Field == "" || c.Message == "" {
			t.Fatalf("%s lacks its '# field:' or '# message:' line", file)
		}
		cases = append(cases, c)
	}
	return cases
}

// RequireInvalid fails the test unless err is an Invalid error with a cause at field whose
// message contains message.
func RequireInvalid(t testing.TB, err error, field, message string) {
	t.Helper()
	if !apierrors.IsInvalid(err) {
		t.Fatalf("got %v, want an Invalid error", err)
	}
	var status apierrors.APIStatus
	if !errors.As(err, &status) || status.Status().Details == nil {
		t.Fatalf("error %v has no details", err)
	}
	for _, cause := range status.Status().Details.Causes {
		if cause.Field == field && strings.Contains(cause.Message, message) {
			return
		}
	}
	t.Errorf("no cause at %s containing %q; got:\n%v", field, message, err)
}
