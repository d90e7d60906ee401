package main

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// awayRates are what the outbox takes while the broker is away and
// forwards once it is back, on one store, beside the end-to-end rate of
// the same daemon with the broker there.
type awayRates struct {
	endToEnd   float64 // webhooks/s, the broker there, stored to the typed row
	taking     float64 // webhooks/s answered 202 while the broker is away
	forwarding float64 // of those, webhooks/s forwarded once the broker is back
}

// benchBrokerAway: one daemon over amqps at rtt with the default config
// (store "sqlite" or "postgres"), 64 clients: end to end for 15 s with
// the broker there; then the link closed and 64 clients for 10 s, every
// webhook answered 202 queued; then the link open again, and the time
// until the outbox is empty.
func benchBrokerAway(b *testing.B, payload []byte, rtt time.Duration, store string) (r awayRates) {
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANProxy(b, testBrokerAddr(), rtt)
	var p *benchProcess
	if store == "postgres" {
		p = startBenchNode(b, proxy.URL(vhost), newPostgresDatabase(b), "bench-1")
	} else {
		p = startBenchProcess(b, proxy.URL(vhost), "")
	}
	defer p.stop(b)
	sustained(b, p, payload, 64, time.Second) // warm, as benchWANEndToEnd
	r.endToEnd, _ = sustained(b, p, payload, 64, 15*time.Second)

	proxy.Close()
	eventually(b, 30*time.Second, "the broker away", func() bool { return readyzSaysBrokerAway(p) })
	queued := postFor(b, p, payload, 64, 10*time.Second)
	r.taking = float64(queued) / 10
	proxy.Reopen()
	start := time.Now()
	eventually(b, 10*time.Minute, "the outbox forwarded", func() bool {
		return scrape(b, p.url+"/metrics")["switchyard_outbox_messages"] == 0
	})
	r.forwarding = float64(queued) / time.Since(start).Seconds()
	return r
}

// readyzSaysBrokerAway reports whether p's /readyz names its broker
// unreachable.
func readyzSaysBrokerAway(p *benchProcess) bool {
	req, err := http.NewRequest(http.MethodGet, p.url+"/readyz", nil)
	if err != nil {
		return false
	}
	code, body, err := doQuiet(http.DefaultClient, req)
	return err == nil && code == http.StatusOK && strings.Contains(body, `"broker":"unreachable"`)
}

// postFor posts bot webhooks from clients goroutines for d and returns how
// many were answered 202; any other answer fails the bench.
func postFor(b testing.TB, p *benchProcess, payload []byte, clients int, d time.Duration) int {
	body := newBotBody(b, payload)
	load := newLoadClient(p.url, clients)
	prefix := "away-" + randHex(3) + "-"
	var posted, accepted atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	deadline := time.Now().Add(d)
	for range clients {
		wg.Go(func() {
			for time.Now().Before(deadline) && failed.Load() == nil {
				if _, err := botPost(load, fmt.Sprintf("%s%d", prefix, posted.Add(1)), body); err != nil {
					failed.CompareAndSwap(nil, err)
					return
				}
				accepted.Add(1)
			}
		})
	}
	wg.Wait()
	if err := failed.Load(); err != nil {
		b.Fatalf("a webhook while the broker is away: %v", err)
	}
	return int(accepted.Load())
}
