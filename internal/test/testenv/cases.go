package testenv

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/internal/test/tier"
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

// Samples returns the files of config/samples; a test of them fails if there are fewer than six.
func Samples(t testing.TB) []string {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(RepoRoot(), "config", "samples", "*.yaml"))
	if len(files) < 6 {
		t.Fatalf("found %d samples, want at least 6", len(files))
	}
	return files
}

// Namespace creates a namespace named after prefix, for one test.
func Namespace(t testing.TB, c client.Client, prefix string) string {
	t.Helper()
	tier.Needs(t, "the test control plane")
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}
	if err := c.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

// RuleOf returns rule i of an unstructured policy's spec, as written.
func RuleOf(t testing.TB, u *unstructured.Unstructured, i int) map[string]any {
	t.Helper()
	rules, _, err := unstructured.NestedSlice(u.Object, "spec", "rules")
	if err != nil || i >= len(rules) {
		t.Fatalf("rule %d of %s: %v", i, u.GetName(), err)
	}
	return rules[i].(map[string]any)
}
