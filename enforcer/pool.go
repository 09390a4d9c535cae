package enforcer

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

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/report"
)

// PoolSource makes the enforcer a replica of an EnforcerPool: it serves the policies whose
// ConfigMaps the manager writes into the pool's namespace, one per policy, labelled with the
// pool (report.PoolLabel). Each is loaded apart: one that does not load is refused alone, and
// reported, while the others are served. No object holds every policy, so a pool has no bound
// but the API server's on the number of ConfigMaps.
type PoolSource struct {
	Namespace, Name string
	// Kube reaches the API server. The enforcer's service account needs list and watch on the
	// ConfigMaps of Namespace, and nothing else.
	Kube *rest.Config
}

// poolWatch follows a pool's ConfigMaps through the API server. The informer's events queue
// changes by ConfigMap; one goroutine applies what is queued as a batch, loading the changed
// ConfigMaps on every core, and puts the result in force at once: a change of one policy among
// ten thousand costs the load of one, and the ten thousand of a start cost ten thousand loads
// and one swap.
type poolWatch struct {
	e    *Enforcer
	src  *PoolSource
	name string
	// pending are the changes not yet applied, by ConfigMap name; nil is a deletion.
	mu      sync.Mutex
	pending map[string]*corev1.ConfigMap
	wake    chan struct{}
	// entries are what each ConfigMap gave, by name; only the applying goroutine touches them.
	entries map[string]*poolEntry
	// view is what the report says: the policies served and refused.
	view atomic.Pointer[poolView]
	// synced is set once everything the first list delivered is in force.
	synced atomic.Bool
}

// poolEntry is what one ConfigMap gave: the policy it holds as last loaded, and its latest
// config when that was refused.
type poolEntry struct {
	// declared is the policy the ConfigMap names (report.PolicyAnnotation).
	declared string
	// revision is the revision of the ConfigMap's latest config.
	revision string
	// served is the last config of this ConfigMap that loaded, nil if none did.
	served *servedPolicy
	// refused says why the latest config did not load; "" when it did.
	refused string
}

type servedPolicy struct {
	policy   *policy.Policy
	revision string
	since    time.Time
}

// poolView is what a pool replica reports.
type poolView struct {
	served  []report.PolicyServed
	refused []report.PolicyRefused
}

// newPoolWatch is the watch of a pool's ConfigMaps, before it runs: nothing served, not synced.
func newPoolWatch(e *Enforcer) *poolWatch {
	w := &poolWatch{e: e, src: e.cfg.Pool, name: e.cfg.Pool.Namespace + "/" + e.cfg.Pool.Name,
		pending: map[string]*corev1.ConfigMap{}, wake: make(chan struct{}, 1), entries: map[string]*poolEntry{}}
	w.view.Store(&poolView{})
	return w
}

// watchPool lists and watches the pool's ConfigMaps and applies them (see poolWatch).
func (e *Enforcer) watchPool(ctx context.Context) error {
	w := e.pool
	cs, err := kubernetes.NewForConfig(w.src.Kube)
	if err != nil {
		return fmt.Errorf("watch the ConfigMaps of pool %s: %w", w.name, err)
	}
	selector := labels.SelectorFromSet(labels.Set{report.PoolLabel: report.LabelValue(w.src.Name)}).String()
	lw := cache.NewFilteredListWatchFromClient(cs.CoreV1().RESTClient(), "configmaps", w.src.Namespace,
		func(o *metav1.ListOptions) { o.LabelSelector = selector })
	inf := cache.NewSharedIndexInformer(lw, &corev1.ConfigMap{}, 0, cache.Indexers{})
	// The cache keeps what the loader reads and the name: ten thousand ConfigMaps' managed
	// fields would cost more memory than their policies.
	if err := inf.SetTransform(func(obj any) (any, error) {
		if cm, ok := obj.(*corev1.ConfigMap); ok {
			cm.ManagedFields, cm.OwnerReferences = nil, nil
		}
		return obj, nil
	}); err != nil {
		return err
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.queue(obj, false) },
		UpdateFunc: func(_, obj any) { w.queue(obj, false) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			w.queue(obj, true)
		},
	}); err != nil {
		return err
	}
	e.wg.Go(func() { inf.RunWithContext(ctx) })
	e.wg.Go(func() { w.run(ctx, inf.HasSynced) })
	return nil
}

// queue records a change of a ConfigMap for the next batch.
func (w *poolWatch) queue(obj any, deleted bool) {
	cm, ok := obj.(*corev1.ConfigMap)
	if !ok {
		return
	}
	w.mu.Lock()
	if deleted {
		w.pending[cm.Name] = nil
	} else {
		w.pending[cm.Name] = cm
	}
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// run applies the queued changes, batch after batch, until ctx ends. The replica is synced once
// the informer has delivered its first list and a batch after that has been applied.
func (w *poolWatch) run(ctx context.Context, hasSynced func() bool) {
	tick := time.NewTicker(100 * time.Millisecond) // to notice the informer's sync with nothing queued
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		case <-tick.C:
		}
		listed := hasSynced()
		w.mu.Lock()
		batch := w.pending
		w.pending = map[string]*corev1.ConfigMap{}
		w.mu.Unlock()
		if len(batch) > 0 {
			start := time.Now()
			w.apply(batch)
			// Putting the policies in force costs in proportion to all of them: while changes
			// keep coming (ten thousand policies created), batches are spaced by what the last
			// one took, so that at most half a core goes to them and the changes that arrive
			// meanwhile make one batch.
			if took := time.Since(start); took > time.Millisecond {
				select {
				case <-ctx.Done():
					return
				case <-time.After(min(took, 250*time.Millisecond)):
				}
			}
		}
		if listed && !w.synced.Load() {
			w.synced.Store(true)
			w.e.cfg.Log.Info("Serving the pool's policies", "pool", w.name, "policies", len(w.e.limiter.Policies()))
		}
	}
}

// apply loads the changed ConfigMaps of a batch, on every core, and puts the pool's policies in
// force.
func (w *poolWatch) apply(batch map[string]*corev1.ConfigMap) {
	type load struct {
		name  string
		cm    *corev1.ConfigMap
		entry *poolEntry
	}
	var loads []*load
	changed := false
	for name, cm := range batch {
		if cm == nil {
			if _, ok := w.entries[name]; ok {
				delete(w.entries, name)
				changed = true
			}
			continue
		}
		data := cm.Data[report.PolicyFileKey]
		rev := report.Revision([]byte(data))
		if old := w.entries[name]; old != nil && old.revision == rev {
			continue
		}
		loads = append(loads, &load{name: name, cm: cm})
	}
	now := w.e.now()
	work := make(chan *load)
	var wg sync.WaitGroup
	for range min(len(loads), runtime.GOMAXPROCS(0)) {
		wg.Go(func() {
			for l := range work {
				l.entry = loadEntry(l.cm, w.entries[l.name], now)
			}
		})
	}
	for _, l := range loads {
		work <- l
	}
	close(work)
	wg.Wait()
	for _, l := range loads {
		w.entries[l.name] = l.entry
		changed = true
		switch {
		case l.entry.refused != "":
			w.e.reloads.WithLabelValues("refused").Inc()
			w.e.cfg.Log.Error(errors.New(l.entry.refused), "Refused a policy's changed config; the pool's other policies are not affected",
				"pool", w.name, "configMap", l.name, "policy", l.entry.declared, "revision", l.entry.revision)
		default:
			w.e.reloads.WithLabelValues("applied").Inc()
		}
	}
	if changed {
		w.publish()
	}
}

// loadEntry loads one ConfigMap's config. A config that does not load, or that holds another
// policy than the ConfigMap names or more than one, is refused; the config last loaded from the
// ConfigMap, if any, stays in force.
func loadEntry(cm *corev1.ConfigMap, old *poolEntry, now time.Time) *poolEntry {
	data, ok := cm.Data[report.PolicyFileKey]
	e := &poolEntry{declared: cm.Annotations[report.PolicyAnnotation], revision: report.Revision([]byte(data))}
	if old != nil {
		e.served = old.served
	}
	if e.declared == "" {
		e.declared = "ConfigMap " + cm.Namespace + "/" + cm.Name
	}
	if !ok {
		e.refused = "the ConfigMap has no key " + report.PolicyFileKey
		return e
	}
	policies, _, err := Load([]byte(data))
	switch {
	case err != nil:
		e.refused = err.Error()
	case len(policies) != 1:
		e.refused = fmt.Sprintf("the config holds %d policies; a pool's ConfigMap holds one", len(policies))
	case cm.Annotations[report.PolicyAnnotation] != "" && policies[0].ID != e.declared:
		e.refused = fmt.Sprintf("the config holds policy %s, but its ConfigMap is %s's", policies[0].ID, e.declared)
	default:
		e.served = &servedPolicy{policy: policies[0], revision: e.revision, since: now}
	}
	return e
}

// publish puts the served policies in force and records what the report says. Two ConfigMaps
// that hold one policy (not the manager's doing) serve the one of the first name; the other is
// refused.
func (w *poolWatch) publish() {
	names := make([]string, 0, len(w.entries))
	for name := range w.entries {
		names = append(names, name)
	}
	slices.Sort(names)
	served := map[string]string{} // policy ID -> ConfigMap
	view := &poolView{}
	ps := make([]*policy.Policy, 0, len(names))
	for _, name := range names {
		en := w.entries[name]
		if en.refused != "" {
			view.refused = append(view.refused, report.PolicyRefused{Policy: en.declared, Revision: en.revision, Reason: en.refused})
		}
		if en.served == nil {
			continue
		}
		id := en.served.policy.ID
		if other, dup := served[id]; dup {
			view.refused = append(view.refused, report.PolicyRefused{Policy: id, Revision: en.served.revision,
				Reason: fmt.Sprintf("ConfigMap %s holds policy %s too, and serves it", other, id)})
			continue
		}
		served[id] = name
		ps = append(ps, en.served.policy)
		view.served = append(view.served, report.PolicyServed{Policy: id, Revision: en.served.revision, Since: en.served.since})
	}
	slices.SortFunc(ps, func(a, b *policy.Policy) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(view.served, func(a, b report.PolicyServed) int { return cmp.Compare(a.Policy, b.Policy) })
	slices.SortFunc(view.refused, func(a, b report.PolicyRefused) int { return cmp.Compare(a.Policy, b.Policy) })
	w.e.limiter.SetPolicies(ps)
	w.view.Store(view)
}
