package store

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluice-dev/sluice/internal/test/redistest"
)

// A decision whose caller gave up while it waited for a pipeline is never sent: sent late, it
// would charge a request that was already answered with its failure mode.
func TestBatcherWhenTheCallerGaveUpBeforeItsPipelineThenTheScriptIsNeverSent(t *testing.T) {
	srv := redistest.NewServer(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = client.Close() })
	script := redis.NewScript("return redis.call('SET', KEYS[1], 1)")
	ctx := context.Background()
	if err := script.Load(ctx, client).Err(); err != nil {
		t.Fatal(err)
	}
	b := newBatcher(client, script, 1, time.Second) // one dispatcher: the second call must wait
	t.Cleanup(b.close)

	srv.Pause()
	call := func(key string, timeout time.Duration) chan error {
		done := make(chan error, 1)
		go func() {
			c, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			_, err := b.run(c, []string{key}, nil)
			done <- err
		}()
		return done
	}
	first := call("first", 300*time.Millisecond) // the dispatcher is stuck on it until it times out
	time.Sleep(50 * time.Millisecond)
	second := call("second", 50*time.Millisecond) // gives up while it waits behind the first
	time.Sleep(20 * time.Millisecond)
	third := call("third", 5*time.Second) // waits patiently, in the same next pipeline
	if err := <-first; err == nil {
		t.Fatal("the first call succeeded against a frozen Redis")
	}
	if err := <-second; err == nil {
		t.Fatal("the second call succeeded against a frozen Redis")
	}
	time.Sleep(100 * time.Millisecond) // the dispatcher now writes the next pipeline
	srv.Resume()
	if err := <-third; err != nil {
		t.Fatalf("the patient call failed: %v", err)
	}

	admin := srv.Client(t)
	if n, err := admin.Exists(ctx, "third").Result(); err != nil || n != 1 {
		t.Fatalf("the patient call's script did not run (exists = %d, error %v)", n, err)
	}
	if n, err := admin.Exists(ctx, "second").Result(); err != nil || n != 0 {
		t.Errorf("the script of the caller that gave up ran (exists = %d, error %v); it must never be sent", n, err)
	}
}
