package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The WAN link of the field rows: a proxy (newWANProxy) that delays each
// direction by half the round trip and, with a bandwidth, sends each
// direction's bytes no faster than it, every connection through the proxy
// sharing it, as a VPS's uplink is shared.

// wanLink is one direction of a link of a bandwidth: each chunk leaves
// after the ones before it, whichever connection sent them, at the link's
// rate.
type wanLink struct {
	bytesPerSecond float64 // 0: no limit
	mu             sync.Mutex
	free           time.Time // when the link has sent what it was given
}

// departs is when n bytes given to the link at now have left it.
func (l *wanLink) departs(n int, now time.Time) time.Time {
	if l == nil || l.bytesPerSecond <= 0 {
		return now
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	start := now
	if l.free.After(now) {
		start = l.free
	}
	l.free = start.Add(time.Duration(float64(n) / l.bytesPerSecond * float64(time.Second)))
	return l.free
}

// newWANLink is newWANProxy with a bandwidth of mbit Mbit/s each way (0:
// none).
func newWANLink(t testing.TB, target string, rtt time.Duration, mbit float64) *tcpProxy {
	t.Helper()
	p := newWANProxy(t, target, rtt)
	if mbit > 0 {
		p.mu.Lock()
		p.links = [2]*wanLink{{bytesPerSecond: mbit * 1e6 / 8}, {bytesPerSecond: mbit * 1e6 / 8}}
		p.mu.Unlock()
	}
	return p
}

// benchLinks are the bandwidths of the field rows' links in Mbit/s:
// BENCH_BW ("100,0"; 0 is a link without a limit), else none.
func benchLinks(b testing.TB) []float64 {
	spec := os.Getenv("BENCH_BW")
	if spec == "" {
		return []float64{0}
	}
	var out []float64
	for _, s := range strings.Split(spec, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil || v < 0 {
			b.Fatalf("BENCH_BW: %q is not a bandwidth in Mbit/s", s)
		}
		out = append(out, v)
	}
	return out
}

// linkName names a link in a row: its round trip, and its bandwidth when
// it has one.
func linkName(rtt time.Duration, mbit float64) string {
	if mbit > 0 {
		return fmt.Sprintf("%s, %g Mbit/s", rtt, mbit)
	}
	return rtt.String()
}

// A link of a bandwidth holds bytes back by their size over it, whoever
// sends them: the departures of chunks given at once follow each other.
func TestWANLinkBandwidth(t *testing.T) {
	t.Parallel()
	l := &wanLink{bytesPerSecond: 100e6 / 8} // 100 Mbit/s
	now := time.Now()
	first := l.departs(125000, now) // 1 Mbit: 10 ms
	second := l.departs(125000, now)
	if first.Sub(now) != 10*time.Millisecond || second.Sub(now) != 20*time.Millisecond {
		t.Errorf("departures %s and %s after now, want 10ms and 20ms", first.Sub(now), second.Sub(now))
	}
	if later := l.departs(1, now.Add(time.Second)); later.Sub(now.Add(time.Second)) > time.Microsecond {
		t.Errorf("an idle link holds a byte %s", later.Sub(now.Add(time.Second)))
	}
	var none *wanLink
	if got := none.departs(1<<20, now); !got.Equal(now) {
		t.Errorf("a link without a limit holds bytes until %s", got)
	}
}
