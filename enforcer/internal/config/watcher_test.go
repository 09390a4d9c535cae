package config

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/report"
)

// fakeSource is a source whose test hands the watcher what it holds.
type fakeSource struct {
	kind string
	at   Config // what open hands over, if its Where is set
}

func (f *fakeSource) Kind() string   { return f.kind }
func (f *fakeSource) String() string { return "the fake " + f.kind }
func (f *fakeSource) open(w *Watcher) error {
	if f.at.Where == "" {
		return nil
	}
	return w.first(f, f.at)
}
func (f *fakeSource) follow(context.Context, *sync.WaitGroup, *Watcher) error { return nil }

// limitFile is a policy file of one policy, ns/p, whose one rule has the given limit.
func limitFile(name string, limit int) []byte {
	return fmt.Appendf(nil, `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: %s, namespace: ns}
spec:
  targetRef: {name: api, port: 80}
  rules:
    - name: r
      fixedWindow: {limit: %d, window: 1h}
`, name, limit)
}

// watched is a watcher of sources on a fake clock, and the limiter it puts policies in force in.
type watched struct {
	*Watcher
	l   *limiter.Limiter
	clk *clocktesting.FakeClock
	reg *prometheus.Registry
}

func newWatched(t *testing.T, sources ...Source) *watched {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	l := limiter.New(limiter.Options{Store: store.NewMemory(store.MemoryOptions{SweepInterval: -1})})
	reg := prometheus.NewRegistry()
	w := NewWatcher(Options{Limiter: l, Registry: reg, Log: logr.Discard(), Now: clk.Now, Started: clk.Now()}, sources...)
	if err := w.Open(); err != nil {
		t.Fatal(err)
	}
	return &watched{Watcher: w, l: l, clk: clk, reg: reg}
}

// step applies what is queued, as the watcher's goroutine does.
func (w *watched) step() {
	w.mu.Lock()
	batch := w.pending
	w.pending = map[string]change{}
	w.mu.Unlock()
	w.apply(batch)
}

// limit is the limit of policy ns/<name>'s rule in force, 0 for none.
func (w *watched) limit(name string) int64 {
	if p := w.l.Policy("ns/" + name); p != nil {
		return p.Rules[0].Limit.Limit
	}
	return 0
}

func (w *watched) reloaded(result string) float64 {
	return testutil.ToFloat64(w.reloads.WithLabelValues(result))
}

// A policy's own enforcer follows its ConfigMap through the API server and falls back to the
// mounted file, which stands for it, while the API server cannot be reached: the file's changes
// are not followed while the ConfigMap is, the fallback keeps what is in force until the file
// changes, the ConfigMap's config is in force again once it is back, and a config in force that
// comes again, from either, changes only where it is said to come from.
func TestWatcherWhenTheAPIServerComesAndGoesThenTheFileStandsInForTheConfigMap(t *testing.T) {
	api := &fakeSource{kind: report.SourceAPI}
	file := &fakeSource{kind: report.SourceFile, at: Config{Where: "policy.yaml", Data: limitFile("p", 1)}}
	w := newWatched(t, api, file)
	steps := []struct {
		name         string
		do           func()
		limit        int64
		source       string
		sinceStarted bool
	}{
		{"when started then the file is in force", func() {}, 1, report.SourceFile, true},
		{"when the API server answers with the ConfigMap then it is in force", func() {
			w.reachable(api, nil)
			w.put(api, Config{Where: "ConfigMap ns/cm", Data: limitFile("p", 2)})
		}, 2, report.SourceAPI, false},
		{"when the file changes while the ConfigMap is followed then nothing changes", func() {
			w.put(file, Config{Where: "policy.yaml", Data: limitFile("p", 3)})
		}, 2, report.SourceAPI, false},
		{"when the API server cannot be reached then what is in force stays", func() {
			w.reachable(api, errors.New("connection refused"))
		}, 2, report.SourceAPI, false},
		{"when the file changes then it is in force", func() {
			w.put(file, Config{Where: "policy.yaml", Data: limitFile("p", 4)})
		}, 4, report.SourceFile, false},
		{"when the file comes again as the ConfigMap's then only the source changes", func() {
			w.reachable(api, nil)
			w.put(api, Config{Where: "ConfigMap ns/cm", Data: limitFile("p", 4)})
		}, 4, report.SourceAPI, false},
	}
	since := w.View().Since
	for _, s := range steps {
		w.clk.Step(time.Second)
		s.do()
		w.step()
		v := w.View()
		if got := w.limit("p"); got != s.limit || v.Source != s.source || v.Revision != report.Revision(limitFile("p", int(s.limit))) {
			t.Fatalf("%s: limit %d from %s at %s, want %d from %s", s.name, got, v.Source, v.Revision, s.limit, s.source)
		}
		if s.sinceStarted && !v.Since.Equal(since) || s.limit == 4 && s.source == report.SourceAPI && !v.Since.Equal(since) {
			t.Errorf("%s: in force since %v, want %v", s.name, v.Since, since)
		}
		since = v.Since
	}
	if a, r := w.reloaded("applied"), w.reloaded("refused"); a != 2 || r != 0 {
		t.Errorf("reloads applied %v, refused %v; want 2 and 0: the start and a config in force again are no reload", a, r)
	}
}

// A pool's ConfigMaps are loaded apart: one that does not load, holds more than one policy or
// another than its ConfigMap declares, or names a policy another ConfigMap serves, is refused
// alone and keeps what it held; a deleted one is no longer served.
func TestWatcherWhenAPoolsConfigMapsChangeThenEachIsServedOrRefusedApart(t *testing.T) {
	pool := &fakeSource{kind: report.SourceAPI}
	w := newWatched(t, pool)
	put := func(cm, declared string, data []byte) {
		w.put(pool, Config{Name: cm, Where: "ConfigMap ns/" + cm, Data: data, One: true, Declared: declared})
	}
	put("a", "ns/a", limitFile("a", 2))
	put("b", "ns/b", limitFile("b", 3))
	put("liar", "ns/liar", limitFile("d", 9))
	put("twice", "", append(limitFile("e", 1), append([]byte("---\n"), limitFile("f", 1)...)...))
	put("copy", "", limitFile("a", 7))
	w.pending["nokey"] = change{src: pool, cfg: Config{Name: "nokey", Where: "ConfigMap ns/nokey", Missing: "the ConfigMap has no key policy.yaml", One: true}}
	w.step()
	refused := func() []string {
		var out []string
		for _, r := range w.View().Refused {
			out = append(out, r.Policy)
		}
		return out
	}
	if got, want := refused(), []string{"ConfigMap ns/nokey", "ConfigMap ns/twice", "ns/a", "ns/liar"}; !slices.Equal(got, want) {
		t.Errorf("refused %v, want %v", got, want)
	}
	if w.limit("a") != 2 || w.limit("b") != 3 || w.limit("d") != 0 {
		t.Errorf("limits a %d, b %d, d %d; want 2, 3 and none", w.limit("a"), w.limit("b"), w.limit("d"))
	}

	put("a", "ns/a", []byte("not: a policy"))
	w.remove(pool, "b")
	w.step()
	if w.limit("a") != 2 || w.limit("b") != 0 {
		t.Errorf("after a's broken change and b's deletion: a %d, b %d; want a's last good 2 and b gone", w.limit("a"), w.limit("b"))
	}
	if n := w.reloaded("refused"); n != 4 {
		t.Errorf("%v refusals counted, want 4: three configs that did not load at first, a's change after (a second config of a policy loads, and is refused where it is served)", n)
	}
}
