package controllers

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/sluice-dev/sluice/internal/report"
)

// The report of a pool replica that serves 10,000 policies is several megabytes: the manager
// reads it whole, and refuses a body past MaxReportBytes instead of holding it.
func TestFetchReportWhenAPoolReplicaServesTenThousandPoliciesThenItIsReadWhole(t *testing.T) {
	big := &report.Report{Version: report.Version, Started: time.Unix(1_700_000_000, 0).UTC(), Synced: true}
	for i := range 10_000 {
		id := fmt.Sprintf("pool-bench-abcde/p%d", i)
		big.Policies = append(big.Policies, report.PolicyServed{Policy: id, Revision: "62d6ebf6b8d69aa7", Since: big.Started})
		big.Rules = append(big.Rules, report.Rule{Policy: id, Name: "per-client", Counters: report.Counters{Allowed: uint64(i)}})
	}
	body, err := json.Marshal(big)
	if err != nil {
		t.Fatal(err)
	}
	if len(body) <= 1<<20 {
		t.Fatalf("the report is %d bytes; the test needs one past the old 1 MiB bound", len(body))
	}
	serve := func(b []byte) *corev1.Pod {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(b) }))
		t.Cleanup(srv.Close)
		host, port, _ := net.SplitHostPort(strings.TrimPrefix(srv.URL, "http://"))
		p, _ := strconv.Atoi(port)
		return &corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{{Ports: []corev1.ContainerPort{{Name: "admin", ContainerPort: int32(p)}}}}},
			Status: corev1.PodStatus{PodIP: host}}
	}
	fetch := FetchReport(&http.Client{Timeout: 30 * time.Second})

	got, err := fetch(context.Background(), serve(body))
	if err != nil {
		t.Fatalf("a %d-byte report: %v", len(body), err)
	}
	if len(got.Policies) != 10_000 || len(got.Rules) != 10_000 || got.Rules[9_999].Allowed != 9_999 {
		t.Errorf("read %d policies and %d rules, want 10,000 of each", len(got.Policies), len(got.Rules))
	}

	// Past the bound: a report with a string of MaxReportBytes inside it is refused, not read.
	padded := append([]byte(`{"version":"`+report.Version+`",`+`"x":"`), []byte(strings.Repeat("a", MaxReportBytes))...)
	padded = append(padded, `"}`...)
	if _, err := fetch(context.Background(), serve(padded)); err == nil {
		t.Errorf("a report of %d bytes, past MaxReportBytes, was read", len(padded))
	}
}
