package controllers_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// BenchmarkThousandPoliciesReachProgrammed creates 1,000 policies at once and measures the time
// until every one is Programmed, with the manager (16 workers, 400 requests/s: cmd/manager's
// defaults) in this process against the test control plane. It reports the peak heap in use and the process's peak resident memory.
//
//	go test -run '^$' -bench ThousandPolicies -benchtime 1x ./controllers/
func BenchmarkThousandPoliciesReachProgrammed(b *testing.B) {
	n := 1000
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_POLICIES")); err == nil {
		n = v
	}
	for b.Loop() {
		ns := testenv.Namespace(b, k8s, "scale")
		var peakHeap uint64
		stop := make(chan struct{})
		var sampler sync.WaitGroup
		sampler.Go(func() {
			var ms runtime.MemStats
			for {
				runtime.ReadMemStats(&ms)
				peakHeap = max(peakHeap, ms.HeapInuse)
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
				}
			}
		})
		start := time.Now()
		var create sync.WaitGroup
		for w := range 8 {
			create.Go(func() {
				for i := w; i < n; i += 8 {
					p := newPolicy(ns, "p"+strconv.Itoa(i), "svc-"+strconv.Itoa(i))
					if err := k8s.Create(context.Background(), p); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		create.Wait()
		created := time.Since(start)
		err := poll.Every(200*time.Millisecond, 10*time.Minute, func() error {
			var list v1alpha1.RateLimitPolicyList
			if err := k8s.List(context.Background(), &list, client.InNamespace(ns)); err != nil {
				b.Fatal(err)
			}
			done := 0
			for i := range list.Items {
				if meta.IsStatusConditionTrue(list.Items[i].Status.Conditions, v1alpha1.ConditionProgrammed) {
					done++
				}
			}
			if done == n {
				return nil
			}
			if os.Getenv("SLUICE_BENCH_DUMP") != "" && time.Since(start) > 60*time.Second {
				reasons := map[string]int{}
				for i := range list.Items {
					c := meta.FindStatusCondition(list.Items[i].Status.Conditions, v1alpha1.ConditionProgrammed)
					if c == nil {
						reasons["no condition"]++
					} else if c.Status != "True" {
						reasons[c.Reason+": "+c.Message]++
					}
				}
				b.Fatalf("stuck: %v", reasons)
			}
			if int(time.Since(start).Seconds())%15 == 0 {
				fmt.Fprintf(os.Stderr, "%v: %d of %d created, %d Programmed\n", time.Since(start).Round(time.Second), len(list.Items), n, done)
			}
			return fmt.Errorf("%d of %d Programmed", done, n)
		})
		if err != nil {
			b.Fatal(err)
		}
		elapsed := time.Since(start)
		close(stop)
		sampler.Wait()
		b.ReportMetric(elapsed.Seconds(), "s-to-all-programmed")
		b.ReportMetric(created.Seconds(), "s-to-create")
		b.ReportMetric(float64(peakHeap)/(1<<20), "MiB-peak-heap")
		b.ReportMetric(vmHWM()/(1<<10), "MiB-peak-RSS")
	}
}

// vmHWM is the process's peak resident set in KiB, from /proc/self/status.
func vmHWM() float64 {
	data, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kb float64
			_, _ = fmt.Sscan(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), &kb)
			return kb
		}
	}
	return 0
}
