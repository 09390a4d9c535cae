package controllers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/sluice-dev/sluice/internal/render"
	"github.com/sluice-dev/sluice/internal/report"
)

// ReportFetcher reads the report of the enforcer in a pod.
type ReportFetcher func(ctx context.Context, pod *corev1.Pod) (*report.Report, error)

// FetchReport is the ReportFetcher of the manager: GET http://<pod IP>:<admin port>/report with
// c, refusing a report of another version.
func FetchReport(c *http.Client) ReportFetcher {
	return func(ctx context.Context, pod *corev1.Pod) (*report.Report, error) {
		port := render.AdminPort
		for _, ctr := range pod.Spec.Containers {
			for _, p := range ctr.Ports {
				if p.Name == "admin" {
					port = int(p.ContainerPort)
				}
			}
		}
		url := "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(port)) + report.Path
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return nil, err
		}
		resp, err := c.Do(req)
		if err != nil {
			return nil, err
		}
		defer func() { _ = resp.Body.Close() }()
		if resp.StatusCode != http.StatusOK {
			return nil, &reportError{reportStatus, fmt.Errorf("GET %s: %s", url, resp.Status)}
		}
		var r report.Report
		if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&r); err != nil {
			var ne net.Error
			if errors.As(err, &ne) {
				return nil, fmt.Errorf("GET %s: %w", url, err) // the body was cut off
			}
			return nil, &reportError{reportInvalid, fmt.Errorf("GET %s: %w", url, err)}
		}
		if r.Version != report.Version {
			return nil, &reportError{reportInvalid, fmt.Errorf("GET %s: report version %q, want %q", url, r.Version, report.Version)}
		}
		return &r, nil
	}
}

// countWindow is the span over which status counts decisions.
const countWindow = time.Minute

// history keeps, per policy and enforcer pod, the counters each report gave and when, so that
// status can say how many decisions fell in the last minute. It lives in the manager's memory:
// after a restart the first minute counts from the first reports, or from the pods' start.
type history struct {
	mu       sync.Mutex
	policies map[types.NamespacedName]map[types.UID]*podHistory
}

type podHistory struct {
	started time.Time
	samples []sample
}

type sample struct {
	at    time.Time
	rules map[string]report.Counters
}

// record adds the reports of a policy's pods, read at now, drops the pods that are gone, and
// returns each rule's decisions over the last minute, summed over the pods. A pod's count is its
// latest counters less those of its newest sample at least a minute old; lacking one, less zero
// if the pod started within the minute, else less its oldest sample.
func (h *history) record(policy types.NamespacedName, ruleOf func(report.Rule) (string, bool), reports map[types.UID]*report.Report, now time.Time) map[string]report.Counters {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.policies == nil {
		h.policies = map[types.NamespacedName]map[types.UID]*podHistory{}
	}
	pods := h.policies[policy]
	if pods == nil {
		pods = map[types.UID]*podHistory{}
		h.policies[policy] = pods
	}
	for uid := range pods {
		if _, ok := reports[uid]; !ok {
			delete(pods, uid)
		}
	}
	out := map[string]report.Counters{}
	for uid, r := range reports {
		if r == nil {
			continue
		}
		ph := pods[uid]
		if ph == nil || !ph.started.Equal(r.Started) {
			ph = &podHistory{started: r.Started}
			pods[uid] = ph
		}
		s := sample{at: now, rules: map[string]report.Counters{}}
		for _, rule := range r.Rules {
			if name, ok := ruleOf(rule); ok {
				s.rules[name] = rule.Counters
			}
		}
		ph.samples = append(ph.samples, s)
		cutoff := now.Add(-countWindow)
		base := -1
		for i, old := range ph.samples {
			if !old.at.After(cutoff) {
				base = i
			}
		}
		var baseline map[string]report.Counters
		switch {
		case base >= 0:
			ph.samples = ph.samples[base:]
			baseline = ph.samples[0].rules
		case r.Started.After(cutoff):
			// Everything the pod counted, it counted within the window.
		default:
			baseline = ph.samples[0].rules
		}
		for name, c := range s.rules {
			out[name] = out[name].Add(c.Sub(baseline[name]))
		}
	}
	return out
}

// forget drops a policy's history.
func (h *history) forget(policy types.NamespacedName) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.policies, policy)
}
