package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
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
// that takes every export), on one vhost and link, in turns, and the
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
	old := binaryAt(b, beforeTracing)
	daemons := []func(extra ...string) *benchProcess{
		func(extra ...string) *benchProcess { return startBenchBinary(b, old, proxy.URL(vhost), "", extra...) },
		func(extra ...string) *benchProcess { return startBenchProcess(b, proxy.URL(vhost), "", extra...) },
		func(extra ...string) *benchProcess {
			return startBenchProcess(b, proxy.URL(vhost), "", append(extra, fmt.Sprintf("tracing.endpoint = %q", sink.URL), "tracing.sample_ratio = 1")...)
		},
	}
	// Three rounds of 10 s each, the daemons in turn: the machine's
	// drift over the row falls on all three alike. The sink's bytes are
	// of every webhook a daemon took, the warming ones too. BENCH_PROFILE
	// profiles tracing off and on over 6 s of the last round
	// (tracing-off-RTT.pprof, tracing-on-RTT.pprof).
	var counted, posted [3]int
	var spent [3]time.Duration
	var sunk [3]int64
	for round := range 3 {
		for i, start := range daemons {
			bp := &benchProfile{}
			if round == 2 && i > 0 {
				bp = newBenchProfile(b, profileName([]string{"", "tracing-off", "tracing-on"}[i], rtt, 0))
			}
			took0 := took.Load()
			p := start(bp.config...)
			_, warm := sustained(b, p, payload, 64, time.Second) // warm, as benchWANEndToEnd
			t := time.Now()
			profiled := bp.take(b, 2*time.Second, 6*time.Second)
			_, got := sustained(b, p, payload, 64, 10*time.Second)
			spent[i] += time.Since(t)
			profiled()
			counted[i], posted[i] = counted[i]+got, posted[i]+warm+got
			p.stop(b) // flushes its spans
			sunk[i] += took.Load() - took0
		}
	}
	rate := func(i int) float64 { return float64(counted[i]) / spent[i].Seconds() }
	return rate(0), rate(1), rate(2), float64(sunk[2]) / float64(max(posted[2], 1))
}

// beforeOutbox is the last commit before the outbox came in: the daemon
// whose door waited for the broker's confirm, which the open-loop rows
// measure the outbox against.
const beforeOutbox = "4459593"

// binaryBefore is the binary the open-loop rows compare with: the file
// SWITCHYARD_BENCH_BINARY names, else switchyard at beforeOutbox, built
// once per run.
func binaryBefore(b testing.TB) string {
	if p := os.Getenv("SWITCHYARD_BENCH_BINARY"); p != "" {
		return p
	}
	beforeOnce.Do(func() { beforePath = binaryAt(b, beforeOutbox) })
	return beforePath
}

var (
	beforeOnce sync.Once
	beforePath string
)

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
