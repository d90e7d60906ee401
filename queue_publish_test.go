package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"
)

// openLanes counts the publisher's confirm channels that are open.
func openLanes(p *publisher) int {
	n := 0
	for i := range p.lanes {
		l := &p.lanes[i]
		l.mu.Lock()
		if l.ch != nil && !l.ch.IsClosed() {
			n++
		}
		l.mu.Unlock()
	}
	return n
}

// One publish at a time keeps using one channel; concurrent publishes
// spread over more lanes, never more than confirmLanes, and every one is
// confirmed.
func TestPublisherLanes(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	declareTestTopology(t, vhost, 200*time.Millisecond)
	cfg := testConfig(t, amqpURL(vhost))
	q := NewQueues(cfg.Queue, mustBrokers(t, amqpURL(vhost)), nil, slog.New(slog.DiscardHandler))
	defer q.Close()
	b := q.conns[0].broker
	body := loadFixture(t, "issues", "opened.payload.json")
	ctx := context.Background()
	for i := 0; i < 50; i++ {
		if err := q.Publish(ctx, b, exchangeName, "", eventMessage("issues", fmt.Sprint("seq-", i), body)); err != nil {
			t.Fatal(err)
		}
	}
	if n := openLanes(q.conns[0].pub); n != 1 {
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
	if n := openLanes(q.conns[0].pub); n < 2 || n > confirmLanes {
		t.Fatalf("40 concurrent publishers used %d channels, want between 2 and %d", n, confirmLanes)
	}
	if got := ready(t, vhost, queueGitHub); got != 450 {
		t.Fatalf("%s holds %d messages, want 450", queueGitHub, got)
	}
}
