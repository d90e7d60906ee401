package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// benchTracing is the end-to-end rate at rtt with the default config,
// tracing off and on (sample ratio 1, OTLP over HTTP to a sink in the
// bench that takes every export), side by side on one vhost and link, and
// the spans' bytes the sink took per webhook.
func benchTracing(b *testing.B, payload []byte, rtt time.Duration) (off, on, bytesPer float64) {
	var took atomic.Int64
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		took.Add(n)
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer sink.Close()
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANProxy(b, testBrokerAddr(), rtt)
	run := func(p *benchProcess) (float64, int) {
		defer p.stop(b)
		sustained(b, p, payload, 64, time.Second) // warm, as benchWANEndToEnd
		return sustained(b, p, payload, 64, 30*time.Second)
	}
	off, _ = run(startBenchProcess(b, proxy.URL(vhost), ""))
	t0 := took.Load()
	on, n := run(startBenchProcess(b, proxy.URL(vhost), "", fmt.Sprintf("tracing.endpoint = %q", sink.URL), "tracing.sample_ratio = 1"))
	return off, on, float64(took.Load()-t0) / float64(max(n, 1))
}
