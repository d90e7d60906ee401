package main

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace/noop"
	"go.uber.org/goleak"
)

// TestAMQPSEndToEnd: a broker behind TLS (amqps://, its CA from cacertfile):
// the webhook is published and both workers store it, over TLS both ways.
func TestAMQPSEndToEnd(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTLSProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))

	// The certificate is checked: without the CA file the broker is not
	// reachable.
	untrusted, _, _ := strings.Cut(proxy.URL(vhost), "?")
	q := NewQueues(cfg.Queue, mustBrokers(t, untrusted), nil, noop.NewTracerProvider(), slog.New(slog.DiscardHandler))
	if err := q.Reachable(context.Background(), q.conns[0].broker); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("amqps without the CA: %v, want a certificate error", err)
	}
	q.Close()

	d := startDaemon(t, cfg)

	guid := "amqps-" + randHex(4)
	if code, body := do(t, webhookRequest(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened"))); code != http.StatusAccepted {
		t.Fatalf("webhook over amqps: %d %s", code, body)
	}
	storedAll(t, cfg.Database, []string{guid}, 20*time.Second)
}

// The queues own the goroutines they start: once Close returns, none is
// left (the block watchers, the lanes opened in the background, the
// consumers). Not parallel: goleak sees every goroutine of the process.
func TestQueuesCloseLeavesNoGoroutine(t *testing.T) {
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	p := newParts(t, cfg)
	b := p.brokers.List()[0]
	ctx := context.Background()
	if err := p.queues.Reachable(ctx, b); err != nil {
		t.Fatal(err)
	}
	body := loadFixture(t, "issues", "opened")
	var wg sync.WaitGroup
	for range 32 { // enough at once to open lanes in the background
		wg.Go(func() {
			if err := p.queues.Publish(ctx, b, exchangeName, "", eventMessage("issues", newGUID(), body)); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if _, _, err := p.queues.Inspect(ctx, b); err != nil {
		t.Fatal(err)
	}
	o := EventOptions{Queue: queueGitHub, Handle: serviceHandler(nil, 0, false), Batch: p.store, Log: p.log}.options()
	if n, err := p.queues.Consume(ctx, b, o, 300*time.Millisecond, nil); err != nil || n != 32 {
		t.Errorf("consumed %d (%v), want 32", n, err)
	}
	if err := p.queues.Close(); err != nil {
		t.Fatal(err)
	}
}
