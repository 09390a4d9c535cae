package store

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluice-dev/sluice/internal/test/poll"
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
	pipelines := make(chan int, 16) // the calls of each pipeline the dispatcher writes
	client.AddHook(pipelineHook(pipelines))
	b := newBatcher(newScripts(client, script, "", "", time.Second), 1, time.Second) // one dispatcher: the second call must wait
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
	if n := <-pipelines; n != 1 {
		t.Fatalf("the first pipeline holds %d calls, want the first alone", n)
	}
	second := call("second", 50*time.Millisecond) // gives up while it waits behind the first
	poll.WaitFor(t, 10*time.Second, poll.True("the second call queued", func() bool { return len(b.calls) == 1 }))
	third := call("third", 5*time.Second) // waits patiently, in the same next pipeline
	poll.WaitFor(t, 10*time.Second, poll.True("the third call queued", func() bool { return len(b.calls) == 2 }))
	if err := <-first; err == nil {
		t.Fatal("the first call succeeded against a frozen Redis")
	}
	if err := <-second; err == nil {
		t.Fatal("the second call succeeded against a frozen Redis")
	}
	// The dispatcher takes both waiting calls and writes its next pipeline to the frozen server,
	// without the call that gave up.
	if n := <-pipelines; n != 1 {
		t.Fatalf("the next pipeline holds %d calls, want the third alone", n)
	}
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

// pipelineHook sends the number of commands of each pipeline on its channel as it is written.
type pipelineHook chan<- int

func (h pipelineHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h pipelineHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h pipelineHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h <- len(cmds)
		return next(ctx, cmds)
	}
}
