// Command rlsload measures a rate limit service that speaks Envoy's API
// (envoy.service.ratelimit.v3.RateLimitService) the way Envoy calls it: ShouldRateLimit over gRPC,
// one descriptor per call of a client drawn at random from -keys, from -c concurrent callers on
// one connection each, for -duration. It prints calls per second, the codes, and latency
// percentiles. The same tool measures the enforcer and envoyproxy/ratelimit side by side.
//
//	rlsload -addr 127.0.0.1:8082 -domain ns/policy -entry x-client [-c 50] [-keys 10000] [-duration 10s]
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8082", "the service's gRPC address")
	domain := flag.String("domain", "", "the domain of every call")
	entry := flag.String("entry", "client", "the descriptor entry's key; its value is the client")
	callers := flag.Int("c", 50, "concurrent callers, each on its own connection")
	keys := flag.Int("keys", 10000, "clients, drawn at random per call")
	duration := flag.Duration("duration", 10*time.Second, "how long to call")
	flag.Parse()
	if *domain == "" {
		fmt.Fprintln(os.Stderr, "rlsload: -domain is required")
		os.Exit(2)
	}
	var (
		mu        sync.Mutex
		latencies []time.Duration
		codes     = map[string]int{}
		wg        sync.WaitGroup
	)
	end := time.Now().Add(*duration)
	for range *callers {
		conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer func() { _ = conn.Close() }()
		c := rlsv3.NewRateLimitServiceClient(conn)
		wg.Go(func() {
			var mine []time.Duration
			seen := map[string]int{}
			for time.Now().Before(end) {
				req := &rlsv3.RateLimitRequest{Domain: *domain, Descriptors: []*rlv3.RateLimitDescriptor{{
					Entries: []*rlv3.RateLimitDescriptor_Entry{{Key: *entry, Value: strconv.Itoa(rand.IntN(*keys))}},
				}}}
				start := time.Now()
				resp, err := c.ShouldRateLimit(context.Background(), req)
				mine = append(mine, time.Since(start))
				if err != nil {
					seen["error"]++
					continue
				}
				seen[resp.GetOverallCode().String()]++
			}
			mu.Lock()
			latencies = append(latencies, mine...)
			for k, v := range seen {
				codes[k] += v
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	slices.Sort(latencies)
	pct := func(p float64) time.Duration {
		if len(latencies) == 0 {
			return 0
		}
		return latencies[int(p*float64(len(latencies)-1))]
	}
	fmt.Printf("calls=%d rate=%.0f/s codes=%v p50=%v p99=%v\n", len(latencies), float64(len(latencies))/duration.Seconds(), codes, pct(0.5), pct(0.99))
}
