package policy_test

import (
	"testing"

	"github.com/dunglas/httpsfv"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/policy"
)

// The fields built once per rule parse as structured-field lists with the rule's quota and the
// window it refers to: a window, or the time an empty bucket takes to fill, rounded up.
func TestFieldsWhenRuleIsCompiledThenTheyParseAsStructuredFields(t *testing.T) {
	c, err := policy.Compile(newPolicy(
		v1alpha1.Rule{Name: "burst", TokenBucket: &v1alpha1.TokenBucket{Capacity: 10, Refill: v1alpha1.TokenRefill{Tokens: 3, Period: "1s"}}},
		v1alpha1.Rule{Name: "hourly", FixedWindow: &v1alpha1.Window{Limit: 1000, Window: "1h"}},
		v1alpha1.Rule{Name: "fast", SlidingLog: &v1alpha1.Window{Limit: 5, Window: "250ms"}},
	))
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []struct {
		name string
		q, w int64
	}{{"burst", 10, 4}, {"hourly", 1000, 3600}, {"fast", 5, 1}} {
		f := c.Rules[i].Fields
		pol := parse(t, f.Policy)
		lim := parse(t, f.Limit(7, 42))
		if pol.Value != want.name || lim.Value != want.name {
			t.Errorf("%s: members name %v and %v", want.name, pol.Value, lim.Value)
		}
		for _, p := range []struct {
			item  httpsfv.Item
			key   string
			value int64
		}{{pol, "q", want.q}, {pol, "w", want.w}, {lim, "r", 7}, {lim, "t", 42}} {
			if v, ok := p.item.Params.Get(p.key); !ok || v != p.value {
				t.Errorf("%s: %s = %v, want %d", want.name, p.key, v, p.value)
			}
		}
	}
}

func parse(t *testing.T, field string) httpsfv.Item {
	t.Helper()
	l, err := httpsfv.UnmarshalList([]string{field})
	if err != nil || len(l) != 1 {
		t.Fatalf("%q: %v", field, err)
	}
	return l[0].(httpsfv.Item)
}

// The limit member is written on every response: one allocation, for the string itself.
func TestFieldsWhenLimitIsWrittenThenItAllocatesOnce(t *testing.T) {
	c, err := policy.Compile(newPolicy(v1alpha1.Rule{Name: "hourly", FixedWindow: &v1alpha1.Window{Limit: 1000, Window: "1h"}}))
	if err != nil {
		t.Fatal(err)
	}
	f := c.Rules[0].Fields
	if n := testing.AllocsPerRun(100, func() { _ = f.Limit(123_456_789, 3600) }); n != 1 {
		t.Errorf("%v allocations, want 1", n)
	}
	if got := f.Limit(123_456_789, 3600); got != `"hourly";r=123456789;t=3600` {
		t.Errorf("Limit = %s", got)
	}
}

// A concurrency rule's fields say its quota is in concurrent requests, and name no window and no
// reset: a slot frees when a request ends, which no clock says.
func TestFieldsWhenARuleIsAConcurrencyLimitThenTheyNameTheUnitAndNoTime(t *testing.T) {
	c, err := policy.Compile(newPolicy(v1alpha1.Rule{Name: "in-flight", Concurrency: &v1alpha1.Concurrency{Limit: 10}}))
	if err != nil {
		t.Fatal(err)
	}
	f := c.Rules[0].Fields
	if f.Policy != `"in-flight";q=10;qu="concurrent-requests"` || f.Limit(3, 30) != `"in-flight";r=3` {
		t.Errorf("fields %s and %s", f.Policy, f.Limit(3, 30))
	}
	pol := parse(t, f.Policy)
	if qu, ok := pol.Params.Get("qu"); !ok || qu != "concurrent-requests" {
		t.Errorf("qu = %v", qu)
	}
	if _, ok := pol.Params.Get("w"); ok {
		t.Error("a window is named")
	}
	if _, ok := parse(t, f.Limit(3, 30)).Params.Get("t"); ok {
		t.Error("a reset is named")
	}
}
