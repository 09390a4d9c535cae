package policy

import (
	"slices"
	"strings"

	"github.com/sluice-dev/sluice/api/v1alpha1"
)

// Header reads a request's header fields. http.Header is one; the check API adapts its server's.
type Header interface {
	// Values returns every value of a field, in the order received; the name is
	// case-insensitive.
	Values(name string) []string
}

// Matches reports whether the rule applies to a request.
func (m *Match) Matches(method, path string, header Header) bool {
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
