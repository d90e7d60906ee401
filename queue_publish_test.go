package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace/noop"
)

// openLanes counts the publisher's confirm channels that are open.
func openLanes(p *publisher) int {
	p.mu.Lock()
	lanes := p.lanes
	p.mu.Unlock()
	if lanes == nil {
		return 0
	}
	n := 0
	for i := range lanes {
		l := &lanes[i]
		l.mu.Lock()
		if l.ch != nil && !l.ch.IsClosed() {
			n++
		}
		l.mu.Unlock()
	}
	return n
}

// publishQueues is Queues over a fresh vhost with the topology declared;
// the test's cleanup closes them.
func publishQueues(t *testing.T) (vhost string, q *Queues) {
	vhost = newVhost(t)
	declareTestTopology(t, vhost, 200*time.Millisecond)
	cfg := testConfig(t, amqpURL(vhost))
	q = NewQueues(cfg.Queue, mustBrokers(t, amqpURL(vhost)), nil, noop.NewTracerProvider(), slog.New(slog.DiscardHandler))
	t.Cleanup(func() { q.Close() })
	return vhost, q
}

// One publish at a time keeps using one channel; concurrent publishes
// spread over more lanes, never more than confirmLanes, and every one is
// confirmed.
func TestPublisherLanes(t *testing.T) {
	t.Parallel()
	vhost, q := publishQueues(t)
	b := q.conns[0].broker
	body := loadFixture(t, "issues", "opened")
	ctx := context.Background()
	// A connection opened to count messages opens no publisher.
	if _, _, err := q.Inspect(ctx, b); err != nil {
		t.Fatal(err)
	}
	if q.pubs[0].conn != nil || openLanes(q.pubs[0]) != 0 {
		t.Fatalf("counting messages opened %d confirm channels, want none", openLanes(q.pubs[0]))
	}
	for i := 0; i < 50; i++ {
		if err := q.Publish(ctx, b, exchangeName, "", eventMessage("issues", fmt.Sprint("seq-", i), body)); err != nil {
			t.Fatal(err)
		}
	}
	if n := openLanes(q.pubs[0]); n != 1 {
		t.Fatalf("50 publishes one after another opened %d channels, want 1", n)
	}

	var wg sync.WaitGroup
	errs := make(chan error, 400)
	for c := 0; c < 40; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 10; i++ {
				errs <- q.Publish(ctx, b, exchangeName, "", eventMessage("issues", fmt.Sprintf("par-%d-%d", c, i), body))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := openLanes(q.pubs[0]); n < 2 || n > confirmLanes {
		t.Fatalf("40 concurrent publishers used %d channels, want between 2 and %d", n, confirmLanes)
	}
	if got := ready(t, vhost, queueGitHub); got != 450 {
		t.Fatalf("%s holds %d messages, want 450", queueGitHub, got)
	}
}

// A publish never waits for a lane's channel to open (two round trips)
// while another lane's is open: with the only open lane busy, it pipelines
// behind that one, and the next lane opens in the background and is taken
// once it is open.
func TestPublisherOpensLanesInBackground(t *testing.T) {
	t.Parallel()
	_, q := publishQueues(t)
	b := q.conns[0].broker
	if err := q.Publish(context.Background(), b, exchangeName, "", eventMessage("issues", "first", loadFixture(t, "issues", "opened"))); err != nil {
		t.Fatal(err)
	}
	p := q.pubs[0]
	if n := openLanes(p); n != 1 {
		t.Fatalf("a connection that published once has %d channels open, want 1", n)
	}
	busy, idle := p.pickLane() // a publish in flight on the open lane
	if busy != &p.lanes[0] || !idle {
		t.Fatalf("the first publish took lane %p (idle %v), want the open lane 0", busy, idle)
	}
	next, idle := p.pickLane()
	if next != &p.lanes[0] || idle {
		t.Fatalf("with lane 0 busy, a publish took lane %p (idle %v), want to pipeline behind lane 0", next, idle)
	}
	eventually(t, 30*time.Second, "a second lane opened in the background", func() bool { return openLanes(p) == 2 })
	warmed, idle := p.pickLane()
	if warmed == &p.lanes[0] || !idle {
		t.Fatalf("once a second lane is open, a publish took lane %p (idle %v), want it", warmed, idle)
	}
	p.put(busy, true)
	p.put(warmed, true)
}

// A message whose gzip body inflates past the bound goes to -error with
// the reason, and the worker goes on to the next.
func TestInflateBombToError(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	eventually(t, 10*time.Second, "topology declared", func() bool {
		return d.queues.Reachable(context.Background(), d.brokers.List()[0]) == nil
	})
	bomb := eventMessage("issues", newGUID(), nil)
	bomb.Body, bomb.ContentEncoding = compressGzip(make([]byte, maxInflated+1)), encodingGzip
	publishRaw(t, vhost, "", queueGitHub, bomb)
	good := newGUID()
	publishRaw(t, vhost, "", queueGitHub, eventMessage("issues", good, loadFixture(t, "issues", "opened")))
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "the good message stored after the bomb", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", good) == 1
	})
	eventually(t, 20*time.Second, "the bomb in github-error", func() bool { return ready(t, vhost, errorQueue(queueGitHub)) == 1 })
	if m := getOne(t, vhost, errorQueue(queueGitHub)); !strings.Contains(tableString(m.Headers, hdrErrorReason), "inflates past") ||
		m.ContentEncoding != encodingGzip {
		t.Errorf("x-error-reason %q, encoding %q; want the bound named, the body kept compressed", tableString(m.Headers, hdrErrorReason), m.ContentEncoding)
	}
}

// A broker that closes a channel for a message over its own
// max_message_size names the limit: the message over it is refused, the
// others on the channel are sent again (resendable), and the forwarder
// refuses the next row over it before sending it, until the connection
// is dialed again.
func TestSizeRefusal(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		code   int
		reason string
		limit  int64
		ok     bool
	}{
		{amqp.PreconditionFailed, "PRECONDITION_FAILED - message size 20971520 is larger than configured max size 16777216", 16777216, true},
		{amqp.PreconditionFailed, "PRECONDITION_FAILED - message size 600000000 is larger than max size 536870912", 536870912, true},
		{amqp.PreconditionFailed, "PRECONDITION_FAILED - message size 20971520 is larger than configured max size", 0, true},
		{amqp.PreconditionFailed, "PRECONDITION_FAILED - inequivalent arg 'x-queue-type'", 0, false},
		{amqp.NotFound, "NOT_FOUND - message size 1 is larger than configured max size 2", 0, false},
	} {
		limit, ok := sizeRefusal(&amqp.Error{Code: c.code, Reason: c.reason})
		if limit != c.limit || ok != c.ok {
			t.Errorf("%d %q: %d, %v; want %d, %v", c.code, c.reason, limit, ok, c.limit, c.ok)
		}
	}
	if err := fmt.Errorf("publish: %w", &ClosedForSizeError{Limit: 16}); !resendable(err) {
		t.Errorf("a publish lost with a channel closed on another message is not sent again: %v", err)
	}

	b := mustBrokers(t, amqpURL(newVhost(t)))[0]
	b.MaxMessageBytes = 64 << 20
	q := NewQueues(QueueConfig{CallTimeout: time.Second, PublishTimeout: time.Second}, []*Broker{b}, nil, noop.NewTracerProvider(), slog.New(slog.DiscardHandler))
	defer q.Close()
	if err := q.TooLarge(b, 20<<20); err != nil {
		t.Errorf("20 MiB under max_message_bytes, no limit named: %v", err)
	}
	q.conns[0].sizeLimit.Store(16 << 20)
	var tl *TooLargeError
	if err := q.TooLarge(b, 20<<20); !errors.As(err, &tl) || !tl.Own || tl.Max != 16<<20 {
		t.Errorf("20 MiB over the limit the broker named: %v", err)
	}
	if err := q.TooLarge(b, 65<<20); !errors.As(err, &tl) || tl.Max != 16<<20 {
		t.Errorf("65 MiB: %v, want refused by the broker's own limit", err)
	}
	if err := q.TooLarge(b, 1<<20); err != nil {
		t.Errorf("1 MiB: %v", err)
	}
	if err := q.Reachable(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	if err := q.TooLarge(b, 20<<20); err != nil {
		t.Errorf("20 MiB once the connection was dialed again: %v, want the limit forgotten", err)
	}
}
