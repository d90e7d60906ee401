package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// beforeTracing is the last commit before tracing came in: the daemon that
// tracing off is measured against.
const beforeTracing = "258b02c^"

// benchTracing is the end-to-end rate at rtt with the default config, of
// the binary before tracing came in (beforeTracing), and of this one with
// tracing off and on (sample ratio 1, OTLP over HTTP to a sink in the bench
// that takes every export), side by side on one vhost and link, and the
// spans' bytes the sink took per webhook.
func benchTracing(b *testing.B, payload []byte, rtt time.Duration) (before, off, on, bytesPer float64) {
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
	before, _ = run(startBenchBinary(b, binaryAt(b, beforeTracing), proxy.URL(vhost), ""))
	off, _ = run(startBenchProcess(b, proxy.URL(vhost), ""))
	t0 := took.Load()
	on, n := run(startBenchProcess(b, proxy.URL(vhost), "", fmt.Sprintf("tracing.endpoint = %q", sink.URL), "tracing.sample_ratio = 1"))
	return before, off, on, float64(took.Load()-t0) / float64(max(n, 1))
}

// binaryAt builds switchyard as it was at rev, a commit of this clone's
// history, with the flags of builtBinary.
func binaryAt(b testing.TB, rev string) string {
	b.Helper()
	dir := b.TempDir()
	extract := exec.Command("sh", "-c", `git archive --format=tar "$1" | tar -x -C "$2"`, "sh", rev, dir)
	if out, err := extract.CombinedOutput(); err != nil {
		b.Fatalf("switchyard at %s: %v: %s", rev, err, out)
	}
	build := exec.Command("go", "build", buildFlags, "-o", "switchyard", ".")
	build.Dir, build.Env = dir, append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		b.Fatalf("switchyard at %s: %v: %s", rev, err, out)
	}
	return filepath.Join(dir, "switchyard")
}
