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

// spoolRates are what the spool takes and gives back on one store, beside
// the end-to-end rate of the same daemon with the broker there.
type spoolRates struct {
	endToEnd float64 // webhooks/s, the broker there, stored to the typed row
	spooling float64 // webhooks/s answered 202 while the broker is away
	draining float64 // spooled webhooks/s published once the broker is back
}

// benchSpool: one daemon over amqps at rtt with the default config (store
// "sqlite" or "postgres"), 64 clients: end to end for 15 s with the broker
// there; then the link closed and 64 clients for 10 s, every webhook
// answered 202 from the spool; then the link open again, and the time
// until the spool is empty.
func benchSpool(b *testing.B, payload []byte, rtt time.Duration, store string) (r spoolRates) {
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
	eventually(b, 30*time.Second, "the broker away", func() bool { return spoolsForAwayBroker(p) })
	spooled := postFor(b, p, payload, 64, 10*time.Second)
	r.spooling = float64(spooled) / 10
	proxy.Reopen()
	start := time.Now()
	eventually(b, 10*time.Minute, "the spool drained", func() bool {
		return scrape(b, p.url+"/metrics")["switchyard_spool_messages"] == 0
	})
	r.draining = float64(spooled) / time.Since(start).Seconds()
	return r
}

// spoolsForAwayBroker reports whether p's /readyz says it spools for a broker it
// cannot reach.
func spoolsForAwayBroker(p *benchProcess) bool {
	req, err := http.NewRequest(http.MethodGet, p.url+"/readyz", nil)
	if err != nil {
		return false
	}
	code, body, err := doQuiet(http.DefaultClient, req)
	return err == nil && code == http.StatusOK && strings.Contains(body, `"spool"`) && strings.Contains(body, "unreachable")
}

// postFor posts bot webhooks from clients goroutines for d and returns how
// many were answered 202; any other answer fails the bench.
func postFor(b testing.TB, p *benchProcess, payload []byte, clients int, d time.Duration) int {
	body := newBotBody(b, payload)
	load := newLoadClient(p.url, clients)
	prefix := "spool-" + randHex(3) + "-"
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
