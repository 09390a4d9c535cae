package limiter

import (
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/sluice-dev/sluice/internal/policy"
	"github.com/sluice-dev/sluice/internal/report"
)

// Causes of store errors, the values of the cause label.
const (
	causeUnavailable = "unavailable"
	causeFault       = "fault"
)

// Decision results, the values of the result label.
const (
	resultAllowed       = "allowed"
	resultLimited       = "limited"
	resultShadowLimited = "shadow_limited"
	resultFailedOpen    = "failed_open"
	resultFailedClosed  = "failed_closed"
	// resultSkipped: a front end that cannot see a response's end (the check API, Envoy's rate
	// limit service) did not decide a rule that needs it (a concurrency rule, a rule charged by
	// the response).
	resultSkipped = "skipped"
)

// Results of charges by the response, the values of sluice_response_charges_total's result label.
const (
	// chargeCharged: the response charged what it reported, or the rule's cost without costFrom.
	chargeCharged = "charged"
	// chargeClamped: the response reported more than costFrom.max, and was charged max.
	chargeClamped = "clamped"
	// chargeDefaultCost: the response reported no valid cost (its field missing, repeated, not a
	// whole number), or never came, and was charged the rule's cost.
	chargeDefaultCost = "default_cost"
	// chargeIncomplete: the response began, but its body did not end (its client left, or the
	// upstream broke it off), and reported no valid cost in its header: the cost a trailer would
	// have reported is unknown, and leaving early must not lower it, so it was charged
	// costFrom.max.
	chargeIncomplete = "incomplete"
	// chargeFailed: the store could not take the charge.
	chargeFailed = "failed"
)

// Results of lease renewals, the values of sluice_lease_renewals_total's result label.
const (
	renewalRenewed = "renewed"
	renewalFailed  = "failed"
)

var chargeResults = []string{chargeCharged, chargeClamped, chargeDefaultCost, chargeIncomplete, chargeFailed}

// Metrics are the limiter's Prometheus metrics. Labels name policies (namespace and policy, the
// name, apart, as kube-state-metrics names objects), rules and results, never client keys or
// addresses.
type Metrics struct {
	decisions       *prometheus.CounterVec
	responseCharges *prometheus.CounterVec
	leaseRenewals   *prometheus.CounterVec
	storeLatency    prometheus.Histogram
	storeErrors     *prometheus.CounterVec
	cacheHits       prometheus.Counter
	cancelled       prometheus.Counter
	breakerOpen     prometheus.Gauge
	policyInfo      *prometheus.GaugeVec
	// served is what serve last recorded, by policy ID: a pool's change of one policy among
	// thousands touches that policy's series alone.
	served map[string]*policy.Policy
}

// NewMetrics creates the metrics and registers them with reg, if reg is not nil.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_decisions_total",
			Help: "Rule decisions by policy (namespace and policy, its name), rule and result (allowed, limited, shadow_limited, failed_open, failed_closed, skipped: a concurrency rule or one charged by the response, which the check API and Envoy's rate limit service cannot decide).",
		}, []string{"namespace", "policy", "rule", "result"}),
		responseCharges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_response_charges_total",
			Help: "Responses charged to rules charged by the response (charge.when Response), by policy, rule and result: charged (what the response reported, or the rule's cost), clamped (more than costFrom.max, charged max), default_cost (no valid cost in the response, or no response: the rule's cost), incomplete (a body that did not end and no valid cost in the header: costFrom.max), failed (the store could not take the charge).",
		}, []string{"namespace", "policy", "rule", "result"}),
		leaseRenewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_lease_renewals_total",
			Help: "Renewals of the leases of requests in flight under concurrency rules (one per request every third of its lease timeout), by result: renewed, failed (the lease then lasts to its timeout).",
		}, []string{"result"}),
		storeLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "sluice_store_latency_seconds",
			Help:    "Latency of one store decision, all rules of a request together.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25},
		}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sluice_store_errors_total",
			Help: "Store decisions that failed, after which rules applied their failure modes, by cause: unavailable (timeouts, refused connections, a server that cannot serve) or fault (a script error, a key of the wrong type: a bug or a configuration problem of the decision's rules).",
		}, []string{"cause"}),
		cacheHits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_refusal_cache_hits_total",
			Help: "Requests refused from the local refusal cache without asking the store.",
		}),
		cancelled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sluice_decisions_cancelled_total",
			Help: "Requests whose client left before they were answered. A decision its caller cancelled before the store answered: neither a store error nor a rule's decision, never counted by the breaker. A request whose client left while the front end, which decides detached from the client, was deciding it (an h2c stream reset, a gRPC call Envoy gave up on) or held it in a leaky bucket's queue: decided and counted as usual, and counted here too.",
		}),
		breakerOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sluice_store_breaker_open",
			Help: "1 while the store circuit breaker is open or probing, 0 while closed.",
		}),
		policyInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sluice_enforcer_policy_info",
			Help: "1 for each policy the enforcer serves, by namespace and policy (its name): joins its per-pod series (store latency, breaker, reloads) to policies.",
		}, []string{"namespace", "policy"}),
	}
	if reg != nil {
		reg.MustRegister(m.decisions, m.responseCharges, m.leaseRenewals, m.storeLatency, m.storeErrors, m.cacheHits, m.cancelled, m.breakerOpen, m.policyInfo)
	}
	for _, cause := range []string{causeUnavailable, causeFault} {
		m.storeErrors.WithLabelValues(cause)
	}
	for _, result := range []string{renewalRenewed, renewalFailed} {
		m.leaseRenewals.WithLabelValues(result)
	}
	return m
}

// results are the values of the result label.
var results = []string{resultAllowed, resultLimited, resultShadowLimited, resultFailedOpen, resultFailedClosed, resultSkipped}

// serve records the policies in force: sluice_enforcer_policy_info names them; their rules'
// decision series exist at zero, so that an alert on increase() sees a rule's first
// failed_closed decision rather than the series' birth; and the series of rules no longer in
// force are dropped, so that dashboards do not show them.
//
// Only what changed is touched: a policy served as the same compiled policy as before keeps its
// series as they are, so a pool that changes one policy of ten thousand does the work of one.
func (m *Metrics) serve(ps []*policy.Policy) {
	next := make(map[string]*policy.Policy, len(ps))
	for _, p := range ps {
		next[p.ID] = p
	}
	for id, old := range m.served {
		if p := next[id]; p != old {
			m.drop(old, p)
		}
	}
	for _, p := range ps {
		if m.served[p.ID] == p {
			continue
		}
		m.policyInfo.WithLabelValues(p.Namespace, p.Name).Set(1)
		for i := range p.Rules {
			for _, res := range results {
				m.decisions.WithLabelValues(p.Namespace, p.Name, p.Rules[i].Name, res)
			}
			if p.Rules[i].OnResponse {
				for _, res := range chargeResults {
					m.responseCharges.WithLabelValues(p.Namespace, p.Name, p.Rules[i].Name, res)
				}
			}
		}
	}
	m.served = next
}

// drop deletes the series of the rules of old that its successor p (nil: none) no longer has,
// the response charges of those p no longer charges by the response, and old's policy_info when
// p is nil.
func (m *Metrics) drop(old, p *policy.Policy) {
	if p == nil {
		m.policyInfo.DeleteLabelValues(old.Namespace, old.Name)
	}
	for i := range old.Rules {
		name := old.Rules[i].Name
		var next *policy.Rule
		if p != nil {
			if j := slices.IndexFunc(p.Rules, func(r policy.Rule) bool { return r.Name == name }); j >= 0 {
				next = &p.Rules[j]
			}
		}
		if next == nil {
			for _, res := range results {
				m.decisions.DeleteLabelValues(old.Namespace, old.Name, name, res)
			}
		}
		if old.Rules[i].OnResponse && (next == nil || !next.OnResponse) {
			for _, res := range chargeResults {
				m.responseCharges.DeleteLabelValues(old.Namespace, old.Name, name, res)
			}
		}
	}
}

func (m *Metrics) decision(p *policy.Policy, rule, result string) {
	m.decisions.WithLabelValues(p.Namespace, p.Name, rule, result).Inc()
}

func (m *Metrics) responseCharge(p *policy.Policy, rule, result string) {
	m.responseCharges.WithLabelValues(p.Namespace, p.Name, rule, result).Inc()
}

// RuleKey names a rule: its policy's namespace and name, and its own name.
type RuleKey struct{ Namespace, Policy, Rule string }

// Counters reads sluice_decisions_total and sluice_response_charges_total back, per rule, for
// the enforcer's report: the metrics are the one count of decisions and charges, so the report
// and Prometheus cannot disagree.
func (m *Metrics) Counters() map[RuleKey]report.Counters {
	ch := make(chan prometheus.Metric)
	go func() {
		m.decisions.Collect(ch)
		m.responseCharges.Collect(ch)
		close(ch)
	}()
	out := map[RuleKey]report.Counters{}
	for metric := range ch {
		var pb dto.Metric
		if err := metric.Write(&pb); err != nil {
			continue
		}
		var k RuleKey
		var result string
		for _, l := range pb.GetLabel() {
			switch l.GetName() {
			case "namespace":
				k.Namespace = l.GetValue()
			case "policy":
				k.Policy = l.GetValue()
			case "rule":
				k.Rule = l.GetValue()
			case "result":
				result = l.GetValue()
			}
		}
		c, n := out[k], uint64(pb.GetCounter().GetValue())
		switch result {
		case resultAllowed:
			c.Allowed += n
		case resultLimited:
			c.Limited += n
		case resultShadowLimited:
			c.ShadowLimited += n
		case resultFailedOpen:
			c.FailedOpen += n
		case resultFailedClosed:
			c.FailedClosed += n
		case resultSkipped:
			c.Skipped += n
		case chargeCharged, chargeClamped, chargeDefaultCost, chargeIncomplete:
			c.Charged += n
		}
		out[k] = c
	}
	return out
}
