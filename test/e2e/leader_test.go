package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/poll"
)

// Two managers with leader election: while the leader leads, the other serves the webhook and
// neither reconciles nor reads a report; kill the leader (SIGKILL, so it cannot hand its lease
// over) and the other reconciles within the lease duration, while admission never pauses for
// more than 2 s, because both serve the webhook; only writes in flight on the killed replica's
// connections at the moment of the kill fail. The webhook's Service is played
// by a TCP forwarder that sends each connection to a replica that accepts it, as endpoints do once
// a pod is gone.
func TestManagersWhenTheLeaderIsKilledThenTheOtherReconcilesAndAdmissionNeverPauses(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	env, k8s := c.env, c.env.Client
	logs := newProcessLog(t)

	host := env.Webhook.LocalServingHost
	backends := make([]string, 2)
	for i := range backends {
		addr, err := local.FreeAddr()
		if err != nil {
			t.Fatal(err)
		}
		backends[i] = addr
	}
	serveForwarder(t, net.JoinHostPort(host, strconv.Itoa(env.Webhook.LocalServingPort)), backends)

	const leaseDuration, retryPeriod = 4 * time.Second, 500 * time.Millisecond
	// start starts a manager that serves the webhook on backend, and returns it with its metrics
	// address.
	start := func(backend string) (*local.Process, string) {
		_, port, _ := net.SplitHostPort(backend)
		metricsAddr, err := local.FreeAddr()
		if err != nil {
			t.Fatal(err)
		}
		p, err := local.StartManager(ctx, env, c.managerBin, c.kubeconfig, logs, "--webhook-port="+port, "--metrics-bind-address="+metricsAddr,
			"--leader-elect", "--leader-elect-lease-duration="+leaseDuration.String(),
			"--leader-elect-renew-deadline=3s", "--leader-elect-retry-period="+retryPeriod.String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Stop)
		return p, metricsAddr
	}
	leader, _ := start(backends[0])
	lease := &coordinationv1.Lease{}
	poll.WaitFor(t, 30*time.Second, func() error {
		if err := k8s.Get(ctx, types.NamespacedName{Namespace: local.Namespace, Name: "manager.ratelimit.sluice.dev"}, lease); err != nil {
			return err
		}
		if lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity == "" {
			return errors.New("the lease has no holder")
		}
		return nil
	})
	first := *lease.Spec.HolderIdentity
	_, standbyMetrics := start(backends[1])

	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "leader-"}}
	if err := k8s.Create(ctx, ns); err != nil {
		t.Fatal(err)
	}
	policy := func(name string) *v1alpha1.RateLimitPolicy {
		return &v1alpha1.RateLimitPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: name},
			Spec: v1alpha1.RateLimitPolicySpec{
				// A Service of its own: a later policy on the same target would be Conflicted.
				TargetRef: v1alpha1.TargetRef{Name: "api-" + name, Port: 8080},
				Rules:     []v1alpha1.Rule{{Name: "all", FixedWindow: &v1alpha1.Window{Limit: 10, Window: "1m"}}},
			},
		}
	}

	// Admission every 50 ms, through both webhooks, for the whole switch.
	var admitted atomic.Int64
	// failures are the admissions that failed, with when: a SIGKILL breaks the connections the
	// API server holds to the killed replica, and a write in flight on one fails (as it would in a
	// cluster, where a client retries it); none may fail once that moment has passed.
	var mu sync.Mutex
	var failures []admissionFailure
	// longest is the longest time between two admitted writes.
	var longest atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		last := time.Now()
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if err := k8s.Create(ctx, policy("probe"), client.DryRunAll); err != nil {
				mu.Lock()
				failures = append(failures, admissionFailure{time.Now(), err})
				mu.Unlock()
			} else {
				admitted.Add(1)
				longest.Store(max(longest.Load(), int64(time.Since(last))))
				last = time.Now()
			}
		}
	})
	// A policy the leader programs while the standby, which serves the webhook too, reconciles
	// nothing: only the leader reconciles and reads the enforcers' reports.
	if err := k8s.Create(ctx, policy("before")); err != nil {
		t.Fatal(err)
	}
	poll.WaitFor(t, 30*time.Second, func() error {
		return k8s.Get(ctx, types.NamespacedName{Namespace: ns.Name, Name: "sluice-before"}, &appsv1.Deployment{})
	})
	const reconciles, reads = `controller_runtime_reconcile_total{controller="ratelimitpolicy"`, "sluice_manager_report_reads_total"
	if n, r := scrapeSum(t, standbyMetrics, reconciles), scrapeSum(t, standbyMetrics, reads); n != 0 || r != 0 {
		t.Errorf("the standby reconciled %v times and read %v reports while the leader led, want none", n, r)
	}
	// Admissions through both replicas before the kill.
	admittedAtLeast := func(n int64) func() error {
		return func() error {
			if a := admitted.Load(); a < n {
				return fmt.Errorf("%d admissions, want %d", a, n)
			}
			return nil
		}
	}
	poll.WaitFor(t, 30*time.Second, admittedAtLeast(10))

	if err := leader.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	_ = leader.Wait()
	if err := k8s.Create(ctx, policy("after")); err != nil {
		t.Fatalf("create a policy after the leader died: %v", err)
	}
	// The lease can change hands only once it expires: within the lease duration of the last
	// renewal, and the retry period after that.
	poll.WaitFor(t, 30*time.Second, func() error {
		if err := k8s.Get(ctx, types.NamespacedName{Namespace: local.Namespace, Name: "manager.ratelimit.sluice.dev"}, lease); err != nil {
			return err
		}
		if h := lease.Spec.HolderIdentity; h == nil || *h == first {
			return errors.New("the killed leader still holds the lease")
		}
		return nil
	})
	acquired := time.Since(killed)
	key := types.NamespacedName{Namespace: ns.Name, Name: "sluice-after"}
	poll.WaitFor(t, 30*time.Second, func() error { return k8s.Get(ctx, key, &appsv1.Deployment{}) })
	took := time.Since(killed)
	poll.WaitFor(t, 30*time.Second, admittedAtLeast(admitted.Load()+10)) // admissions after the switch
	close(stop)
	wg.Wait()

	if err := k8s.Get(ctx, types.NamespacedName{Namespace: local.Namespace, Name: "manager.ratelimit.sluice.dev"}, lease); err != nil {
		t.Fatal(err)
	}
	if h := lease.Spec.HolderIdentity; h == nil || *h == first {
		t.Errorf("the lease is still held by %v, the killed leader", h)
	}
	// The margin is the API server's latency and the scheduling of a loaded machine.
	if limit := leaseDuration + retryPeriod + 2*time.Second; acquired > limit {
		t.Errorf("the other manager took the lease %v after the kill, want within the lease duration and a retry period (%v)", acquired, limit)
	}
	if limit := leaseDuration + retryPeriod + 4*time.Second; took > limit {
		t.Errorf("the policy created after the kill was reconciled %v after it, want within the lease duration and the caches' sync (%v)", took, limit)
	}
	for _, f := range failures {
		// The moment of the kill: the writes then in flight on its connections, which the API
		// server sent before it saw them break.
		if at := f.at.Sub(killed); at < -time.Second || at > time.Second {
			t.Errorf("an admission failed %v after the kill, want none but the ones in flight at it: %v", at, f.err)
		}
	}
	if len(failures) > 2 {
		t.Errorf("%d admissions failed around the kill (of %d), want at most the two a connection to the killed replica could carry", len(failures), admitted.Load())
	}
	if pause := time.Duration(longest.Load()); pause > 2*time.Second {
		t.Errorf("policy writes were not admitted for %v during the switch, want no pause over 2s", pause)
	}
	t.Logf("the other manager took the lease %v and reconciled %v after the kill (lease %v, retry %v); %d admissions, %d failed, longest pause %v",
		acquired.Round(10*time.Millisecond), took.Round(10*time.Millisecond), leaseDuration, retryPeriod, admitted.Load()+int64(len(failures)), len(failures),
		time.Duration(longest.Load()).Round(time.Millisecond))
}

// admissionFailure is an admission that failed, and when.
type admissionFailure struct {
	at  time.Time
	err error
}

// serveForwarder accepts connections on addr and pipes each to the first backend that accepts
// it, trying them in turn from a rotating start: a Service with two endpoints.
func serveForwarder(t *testing.T, addr string, backends []string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var next atomic.Uint64
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = in.Close() }()
				n := next.Add(1)
				for i := range backends {
					out, err := net.DialTimeout("tcp", backends[(int(n)+i)%len(backends)], time.Second)
					if err != nil {
						continue
					}
					defer func() { _ = out.Close() }()
					go func() { _, _ = io.Copy(out, in); _ = out.(*net.TCPConn).CloseWrite() }()
					_, _ = io.Copy(in, out)
					return
				}
			}()
		}
	}()
}
