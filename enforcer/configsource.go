package enforcer

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/sluice-dev/sluice/internal/report"
)

// ConfigMapSource names the ConfigMap that holds the enforcer's policy file: the controller's
// rendering of the policy, which the kubelet also mounts at PolicyFile. Watching it through the
// API server takes a change to every replica in well under a second, where the kubelet's refresh
// of the mounted file takes up to about a minute.
type ConfigMapSource struct {
	Namespace, Name string
	// Key is the ConfigMap's key of the policy file.
	Key string
	// Kube reaches the API server. The enforcer's service account needs get, list and watch on
	// this one ConfigMap by name, and nothing else.
	Kube *rest.Config
}

// watchFile polls the policy file and applies each change while the ConfigMap is not being
// watched: in standalone mode always, otherwise while the API server cannot be reached. Polling,
// rather than inotify, follows the symlink swaps with which the kubelet updates mounted
// ConfigMaps. A file that changes while the watch is healthy brings nothing the watch did not.
func (e *Enforcer) watchFile(ctx context.Context) {
	last, _ := os.ReadFile(e.cfg.PolicyFile)
	t := time.NewTicker(e.cfg.ReloadInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		data, err := os.ReadFile(e.cfg.PolicyFile)
		if err != nil || string(data) == string(last) {
			continue
		}
		last = data
		if e.watching.Load() {
			continue
		}
		e.apply(data, report.SourceFile, "file", e.cfg.PolicyFile)
	}
}

// watchConfigMap watches the ConfigMap and applies each version of its policy file (see
// configMapWatch).
func (e *Enforcer) watchConfigMap(ctx context.Context) error {
	w := &configMapWatch{e: e, ctx: ctx, src: e.cfg.ConfigMap, name: e.cfg.ConfigMap.Namespace + "/" + e.cfg.ConfigMap.Name}
	kube := rest.CopyConfig(w.src.Kube)
	kube.Wrap(func(rt http.RoundTripper) http.RoundTripper { return &reachability{next: rt, watch: w} })
	cs, err := kubernetes.NewForConfig(kube)
	if err != nil {
		return fmt.Errorf("watch ConfigMap %s: %w", w.name, err)
	}
	lw := cache.NewListWatchFromClient(cs.CoreV1().RESTClient(), "configmaps", w.src.Namespace,
		fields.OneTermEqualSelector("metadata.name", w.src.Name))
	inf := cache.NewSharedIndexInformer(lw, &corev1.ConfigMap{}, 0, cache.Indexers{})
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    w.apply,
		UpdateFunc: func(_, obj any) { w.apply(obj) },
	}); err != nil {
		return err
	}
	w.informer.Store(&inf)
	e.wg.Go(func() { inf.RunWithContext(ctx) })
	return nil
}

// configMapWatch follows the enforcer's ConfigMap through the API server. Every request to the
// API server says whether it can be reached: while one fails, watchFile takes over; the first
// that succeeds hands back, and the latest version the watch holds is applied again (one that
// changed meanwhile arrives through the watch).
type configMapWatch struct {
	e    *Enforcer
	ctx  context.Context
	src  *ConfigMapSource
	name string
	// informer is set once the watch runs; requests before it have nothing to apply again.
	informer atomic.Pointer[cache.SharedIndexInformer]
}

// apply applies the policy file of a version of the ConfigMap.
func (w *configMapWatch) apply(obj any) {
	cm, ok := obj.(*corev1.ConfigMap)
	if !ok {
		return
	}
	data, ok := cm.Data[w.src.Key]
	if !ok {
		w.e.cfg.Log.Error(errors.New("key missing"), "The enforcer's ConfigMap has no policy file; the last good policies stay",
			"configMap", w.name, "key", w.src.Key)
		return
	}
	w.e.apply([]byte(data), report.SourceAPI, "configMap", w.name)
}

// observe moves the watch between following the API server and following the mounted file, by
// how a request to the API server ended. A refusal (RBAC, an expired token) or a failing
// answer is as good as unreachable.
func (w *configMapWatch) observe(req *http.Request, resp *http.Response, err error) {
	failure := err
	if err == nil && resp.StatusCode >= 400 {
		failure = fmt.Errorf("%s %s: %s", req.Method, req.URL.Path, resp.Status)
	}
	switch {
	case failure != nil && w.ctx.Err() == nil:
		if w.e.watching.Swap(false) {
			w.e.cfg.Log.Error(failure, "Cannot reach the API server; following the mounted file until it is back",
				"configMap", w.name, "file", w.e.cfg.PolicyFile)
		}
	case failure == nil && !w.e.watching.Swap(true):
		w.e.cfg.Log.Info("Following the ConfigMap through the API server", "configMap", w.name)
		if inf := w.informer.Load(); inf != nil {
			for _, obj := range (*inf).GetStore().List() {
				w.apply(obj)
			}
		}
	}
}

// reachability is the API client's transport: it tells the watch how each request ended.
type reachability struct {
	next  http.RoundTripper
	watch *configMapWatch
}

func (r *reachability) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := r.next.RoundTrip(req)
	r.watch.observe(req, resp, err)
	return resp, err
}

// apply loads a policy file from source and puts it in force, unless it is the one in force. An
// invalid one is logged and refused; the last good policies stay.
func (e *Enforcer) apply(data []byte, source string, kv ...any) {
	e.applyMu.Lock()
	defer e.applyMu.Unlock()
	rev := report.Revision(data)
	if cur := e.served.Load(); cur != nil && cur.Revision == rev {
		if cur.Source != source {
			e.served.Store(&served{Revision: rev, Since: cur.Since, Source: source})
		}
		return
	}
	policies, warnings, err := Load(data)
	if err != nil {
		e.reloads.WithLabelValues("refused").Inc()
		e.cfg.Log.Error(err, "Refused a changed policy file; the last good policies stay", append(kv, "revision", rev)...)
		return
	}
	for _, w := range warnings {
		e.cfg.Log.Info("Policy file: "+w, append(kv, "revision", rev)...)
	}
	e.limiter.SetPolicies(policies)
	e.served.Store(&served{Revision: rev, Since: e.now(), Source: source})
	e.reloads.WithLabelValues("applied").Inc()
	e.cfg.Log.Info("Applied a changed policy file", append(kv, "revision", rev, "policies", len(policies))...)
}

// served is the config in force.
type served struct {
	Revision, Source string
	Since            time.Time
}
