package store

import (
	"context"
	"errors"
	"time"
)

// maxBatch bounds how many decisions share one pipeline.
const maxBatch = 64

// errClosed is the error of a decision made after Close.
var errClosed = errors.New("redis store closed")

// batcher sends the decide scripts of concurrent decisions to one Redis server in pipelines. Each
// of a few dispatchers takes the first waiting decision and every other one already waiting, and
// writes them in one go: under load many decisions share one write and one read, on both sides,
// while each is still its own atomic script. A lone decision goes out at once, alone.
//
// Nothing is ever sent twice: pipelines are not retried, and only a reply that says the script
// did not run is sent again (scripts.run). A decision whose caller gave up before its pipeline
// was written is not sent at all.
type batcher struct {
	scripts *scripts
	// timeout bounds a pipeline whose callers set no deadline.
	timeout time.Duration
	calls   chan *scriptCall
	stop    chan struct{}
	done    chan struct{}
}

// scriptCall is one decision waiting for its reply.
type scriptCall struct {
	ctx   context.Context
	keys  []string
	args  []any
	reply any
	err   error
	done  chan struct{}
}

func newBatcher(scripts *scripts, dispatchers int, timeout time.Duration) *batcher {
	b := &batcher{
		scripts: scripts,
		timeout: timeout,
		calls:   make(chan *scriptCall, 4*maxBatch),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	finished := make(chan struct{}, dispatchers)
	for range dispatchers {
		go func() { b.dispatch(); finished <- struct{}{} }()
	}
	go func() {
		for range dispatchers {
			<-finished
		}
		close(b.done)
	}()
	return b
}

// run sends the script and waits for its reply, or for ctx to end.
func (b *batcher) run(ctx context.Context, keys []string, args []any) (any, error) {
	c := &scriptCall{ctx: ctx, keys: keys, args: args, done: make(chan struct{})}
	select {
	case b.calls <- c:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-b.stop:
		return nil, errClosed
	}
	select {
	case <-c.done:
		return c.reply, c.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (b *batcher) close() {
	close(b.stop)
	<-b.done
}

func (b *batcher) dispatch() {
	batch := make([]*scriptCall, 0, maxBatch)
	for {
		select {
		case <-b.stop:
			return
		case c := <-b.calls:
			batch = append(batch[:0], c)
		}
	more:
		for len(batch) < maxBatch {
			select {
			case c := <-b.calls:
				batch = append(batch, c)
			default:
				break more
			}
		}
		b.send(batch)
	}
}

// send writes the live calls of a batch in one pipeline and hands each its reply.
func (b *batcher) send(batch []*scriptCall) {
	// The pipeline lives as long as its most patient caller; the others stop waiting on their own.
	live := batch[:0]
	var deadline time.Time
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil {
			c.err = err
			close(c.done)
			continue
		}
		d, ok := c.ctx.Deadline()
		if !ok {
			d = time.Now().Add(b.timeout)
		}
		if d.After(deadline) {
			deadline = d
		}
		live = append(live, c)
	}
	if len(live) == 0 {
		return
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	b.scripts.run(ctx, live)
	for _, c := range live {
		close(c.done)
	}
}
