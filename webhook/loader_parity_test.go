package webhook_test

import (
	"context"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// A standalone enforcer's policy file never passes through the API server. Its loader refuses a
// policy exactly when the real API server, with the admission webhook served, refuses to create
// it: for every policy of both invalid corpora, every sample, and every sample with one field
// mutated across its bounds (numbers below, at and above them; durations in every unit; names
// and addresses that are not names or addresses; strings over their length; empty and repeated
// lists; each field removed).
func TestLoaderWhenAPolicyIsJudgedThenItAgreesWithTheAPIServer(t *testing.T) {
	ns := testenv.Namespace(t, k8s, "parity")
	root := testenv.RepoRoot()
	var docs []judged
	for _, dir := range []string{filepath.Join(root, "test", "testdata", "invalid"), filepath.Join(root, "webhook", "testdata", "invalid")} {
		for _, c := range testenv.ReadInvalidCases(t, dir) {
			for _, u := range testenv.ReadObjects(t, c.File) {
				docs = append(docs, judged{filepath.Base(c.File), u.Object})
			}
		}
	}
	for _, file := range testenv.Samples(t) {
		for _, u := range testenv.ReadObjects(t, file) {
			if u.GroupVersionKind() != testenv.GVK {
				continue
			}
			docs = append(docs, judged{filepath.Base(file), u.Object})
			for _, m := range mutations(u.Object) {
				docs = append(docs, judged{filepath.Base(file) + " " + m.name, m.obj})
			}
		}
	}
	if len(docs) < 500 {
		t.Fatalf("only %d policies to judge", len(docs))
	}

	ctx := context.Background()
	refused := 0
	for _, d := range docs {
		u := &unstructured.Unstructured{Object: runtime.DeepCopyJSON(d.obj)}
		u.SetNamespace(ns)
		if u.GetKind() != testenv.GVK.Kind {
			continue
		}
		apiErr := createDryRun(ctx, u)
		raw, err := yaml.Marshal(u.Object)
		if err != nil {
			t.Fatal(err)
		}
		_, loadErr := enforcer.Validate(raw)
		if (apiErr == nil) != (loadErr == nil) {
			t.Errorf("%s: the API server says %v; the loader says %v", d.name, verdict(apiErr), verdict(loadErr))
		}
		if apiErr != nil {
			refused++
		}
	}
	t.Logf("%d policies judged alike, %d of them refused", len(docs), refused)
}

type judged struct {
	name string
	obj  map[string]any
}

func verdict(err error) string {
	if err == nil {
		return "accepted"
	}
	return "refused: " + err.Error()
}

// createDryRun creates u without storing it, with kubectl's strict field validation, retrying
// while the API server is briefly unavailable.
func createDryRun(ctx context.Context, u *unstructured.Unstructured) error {
	var err error
	_ = poll.Until(30*time.Second, func() error {
		err = k8s.Create(ctx, u.DeepCopy(), client.DryRunAll, client.FieldValidation("Strict"))
		if err != nil && strings.Contains(err.Error(), "connection refused") {
			return err // again
		}
		return nil // a verdict
	})
	return err
}

type mutation struct {
	name string
	obj  map[string]any
}

// Values each kind of field is mutated to.
var (
	intValues      = []int64{-1, 0, 1, 101, 10_001, 1_000_001, 1_000_000_001, 2_147_483_648}
	durationValues = []string{"0s", "1ms", "1.5s", "1000us", "100000ms", "100000s", "720h", "721h", "1h1ms", "5s"}
	stringValues   = []string{"", "Bad_Name", "shop.v2", "red_is:6379", "[fd00::1]:6379", "/", strings.Repeat("x", 64), strings.Repeat("y", 1025), strings.Repeat("z", 4097)}
)

// mutations returns obj with one field changed, for every field and every value of its kind.
func mutations(obj map[string]any) []mutation {
	var out []mutation
	var walk func(path []any, v any)
	walk = func(path []any, v any) {
		name := fmt.Sprint(path...)
		set := func(label string, nv any) {
			c := runtime.DeepCopyJSON(obj)
			setAt(c, path, nv)
			out = append(out, mutation{name + "=" + label, c})
		}
		switch v := v.(type) {
		case map[string]any:
			for _, k := range slices.Sorted(maps.Keys(v)) {
				p := append(slices.Clone(path), k)
				if name := fmt.Sprint(p...); name == "apiVersion" || name == "kind" || name == "metadata namespace" {
					continue // another resource, or the namespace the test chooses
				}
				c := runtime.DeepCopyJSON(obj)
				deleteAt(c, p)
				out = append(out, mutation{fmt.Sprint(p...) + " removed", c})
				walk(p, v[k])
			}
		case []any:
			set("[]", []any{})
			if len(v) > 0 {
				set("its first item twice", append([]any{runtime.DeepCopyJSONValue(v[0])}, v...))
			}
			for i, item := range v {
				walk(append(slices.Clone(path), i), item)
			}
		case int64:
			for _, n := range intValues {
				set(fmt.Sprint(n), n)
			}
		case string:
			values := stringValues
			if _, err := time.ParseDuration(v); err == nil {
				values = durationValues
			}
			for _, s := range values {
				set(fmt.Sprintf("%.12q", s), s)
			}
		case bool:
			set(fmt.Sprint(!v), !v)
		}
	}
	walk(nil, obj)
	return out
}

func setAt(obj map[string]any, path []any, v any) {
	parent, last := walkTo(obj, path)
	switch p := parent.(type) {
	case map[string]any:
		p[last.(string)] = v
	case []any:
		p[last.(int)] = v
	}
}

func deleteAt(obj map[string]any, path []any) {
	if parent, last := walkTo(obj, path); parent != nil {
		delete(parent.(map[string]any), last.(string))
	}
}

func walkTo(obj map[string]any, path []any) (parent any, last any) {
	var cur any = obj
	for _, p := range path[:len(path)-1] {
		switch c := cur.(type) {
		case map[string]any:
			cur = c[p.(string)]
		case []any:
			cur = c[p.(int)]
		}
	}
	return cur, path[len(path)-1]
}
