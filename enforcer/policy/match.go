package policy

import (
	"net/http"
	"slices"
	"strings"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// Matches reports whether the rule applies to a request.
func (m *Match) Matches(method, path string, header http.Header) bool {
	if len(m.Methods) > 0 && !slices.Contains(m.Methods, method) {
		return false
	}
	switch m.Path {
	case v1alpha1.PathMatchExact:
		if path != m.Value {
			return false
		}
	case v1alpha1.PathMatchPrefix:
		// Whole segments: /api matches /api and /api/users, not /apis.
		prefix := strings.TrimSuffix(m.Value, "/")
		if path != prefix && !strings.HasPrefix(path, prefix+"/") {
			return false
		}
	case v1alpha1.PathMatchRegularExpression:
		if !m.Regexp.MatchString(path) {
			return false
		}
	}
	for _, h := range m.Headers {
		values := header.Values(h.Name)
		if len(values) == 0 || h.Value != nil && !slices.Contains(values, *h.Value) {
			return false
		}
	}
	return true
}
