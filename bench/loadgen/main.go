// Command loadgen sends GET requests at a fixed rate and prints latency percentiles measured from
// each request's planned send time, so that targets can be compared at the same offered load
// (wrk, a closed loop, slows down with the target and hides its queueing).
//
//	loadgen -url http://127.0.0.1:8080/ -rate 5000 -duration 10s [-c 64] [-H 'Name: value']
package main

import (
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
)

type headers []string

func (h *headers) String() string     { return strings.Join(*h, ", ") }
func (h *headers) Set(v string) error { *h = append(*h, v); return nil }

func main() {
	url := flag.String("url", "", "target URL")
	rate := flag.Int("rate", 1000, "requests per second")
	duration := flag.Duration("duration", 10*time.Second, "how long to send")
	flag.Int("c", 64, "workers, each with its own connection")
	var hs headers
	flag.Var(&hs, "H", "request header 'Name: value' (repeatable)")
	flag.Parse()
	if *url == "" {
		fmt.Fprintln(os.Stderr, "loadgen: -url is required")
		os.Exit(2)
	}
	workers := flag.Lookup("c").Value.(flag.Getter).Get().(int)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: workers}, Timeout: 5 * time.Second}
	var (
		mu        sync.Mutex
		latencies []time.Duration
		errors    int
		wg        sync.WaitGroup
	)
	// A scheduler emits the planned send times at the rate; a fixed pool of workers (one
	// connection each) sends them. When the target falls behind, planned times queue up and their
	// latency grows, instead of the sender slowing down with it.
	planned := make(chan time.Time, *rate*int(duration.Seconds()+1))
	interval := time.Second / time.Duration(*rate)
	start := time.Now()
	go func() {
		defer close(planned)
		for i := 0; ; i++ {
			at := start.Add(time.Duration(i) * interval)
			if at.Sub(start) >= *duration {
				return
			}
			time.Sleep(time.Until(at))
			planned <- at
		}
	}()
	for range workers {
		wg.Go(func() {
			for at := range planned {
				req, _ := http.NewRequest(http.MethodGet, *url, nil)
				for _, h := range hs {
					k, v, _ := strings.Cut(h, ":")
					req.Header.Set(strings.TrimSpace(k), strings.TrimSpace(v))
				}
				resp, err := client.Do(req)
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					_ = resp.Body.Close()
				}
				d := time.Since(at)
				mu.Lock()
				if err != nil {
					errors++
				} else {
					latencies = append(latencies, d)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	slices.Sort(latencies)
	p := func(q float64) time.Duration {
		if len(latencies) == 0 {
			return 0
		}
		return latencies[min(len(latencies)-1, int(q*float64(len(latencies))))]
	}
	fmt.Printf("requests=%d errors=%d achieved=%.0f/s p50=%v p90=%v p99=%v max=%v\n",
		len(latencies), errors, float64(len(latencies))/time.Since(start).Seconds(), p(0.50), p(0.90), p(0.99), p(1))
}
