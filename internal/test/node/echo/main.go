// Command echo is the node tier's upstream: an HTTP server that answers every request 200 with
// its pod's name, and counts what it answered, which GET /count returns, so that a test can add
// up what reached the upstream across its pods.
package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"
)

func main() {
	name, _ := os.Hostname()
	var served atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("GET /count", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = fmt.Fprintln(w, served.Load())
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		served.Add(1)
		_, _ = fmt.Fprintln(w, name)
	})
	srv := &http.Server{Addr: ":8080", Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		stop()
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1) //nolint:gocritic // stop has run
	}
}
