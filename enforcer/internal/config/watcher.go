package config

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/report"
)

// Watcher puts in force what its sources hand it. Each config is loaded apart: one that does not
// load is refused alone, counted and logged, and what it held before stays in force. The
// policies served are those of the configs of the source in force: the first of its sources
// that answers (a ConfigMap through the API server before the mounted file that stands for it),
// or the last. A source not in force is not followed: what it hands over meanwhile is dropped,
// and it hands over again once it is back in force (ConfigMaps, all they hold; the file, its
// next change).
//
// Changes queue by config; one goroutine applies what is queued as a batch, loading the changed
// configs on every core, and puts the result in force at once: a change of one policy among ten
// thousand costs the load of one, and the ten thousand of a start cost ten thousand loads and
// one swap.
type Watcher struct {
	limiter *limiter.Limiter
	log     logr.Logger
	now     func() time.Time
	reloads *prometheus.CounterVec
	sources []Source
	started time.Time

	mu sync.Mutex
	// pending are the changes not yet applied, by config name: the latest of each.
	pending map[string]change
	wake    chan struct{}
	// unreachable says, by source, why it cannot be reached: nil once it answers, until it
	// fails. hasSynced tells, by source, whether it has handed over what it held when it began
	// (nil: at open).
	unreachable []error
	hasSynced   []func() bool

	// entries are what each config gave, by name: only open and the applying goroutine touch
	// them.
	entries map[string]*entry
	// view is what the report says; synced is set once the source in force has handed over
	// what it held when it began, and that is in force.
	view   atomic.Pointer[View]
	synced atomic.Bool
}

// change is a config handed over by a source, or its removal.
type change struct {
	src     Source
	cfg     Config
	removed bool
}

// entry is what one config gave: the policies last loaded from it, in force, and its latest
// config when that was refused.
type entry struct {
	// revision is its latest config's (report.Revision); refused, why that was refused, "" if
	// it is served.
	revision, refused string
	// declared is the policy it is said to hold, or where it is: the report's name for it.
	declared string
	served   *served
}

// served is the config of an entry in force.
type served struct {
	policies         []*policy.Policy
	revision, source string
	since            time.Time
}

// View is what the Watcher has put in force, as the report says it.
type View struct {
	// Source is the kind of source the config in force came from last (report.SourceFile,
	// report.SourceAPI); Revision and Since its revision and since when, for a source of one
	// config (its Name ""). For a pool's, Revision is "" and Since the watcher's start.
	Source, Revision string
	Since            time.Time
	// Served and Refused are the policies served and the configs refused, by policy ID.
	Served  []report.PolicyServed
	Refused []report.PolicyRefused
}

// errUnanswered is why a source cannot be reached before it has answered once.
var errUnanswered = errors.New("not answered yet")

// Options configure a Watcher.
type Options struct {
	// Limiter is where the policies are put in force.
	Limiter *limiter.Limiter
	// Registry counts the configs applied and refused (sluice_config_reloads_total).
	Registry prometheus.Registerer
	Log      logr.Logger
	// Now tells when a config took force; Started is when the enforcer started.
	Now     func() time.Time
	Started time.Time
}

// NewWatcher is the watcher of sources, in order of preference.
func NewWatcher(o Options, sources ...Source) *Watcher {
	w := &Watcher{limiter: o.Limiter, log: o.Log, now: o.Now, started: o.Started, sources: sources, pending: map[string]change{}, wake: make(chan struct{}, 1),
		unreachable: make([]error, len(sources)), hasSynced: make([]func() bool, len(sources)), entries: map[string]*entry{}}
	for i := range w.unreachable {
		w.unreachable[i] = errUnanswered
	}
	w.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_config_reloads_total", Help: "Policy file reloads by result (applied, refused).",
	}, []string{"result"})
	for _, result := range []string{"applied", "refused"} {
		w.reloads.WithLabelValues(result) // at zero from the start: the first refusal is an increase
	}
	o.Registry.MustRegister(w.reloads)
	w.view.Store(&View{Source: sources[len(sources)-1].Kind(), Since: w.started})
	return w
}

// Open puts in force what the sources hold at once: the policy file, which must load.
func (w *Watcher) Open() error {
	for _, s := range w.sources {
		if err := s.open(w); err != nil {
			return err
		}
	}
	return nil
}

// Follow follows every source, and applies what they hand over, until ctx ends, from goroutines
// of wg.
func (w *Watcher) Follow(ctx context.Context, wg *sync.WaitGroup) error {
	for _, s := range w.sources {
		if err := s.follow(ctx, wg, w); err != nil {
			return err
		}
	}
	wg.Go(func() { w.run(ctx) })
	return nil
}

// View is what the watcher has put in force.
func (w *Watcher) View() *View { return w.view.Load() }

// Synced reports whether the source in force has handed over what it held when it began, and
// that is in force: a pool's replica is ready then.
func (w *Watcher) Synced() bool { return w.synced.Load() }

// first puts in force a config a source holds at open, or says why it does not load.
func (w *Watcher) first(src Source, cfg Config) error {
	e, warnings, err := load(src, cfg, report.Revision(cfg.Data), nil, w.started)
	if err != nil {
		return err
	}
	for _, warning := range warnings {
		w.log.Info("Policy file: "+warning, "config", cfg.Where)
	}
	w.entries[cfg.Name] = e
	w.reachable(src, nil)
	w.synced.Store(true)
	w.publish()
	return nil
}

// put queues a config a source hands over; remove, a config it no longer holds.
func (w *Watcher) put(src Source, cfg Config) { w.queue(change{src: src, cfg: cfg}) }
func (w *Watcher) remove(src Source, name string) {
	w.queue(change{src: src, cfg: Config{Name: name}, removed: true})
}

func (w *Watcher) queue(c change) {
	w.mu.Lock()
	if w.index(c.src) > w.inForce() {
		w.mu.Unlock()
		return // a source preferred to it answers
	}
	w.pending[c.cfg.Name] = c
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// index is a source's place among the watcher's.
func (w *Watcher) index(src Source) int { return slices.Index(w.sources, src) }

// inForce is the index of the source in force: the first that answers, or else the last
// (w.mu is held).
func (w *Watcher) inForce() int {
	for i, err := range w.unreachable {
		if err == nil {
			return i
		}
	}
	return len(w.sources) - 1
}

// syncs tells the watcher how a source says that it has handed over what it held when it began.
func (w *Watcher) syncs(src Source, hasSynced func() bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.hasSynced[w.index(src)] = hasSynced
}

// reachable records how a source's last request ended (err nil: it answered), logs a change of
// the source in force, and reports whether that is now src, from another.
func (w *Watcher) reachable(src Source, err error) (regained bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	i, before := w.index(src), w.inForce()
	w.unreachable[i] = err
	after := w.inForce()
	switch {
	case after == before:
		return false
	case err != nil:
		w.log.Error(err, "Cannot reach a config source; following the next until it is back", "source", src.String(), "following", w.sources[after].String())
	default:
		w.log.Info("Following a config source again", "source", src.String())
	}
	return after == i
}

// run applies the queued changes, batch after batch, until ctx ends. The watcher is synced once
// the source in force has handed over what it held when it began, and a batch after that has
// been applied.
func (w *Watcher) run(ctx context.Context) {
	tick := time.NewTicker(100 * time.Millisecond) // to notice the source's sync with nothing queued
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		case <-tick.C:
		}
		w.mu.Lock()
		src, hasSynced := w.sources[w.inForce()], w.hasSynced[w.inForce()]
		batch := w.pending
		w.pending = map[string]change{}
		w.mu.Unlock()
		listed := hasSynced == nil || hasSynced()
		if len(batch) > 0 && !w.applySpaced(ctx, batch) {
			return
		}
		if listed && !w.synced.Load() {
			w.synced.Store(true)
			w.log.Info("Serving the policies of its config source", "source", src.String(), "policies", len(w.limiter.Policies()))
		}
	}
}

// applySpaced applies a batch, then waits as long as it took, up to 250 ms, and reports whether
// ctx is still alive. Putting the policies in force costs in proportion to all of them: while
// changes keep coming (ten thousand policies created), batches are spaced so that at most half a
// core goes to them and the changes that arrive meanwhile make one batch.
func (w *Watcher) applySpaced(ctx context.Context, batch map[string]change) bool {
	start := time.Now()
	w.apply(batch)
	if took := time.Since(start); took > time.Millisecond {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(min(took, 250*time.Millisecond)):
		}
	}
	return true
}

// loading is a config of a batch to load, and what it gave.
type loading struct {
	change
	revision string
	entry    *entry
	warnings []string
	err      error
}

// apply loads the changed configs of a batch, on every core, and puts the policies in force.
func (w *Watcher) apply(batch map[string]change) {
	changed := false
	var loads []*loading
	for name, c := range batch {
		old := w.entries[name]
		if c.removed {
			delete(w.entries, name)
			changed = changed || old != nil
			continue
		}
		rev := report.Revision(c.cfg.Data)
		switch {
		case old == nil || old.revision != rev && (old.served == nil || old.served.revision != rev):
			loads = append(loads, &loading{change: c, revision: rev})
		case old.served != nil && old.served.revision == rev && (old.refused != "" || old.served.source != c.src.Kind()):
			// The config in force, handed over again, by its source or another: nothing to load.
			old.revision, old.refused = rev, ""
			old.served.source = c.src.Kind()
			changed = true
		}
	}
	w.loadAll(loads)
	var applied []any // the log's key-value pairs of what was applied
	for _, l := range loads {
		w.entries[l.cfg.Name], changed = l.entry, true
		if w.counted(l) {
			applied = append(applied, "config", l.cfg.Where, "revision", l.revision)
		}
	}
	if !changed {
		return
	}
	w.publish()
	switch n := len(applied) / 4; {
	case n == 1:
		w.log.Info("Applied a changed policy config", append(applied, "policies", len(w.limiter.Policies()))...)
	case n > 1:
		w.log.Info("Applied changed policy configs", "configs", n, "policies", len(w.limiter.Policies()))
	}
}

// loadAll loads the configs of a batch on every core.
func (w *Watcher) loadAll(loads []*loading) {
	now := w.now()
	work := make(chan *loading)
	var wg sync.WaitGroup
	for range min(len(loads), runtime.GOMAXPROCS(0)) {
		wg.Go(func() {
			for l := range work {
				l.entry, l.warnings, l.err = load(l.src, l.cfg, l.revision, w.entries[l.cfg.Name], now)
			}
		})
	}
	for _, l := range loads {
		work <- l
	}
	close(work)
	wg.Wait()
}

// counted counts a loaded config, applied or refused, logs its warnings or its refusal, and
// reports whether it was applied.
func (w *Watcher) counted(l *loading) bool {
	kv := []any{"config", l.cfg.Where, "revision", l.revision}
	if l.cfg.Declared != "" {
		kv = append(kv, "policy", l.cfg.Declared)
	}
	if l.err != nil {
		w.reloads.WithLabelValues("refused").Inc()
		w.log.Error(l.err, "Refused a changed policy config; what it held before stays in force", kv...)
		return false
	}
	w.reloads.WithLabelValues("applied").Inc()
	for _, warning := range l.warnings {
		w.log.Info("Policy file: "+warning, kv...)
	}
	return true
}

// load loads one config of src at revision rev: what old held stays in force if it is refused. A
// config that does not load, or, in a pool, that holds more than one policy or another than its
// ConfigMap declares, is refused.
func load(src Source, cfg Config, rev string, old *entry, now time.Time) (*entry, []string, error) {
	e := &entry{revision: rev, declared: cfg.Declared}
	if old != nil {
		e.served = old.served
	}
	if e.declared == "" {
		e.declared = cfg.Where
	}
	var err error
	if cfg.Missing != "" {
		err = errors.New(cfg.Missing)
	}
	var policies []*policy.Policy
	var warnings []string
	if err == nil {
		policies, warnings, err = Load(cfg.Data)
	}
	switch {
	case err != nil:
	case cfg.One && len(policies) != 1:
		err = fmt.Errorf("the config holds %d policies; a pool's ConfigMap holds one", len(policies))
	case cfg.Declared != "" && policies[0].ID != cfg.Declared:
		err = fmt.Errorf("the config holds policy %s, but its ConfigMap is %s's", policies[0].ID, cfg.Declared)
	default:
		e.served = &served{policies: policies, revision: rev, source: src.Kind(), since: now}
		return e, warnings, nil
	}
	e.refused = err.Error()
	return e, warnings, err
}

// publish puts the served policies in force and records what the report says. Two configs that
// hold one policy (not the manager's doing) serve it from the first by name; the other is
// refused.
func (w *Watcher) publish() {
	names := make([]string, 0, len(w.entries))
	for name := range w.entries {
		names = append(names, name)
	}
	slices.Sort(names)
	view := &View{Source: w.sources[len(w.sources)-1].Kind(), Since: w.started}
	owner := map[string]string{} // policy ID -> config
	var kept []*served
	for _, name := range names {
		e := w.entries[name]
		if e.refused != "" {
			view.Refused = append(view.Refused, report.PolicyRefused{Policy: e.declared, Revision: e.revision, Reason: e.refused})
		}
		if e.served == nil {
			continue
		}
		if id, other := servedBy(e.served, owner); other != "" {
			view.Refused = append(view.Refused, report.PolicyRefused{Policy: id, Revision: e.served.revision,
				Reason: fmt.Sprintf("ConfigMap %s holds policy %s too, and serves it", other, id)})
			continue
		}
		for _, p := range e.served.policies {
			owner[p.ID] = name
			view.Served = append(view.Served, report.PolicyServed{Policy: p.ID, Revision: e.served.revision, Since: e.served.since})
		}
		kept = append(kept, e.served)
		if name == "" {
			view.Source, view.Revision, view.Since = e.served.source, e.served.revision, e.served.since
		}
	}
	// In the order of their policies: a pool's, one each, by ID; a file's as it holds them.
	slices.SortStableFunc(kept, func(a, b *served) int { return cmp.Compare(a.policies[0].ID, b.policies[0].ID) })
	var ps []*policy.Policy
	for _, s := range kept {
		ps = append(ps, s.policies...)
	}
	slices.SortFunc(view.Served, func(a, b report.PolicyServed) int { return cmp.Compare(a.Policy, b.Policy) })
	slices.SortFunc(view.Refused, func(a, b report.PolicyRefused) int { return cmp.Compare(a.Policy, b.Policy) })
	w.limiter.SetPolicies(ps)
	w.view.Store(view)
}

// servedBy returns a policy of s that another config serves already, and that config.
func servedBy(s *served, owner map[string]string) (id, other string) {
	for _, p := range s.policies {
		if other, ok := owner[p.ID]; ok {
			return p.ID, other
		}
	}
	return "", ""
}
