package rls

import (
	"net/http"
	"slices"
	"strings"
	"testing"

	"golang.org/x/net/http/httpguts"
)

// entryHeaderAgrees checks that a descriptor's entries, read through entryHeader, give every
// valid field name the values http.Header gives it, which is how the other front ends read a
// request's fields.
func entryHeaderAgrees(t *testing.T, entries [][2]string, lookups ...string) {
	t.Helper()
	var h entryHeader
	want := http.Header{}
	for _, e := range entries {
		h.add(e[0], e[1])
		want.Add(e[0], e[1])
	}
	for _, name := range lookups {
		if !httpguts.ValidHeaderFieldName(name) {
			continue // rules and policies name valid fields only (the schema)
		}
		got := h.Values(name)
		if !slices.Equal(got, want.Values(name)) {
			t.Fatalf("entries %q: Values(%q) = %q, http.Header says %q", entries, name, got, want.Values(name))
		}
		if len(got) > 0 {
			_ = append(got, "appended") // must not reach the header's own array
			if again := h.Values(name); !slices.Equal(again, want.Values(name)) {
				t.Fatalf("entries %q: an append to Values(%q) changed it to %q", entries, name, again)
			}
		}
	}
}

func TestRLSEntriesWhenReadAsHeaderFieldsThenTheyReadAsHTTPHeaderDoes(t *testing.T) {
	for _, entries := range [][][2]string{
		{{"x-client", "a"}},
		{{"X-CLIENT", "a"}, {"x-client", "b"}},                    // one field in a row, any case
		{{"x-client", "a"}, {"x-tenant", "t"}, {"X-Client", "b"}}, // repeated apart
		{{"x-\u212aey", "kelvin"}, {"x-key", "k"}},                // the Kelvin sign folds into k only in Unicode
		{{"x_client", "underscore"}},
		{},
	} {
		entryHeaderAgrees(t, entries, "X-Client", "x-client", "X-Tenant", "X-Key", "x-\u212aey", "X_Client", "Missing")
	}
}

// FuzzRLSEntryHeader fuzzes entryHeader against http.Header: entries is a comma-separated list of
// name=value pairs, at most MaxEntries of them, as ShouldRateLimit bounds a descriptor.
func FuzzRLSEntryHeader(f *testing.F) {
	f.Add("x-client=a,X-CLIENT=b", "X-Client")
	f.Add("x-client=a,x-tenant=t,X-Client=b", "x-client")
	f.Add("x-\u212aey=k,x-key=j", "X-Key")
	f.Fuzz(func(t *testing.T, entries, lookup string) {
		var pairs [][2]string
		for _, e := range strings.Split(entries, ",") {
			name, value, _ := strings.Cut(e, "=")
			pairs = append(pairs, [2]string{name, value})
		}
		if len(pairs) > MaxEntries {
			return
		}
		lookups := []string{lookup}
		for _, p := range pairs {
			lookups = append(lookups, p[0], strings.ToUpper(p[0]), strings.ToLower(p[0]))
		}
		entryHeaderAgrees(t, pairs, lookups...)
	})
}
