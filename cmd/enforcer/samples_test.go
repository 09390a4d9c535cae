package main

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// Every sample users are pointed to runs in the standalone enforcer as it is: the binary serves
// each of its policies' rules, skips the documents of other kinds (a Service, a Deployment) and
// ignores spec.storage, and says both in its log instead of refusing the file.
func TestEnforcerBinaryWhenGivenEachSampleThenItServesEveryRuleAndSaysWhatItSkipped(t *testing.T) {
	for _, file := range testenv.Samples(t) {
		t.Run(filepath.Base(file), func(t *testing.T) {
			var want []string
			others, storages := 0, 0
			for _, o := range testenv.ReadObjects(t, file) {
				if o.GetKind() != "RateLimitPolicy" {
					others++
					continue
				}
				ns := o.GetNamespace()
				if ns == "" {
					ns = "default"
				}
				rules, _, _ := unstructured.NestedSlice(o.Object, "spec", "rules")
				for _, r := range rules {
					want = append(want, ns+"/"+o.GetName()+" "+r.(map[string]any)["name"].(string))
				}
				if _, ok, _ := unstructured.NestedMap(o.Object, "spec", "storage"); ok {
					storages++
				}
			}
			_, admin, log := runBinaryLogged(t, "--policy="+file)
			var got []string
			for _, r := range readReport(t, admin).Rules {
				got = append(got, r.Policy+" "+r.Name)
			}
			slices.Sort(want)
			slices.Sort(got)
			if len(want) == 0 || !slices.Equal(want, got) {
				t.Errorf("rules served %q, want %q", got, want)
			}
			out := log.String()
			if n := strings.Count(out, "not a RateLimitPolicy"); n != others {
				t.Errorf("%d documents of other kinds said to be skipped, want %d:\n%s", n, others, out)
			}
			if n := strings.Count(out, "spec.storage ignored"); n != storages {
				t.Errorf("%d spec.storage said to be ignored, want %d:\n%s", n, storages, out)
			}
		})
	}
}
