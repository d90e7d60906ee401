package main

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"
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
	q := NewQueues(cfg.Queue, mustBrokers(t, untrusted), nil, slog.New(slog.DiscardHandler))
	if err := q.Reachable(context.Background(), q.conns[0].broker); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("amqps without the CA: %v, want a certificate error", err)
	}
	q.Close()

	d := startDaemon(t, cfg)

	guid := "amqps-" + randHex(4)
	if code, body := do(t, webhookRequest(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened"))); code != http.StatusAccepted {
		t.Fatalf("webhook over amqps: %d %s", code, body)
	}
	storedAll(t, cfg.Database.Path, []string{guid}, 20*time.Second)
}
