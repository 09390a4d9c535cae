// Package config is where the enforcer's policies come from and how they are put in force: the
// loader, which holds a policy file to what the API server would hold it to (Load); the config
// sources, the policy file (File) and ConfigMaps through the API server (APIServer); and the
// one Watcher that loads what they hand over and serves it.
package config

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/sluice-dev/sluice/internal/report"
)

// Source is where policy configs come from: the policy file (File), or ConfigMaps through the API
// server (APIServer), one by name or a pool's by label. A source hands the Watcher each config
// it holds and each change of one; the Watcher loads and serves them.
type Source interface {
	// Kind names the source in the report: report.SourceFile or report.SourceAPI.
	Kind() string
	// String names the source in the log.
	String() string
	// open hands the watcher what the source holds at once, before anything is served: the
	// file's config, which must load for the enforcer to start. ConfigMaps need the API server,
	// and hand nothing.
	open(w *Watcher) error
	// follow hands the watcher each change until ctx ends, from goroutines of wg, and returns
	// once following has begun.
	follow(ctx context.Context, wg *sync.WaitGroup, w *Watcher) error
}

// Config is one policy config as a source holds it.
type Config struct {
	// Name is the config's name in its source: "" for a source of one config (the policy file,
	// a ConfigMap selected by name, which stand for one another), a ConfigMap's name in a pool.
	Name string
	// Where names it in the log and in the report: the file's path, "ConfigMap
	// <namespace>/<name>".
	Where string
	// Data is the policy file; Missing, when set, says why there is none.
	Data    []byte
	Missing string
	// One holds the config to one policy (a pool's ConfigMap), and Declared, when set, to that
	// policy, "<namespace>/<name>" (its ConfigMap's annotation).
	One      bool
	Declared string
}

// File is the policy file at Path, read again every Interval: polled rather than watched with
// inotify, to follow the symlink swaps with which the kubelet updates a mounted ConfigMap.
type File struct {
	Path     string
	Interval time.Duration
	// last is what the file held when last read.
	last []byte
}

// Kind implements Source.
func (f *File) Kind() string { return report.SourceFile }

// String names the file in the log.
func (f *File) String() string { return "the policy file " + f.Path }

func (f *File) config(data []byte) Config { return Config{Where: f.Path, Data: data} }

func (f *File) open(w *Watcher) error {
	data, err := os.ReadFile(f.Path)
	if err != nil {
		return fmt.Errorf("load %s: %w", f.Path, err)
	}
	f.last = data
	if err := w.first(f, f.config(data)); err != nil {
		return fmt.Errorf("load %s: %w", f.Path, err)
	}
	return nil
}

func (f *File) follow(ctx context.Context, wg *sync.WaitGroup, w *Watcher) error {
	wg.Go(func() {
		t := time.NewTicker(f.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			data, err := os.ReadFile(f.Path)
			if err != nil || string(data) == string(f.last) {
				continue
			}
			f.last = data
			w.put(f, f.config(data))
		}
	})
	return nil
}

// APIServer is the ConfigMaps of Namespace that hold policy configs under Key, watched through
// the API server: the one of Name (a policy's own enforcer, whose file the ConfigMap also is,
// mounted), or those labelled with Pool (report.PoolLabel), one policy each. Watching takes a
// change to every replica in well under a second, where the kubelet's refresh of a mounted file
// takes up to about a minute. The enforcer's service account needs get, list and watch on the
// ConfigMap of Name, or list and watch on the ConfigMaps of Namespace, and nothing else.
type APIServer struct {
	Namespace string
	// Name or Pool selects the ConfigMaps, by name or by label: one of the two.
	Name, Pool string
	Key        string
	Kube       *rest.Config

	// informer is set once the watch runs; requests before it have nothing to hand over again.
	informer atomic.Pointer[cache.SharedIndexInformer]
}

// Kind implements Source.
func (c *APIServer) Kind() string { return report.SourceAPI }

func (c *APIServer) open(*Watcher) error { return nil }

// String names the ConfigMaps in errors and in the log.
func (c *APIServer) String() string {
	if c.Pool != "" {
		return "the ConfigMaps of pool " + c.Namespace + "/" + c.Pool
	}
	return "ConfigMap " + c.Namespace + "/" + c.Name
}

// config is what a ConfigMap holds.
func (c *APIServer) config(cm *corev1.ConfigMap) Config {
	cfg := Config{Where: "ConfigMap " + cm.Namespace + "/" + cm.Name}
	if c.Pool != "" {
		cfg.Name, cfg.One, cfg.Declared = cm.Name, true, cm.Annotations[report.PolicyAnnotation]
	}
	if data, ok := cm.Data[c.Key]; ok {
		cfg.Data = []byte(data)
	} else {
		cfg.Missing = "the ConfigMap has no key " + c.Key
	}
	return cfg
}

func (c *APIServer) follow(ctx context.Context, wg *sync.WaitGroup, w *Watcher) error {
	kube := rest.CopyConfig(c.Kube)
	kube.Wrap(func(rt http.RoundTripper) http.RoundTripper { return &reachability{next: rt, ctx: ctx, c: c, w: w} })
	cs, err := kubernetes.NewForConfig(kube)
	if err != nil {
		return fmt.Errorf("watch %s: %w", c, err)
	}
	lw := cache.NewFilteredListWatchFromClient(cs.CoreV1().RESTClient(), "configmaps", c.Namespace, func(o *metav1.ListOptions) {
		if c.Pool != "" {
			o.LabelSelector = labels.SelectorFromSet(labels.Set{report.PoolLabel: report.LabelValue(c.Pool)}).String()
		} else {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", c.Name).String()
		}
	})
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
	if _, err := inf.AddEventHandler(c.handler(w)); err != nil {
		return err
	}
	c.informer.Store(&inf)
	w.syncs(c, inf.HasSynced)
	wg.Go(func() { inf.RunWithContext(ctx) })
	return nil
}

// handler hands the watcher each version of a ConfigMap, and, in a pool, each deletion: the
// policy has left the pool. A policy's own ConfigMap that goes away leaves its last good
// policies in force, as its mounted file does.
func (c *APIServer) handler(w *Watcher) cache.ResourceEventHandlerFuncs {
	put := func(obj any) {
		if cm, ok := obj.(*corev1.ConfigMap); ok {
			w.put(c, c.config(cm))
		}
	}
	h := cache.ResourceEventHandlerFuncs{AddFunc: put, UpdateFunc: func(_, obj any) { put(obj) }}
	if c.Pool != "" {
		h.DeleteFunc = func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if cm, ok := obj.(*corev1.ConfigMap); ok {
				w.remove(c, cm.Name)
			}
		}
	}
	return h
}

// handOver hands the watcher every ConfigMap the watch holds again: when the ConfigMaps are in
// force again after another source was, one that changed meanwhile arrived while they were not.
func (c *APIServer) handOver(w *Watcher) {
	if inf := c.informer.Load(); inf != nil {
		for _, obj := range (*inf).GetStore().List() {
			if cm, ok := obj.(*corev1.ConfigMap); ok {
				w.put(c, c.config(cm))
			}
		}
	}
}

// reachability is the API client's transport: it tells the watcher how each request ended. A
// refusal (RBAC, an expired token) or a failing answer is as good as unreachable.
type reachability struct {
	next http.RoundTripper
	ctx  context.Context
	c    *APIServer
	w    *Watcher
}

func (r *reachability) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := r.next.RoundTrip(req)
	failure := err
	if err == nil && resp.StatusCode >= 400 {
		failure = fmt.Errorf("%s %s: %s", req.Method, req.URL.Path, resp.Status)
	}
	switch {
	case failure != nil && r.ctx.Err() == nil:
		r.w.reachable(r.c, failure)
	case failure == nil && r.w.reachable(r.c, nil):
		r.c.handOver(r.w)
	}
	return resp, err
}
