package enforcer

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/internal/report"
	"github.com/sluice-dev/sluice/internal/settings"
)

// pingStore pings the store every StorePingInterval and keeps what it learned for the report.
// Decisions alone would not do: an idle replica with a wrong password makes none. Start made
// the first ping.
func (e *Enforcer) pingStore(ctx context.Context) {
	t := time.NewTicker(e.cfg.StorePingInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := e.ping(ctx)
		if ctx.Err() != nil {
			return
		}
		e.checkedStore(err)
	}
}

// checkedStore records the outcome of a ping, and logs a change.
func (e *Enforcer) checkedStore(err error) {
	h := report.Store{Kind: storeName(e.cfg), Connected: err == nil, Since: e.now()}
	if err != nil {
		h.Cause, h.Message = storeCause(err), err.Error()
	} else {
		e.limiter.StoreAnswered() // where no request comes to probe, the ping closes the breaker
	}
	prev := e.health.Load()
	switch {
	case prev != nil && prev.Connected == h.Connected:
		h.Since = prev.Since
	case err != nil:
		e.cfg.Log.Error(err, "The store does not answer; rules apply their failure modes", "cause", h.Cause)
	case prev != nil:
		e.cfg.Log.Info("The store answers again")
	}
	e.health.Store(&h)
}

// ping asks the store to answer within the time a decision has. When it does not, it asks again
// with a second to spare, to learn why: the store's own error (a refused connection, a wrong
// password), or, if it answers then but late, that it is slower than decisions allow. A second
// ping answered in time (a Cluster's other node, a connection that was being replaced) is a
// store that answers.
func (e *Enforcer) ping(ctx context.Context) error {
	timeout := settings.Defaults().RedisTimeout
	if e.cfg.Redis != nil && e.cfg.Redis.Timeout > 0 {
		timeout = e.cfg.Redis.Timeout
	}
	short, cancel := context.WithTimeout(ctx, timeout)
	err := e.store.Ping(short)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	long, cancel := context.WithTimeout(ctx, timeout+time.Second)
	defer cancel()
	start := time.Now()
	if err := e.store.Ping(long); err != nil {
		return err
	}
	if took := time.Since(start); took > timeout {
		return fmt.Errorf("%w: the store answered a ping in %v, more than the timeout of %v", context.DeadlineExceeded,
			took.Round(time.Millisecond), timeout)
	}
	return nil
}

// storeCause classifies a failed ping as one of report's causes.
func storeCause(err error) string {
	msg := err.Error()
	var verify *tls.CertificateVerificationError
	var unknownAuthority x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var record tls.RecordHeaderError
	var netErr net.Error
	switch {
	case strings.HasPrefix(msg, "WRONGPASS") || strings.HasPrefix(msg, "NOAUTH") || strings.HasPrefix(msg, "NOPERM"):
		return report.CauseAuthentication
	case errors.As(err, &verify) || errors.As(err, &unknownAuthority) || errors.As(err, &hostname) ||
		errors.As(err, &record) || strings.HasPrefix(msg, "tls: "):
		return report.CauseTLS
	case errors.Is(err, context.DeadlineExceeded) || errors.As(err, &netErr) && netErr.Timeout():
		return report.CauseTimeout
	}
	return report.CauseUnreachable
}

// report is the replica's account of itself, as served at report.Path.
func (e *Enforcer) report() report.Report {
	v := e.watcher.View()
	r := report.Report{
		Version:       report.Version,
		Started:       e.started,
		Revision:      v.Revision,
		RevisionSince: v.Since,
		ConfigSource:  v.Source,
		Store:         *e.health.Load(),
	}
	r.Store.BreakerOpen = e.limiter.BreakerOpen()
	if p := e.cfg.Pool; p != nil {
		r.Pool, r.Synced, r.Policies, r.Refused = p.Namespace+"/"+p.Name, e.watcher.Synced(), v.Served, v.Refused
	}
	counters := e.limiter.Counters()
	for _, p := range e.limiter.Policies() {
		for _, rule := range p.Rules {
			r.Rules = append(r.Rules, report.Rule{Policy: p.ID, Name: rule.Name,
				Counters: counters[limiter.RuleKey{Namespace: p.Namespace, Policy: p.Name, Rule: rule.Name}]})
		}
	}
	return r
}

func (e *Enforcer) serveReport(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(e.report())
}

func (e *Enforcer) now() time.Time {
	if e.cfg.Now != nil {
		return e.cfg.Now()
	}
	return time.Now()
}
