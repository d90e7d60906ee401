package main

import (
	"cmp"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Open-loop load, as GitHub sends: webhooks due at a fixed arrival rate,
// each sent at its time whatever the earlier ones take, its latency
// counted from the moment it was due (a closed loop of clients waiting
// for their answers would send less when answers slow, and hide the
// queueing a slow answer causes). The rate is stepped up by a quarter
// until the p99 of the answers passes a second, one is refused, or what
// was answered is not through end to end (stored, or taken by the raw
// pipeline's consumers) within 2 s of the step's last answer: the last
// rate held is the sustained rate. An answer alone is not enough: a
// pipeline that confirms faster than its consumers take is not keeping
// up, only filling its queues.

// openLoopStep is one rate held for d.
type openLoopStep struct {
	rate    float64
	p50     time.Duration
	p99     time.Duration
	slowest time.Duration
	refused int
	sent    int
	// lag is how long after the step's last answer every webhook it sent
	// was through end to end, up to a little past openLoopLag.
	lag time.Duration
}

// openLoopLag is how far behind its answers a step's end-to-end work may
// fall and the step still hold.
const openLoopLag = 2 * time.Second

// held reports whether the step kept its answers within a second, refused
// none, and kept its end-to-end work within openLoopLag of them.
func (s openLoopStep) held() bool {
	return s.refused == 0 && s.p99 <= time.Second && s.lag <= openLoopLag
}

// openLoopAt sends one request a 1/rate apart for d through send, each in
// its own goroutine at its due time, and waits for every answer (send
// returns once it has one, its error for a refusal).
func openLoopAt(rate float64, d time.Duration, send func(i int) error) openLoopStep {
	n := int(rate * d.Seconds())
	lat := make([]time.Duration, n)
	var refused atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		due := start.Add(time.Duration(float64(i) / rate * float64(time.Second)))
		if wait := time.Until(due); wait > 0 {
			time.Sleep(wait)
		}
		wg.Go(func() {
			if err := send(i); err != nil {
				refused.Add(1)
			}
			lat[i] = time.Since(due)
		})
	}
	wg.Wait()
	slices.Sort(lat)
	step := openLoopStep{rate: rate, refused: int(refused.Load()), sent: n}
	if n > 0 {
		step.p50, step.p99, step.slowest = lat[n/2], lat[n*99/100], lat[n-1]
	}
	return step
}

// sustainedOpenLoop steps the rate up from from by a quarter, 8 s a step,
// until a step does not hold; it returns the last step held (a zero step
// when the first did not) and the first that did not. through is how many
// of the webhooks sent so far are through end to end.
func sustainedOpenLoop(from float64, send func(i int) error, through func() int) (held, broke openLoopStep) {
	offset := 0
	for rate := from; ; rate *= 1.25 {
		step := openLoopAt(rate, 8*time.Second, func(i int) error { return send(offset + i) })
		offset += step.sent
		step.lag = lagBehind(offset, through)
		if !step.held() {
			return held, step
		}
		held = step
	}
}

// lagBehind is how long through took to reach want, looked at every 20 ms
// up to a little past openLoopLag.
func lagBehind(want int, through func() int) time.Duration {
	start := time.Now()
	for through() < want && time.Since(start) <= openLoopLag {
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

// openLoopDaemon is one daemon's open loop over a link: its sustained
// rate (the last step held, and the first that broke), the p99 of its
// answers at half that rate, a burst of twice it for 2 s, and where the
// time went at it.
type openLoopDaemon struct {
	held, broke openLoopStep
	// halfRateP99 is the p99 of the answers at half the sustained rate as
	// the load saw them, and daemonP99 as the daemon's histogram of them
	// did (from its arrival to its answer written; 0 for a binary without
	// it): the difference is the load's side and the loopback between.
	halfRateP99, daemonP99 time.Duration
	// flush is what a 16 KiB write and its fsync took on the database's
	// disk during that step (p50, p99): a 202 waits for one commit's
	// flush at least, and often for the one under way too, so this is
	// the floor the machine sets the p99 at (flushGauge).
	flush [2]time.Duration
	twice openLoopStep
	// The CPU a webhook cost at the sustained rate, held for a step until
	// every webhook was stored: the daemon's, the broker's and the
	// bench's (the load's generator and the link's proxy), where the
	// two cores' time goes, and how busy that kept them; and the share of
	// the daemon's that was its garbage collector (-1 when it does not
	// say: a binary from before it did).
	daemon, broker, bench time.Duration
	busy, gcShare         float64
}

// openLoopRates are switchyard's open loop over a link, the binary's from
// before the outbox over the same link (when measured), and the raw
// pipeline's sustained rate (its confirms).
type openLoopRates struct {
	ours, before     openLoopDaemon
	raw, rawBroke    openLoopStep
	measuredBaseline bool
}

// benchOpenLoop: switchyard with the default config over amqps at rtt
// (a bandwidth of mbit Mbit/s, 0 for none), stepped up from 100
// webhooks/s; with baselines, then the binary before the outbox
// (binaryBefore) the same way, and the raw pipeline publishing the
// payloads as they are.
func benchOpenLoop(b *testing.B, payload []byte, rtt time.Duration, mbit float64, baselines bool) (r openLoopRates) {
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANLink(b, testBrokerAddr(), rtt, mbit)
	prof := newBenchProfile(b, profileName("open-loop", rtt, mbit))
	r.ours = openLoopOf(b, startBenchProcess(b, proxy.URL(vhost), "", prof.config...), prof, payload)
	if baselines {
		r.measuredBaseline = true
		r.before = openLoopOf(b, startBenchBinary(b, binaryBefore(b), proxy.URL(vhost), ""), &benchProfile{}, payload)
		r.raw, r.rawBroke = rawOpenLoop(b, proxy.URL(vhost), payload)
	}
	return r
}

// openLoopOf steps p's open loop up from 100 webhooks/s, then measures it
// at half and twice the rate it held, and at that rate where its CPU
// goes; p is stopped at the end.
func openLoopOf(b *testing.B, p *benchProcess, prof *benchProfile, payload []byte) (r openLoopDaemon) {
	defer p.stop(b)
	brokerCPU := brokerCPU(b)
	body := newBotBody(b, payload)
	client := newLoadClient(p.url, 512)
	prefix := "open-" + randHex(3) + "-"
	var accepted atomic.Int64
	post := func(i int) error {
		_, err := botPost(client, fmt.Sprintf("%s%d", prefix, i), body)
		if err == nil {
			accepted.Add(1)
		}
		return err
	}
	sustained(b, p, payload, 64, time.Second) // warm, as benchWANEndToEnd
	db := openStoreDB(b, p.database)
	// Counted through the unique indexes (a LIKE would read every row's
	// page, payloads and all, each time: the bench's own load on the
	// disk and the cores it measures).
	stored := func() int {
		return min(queryInt(b, db, "SELECT count(*) FROM github WHERE delivery_id >= $1 AND delivery_id < $2", prefix, prefix+"~"),
			queryInt(b, db, "SELECT count(*) FROM github_pull_requests WHERE node_id >= $1 AND node_id < $2", "node-"+prefix, "node-"+prefix+"~"))
	}
	r.held, r.broke = sustainedOpenLoop(100, post, stored)
	// What a step left (a backlog in the outbox, or of stored rows) is
	// gone before the next measure begins: it would take the cores from
	// it.
	caughtUp := func() {
		eventually(b, 10*time.Minute, "every webhook accepted stored", func() bool { return stored() >= int(accepted.Load()) })
	}
	caughtUp()
	if r.held.rate == 0 {
		return r
	}
	answered := func() map[string]float64 { return scrape(b, prof.metrics(p)) }
	before := answered()
	// The binary before the outbox is gauged too, though only ours is
	// printed: both half steps share the disk with the same extra flushes.
	flushed := flushGauge(b, filepath.Dir(p.dbPath))
	half := openLoopAt(r.held.rate/2, 8*time.Second, func(i int) error { return post(1_000_000 + i) })
	r.flush = flushed()
	r.halfRateP99 = half.p99
	r.daemonP99 = histogramQuantile(before, answered(), "switchyard_webhook_duration_seconds", `outcome="accepted"`, 0.99)
	caughtUp()
	r.twice = openLoopAt(2*r.held.rate, 2*time.Second, func(i int) error { return post(3_000_000 + i) })
	caughtUp()
	// Where the time goes at the sustained rate: each process's CPU a
	// webhook over a step, until every one is stored (and, with
	// BENCH_PROFILE, the daemon's profile of 6 s of it).
	profiled := prof.take(b, time.Second, 6*time.Second)
	gc := func() (float64, bool) {
		v, ok := scrape(b, prof.metrics(p))["go_cpu_classes_gc_total_cpu_seconds_total"]
		return v, ok
	}
	gc0, gcKnown := gc()
	start, d0, b0, s0 := time.Now(), p.cpu(b), brokerCPU(), selfCPU()
	at := openLoopAt(r.held.rate, 8*time.Second, func(i int) error { return post(2_000_000 + i) })
	caughtUp()
	d, br, s := p.cpu(b)-d0, brokerCPU()-b0, selfCPU()-s0
	gc1, _ := gc()
	per := func(d time.Duration) time.Duration { return d / time.Duration(max(at.sent, 1)) }
	r.daemon, r.broker, r.bench = per(d), per(br), per(s)
	r.busy = (d + br + s).Seconds() / time.Since(start).Seconds() / float64(runtime.NumCPU())
	r.gcShare = -1
	if gcKnown && d > 0 {
		r.gcShare = (gc1 - gc0) / d.Seconds()
	}
	profiled()
	return r
}

// flushGauge writes 16 KiB into a file of its own in dir and flushes it
// (fsync), every 25 ms, until the function it returns is called, which
// returns the p50 and p99 of what each write and flush took. The disk's
// flush is the part of a commit no code of ours shortens, and the same VM's
// moved from 0.2 ms (p99, idle) to 10 ms under the broker's and the
// daemon's own flushes; 40 a second add little to theirs (some 600).
func flushGauge(b testing.TB, dir string) func() [2]time.Duration {
	f, err := os.CreateTemp(dir, "flush-gauge-*")
	if err != nil {
		b.Fatal(err)
	}
	stop, done := make(chan struct{}), make(chan []time.Duration)
	go func() {
		block := make([]byte, 16<<10)
		var took []time.Duration
		tick := time.NewTicker(25 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				done <- took
				return
			case <-tick.C:
			}
			start := time.Now()
			if _, err := f.WriteAt(block, 0); err == nil && f.Sync() == nil {
				took = append(took, time.Since(start))
			}
		}
	}()
	return func() [2]time.Duration {
		close(stop)
		took := <-done
		f.Close()
		os.Remove(f.Name())
		if len(took) == 0 {
			b.Fatalf("flush gauge: no write and flush succeeded in %s", dir)
		}
		slices.Sort(took)
		return [2]time.Duration{took[len(took)/2], took[len(took)*99/100]}
	}
}

// histogramQuantile is the q quantile of what the Prometheus histogram
// name observed between two scrapes, in its series whose labels hold
// match, interpolated within the bucket it falls in as PromQL's
// histogram_quantile does; 0 when it observed nothing.
func histogramQuantile(before, after map[string]float64, name, match string, q float64) time.Duration {
	type bucket struct{ le, n float64 }
	var buckets []bucket
	for k, v := range after {
		labels, ok := strings.CutPrefix(k, name+"_bucket{")
		le := bucketBound.FindStringSubmatch(labels)
		if !ok || le == nil || !strings.Contains(labels, match) {
			continue
		}
		if bound, err := strconv.ParseFloat(le[1], 64); err == nil { // "+Inf" too
			buckets = append(buckets, bucket{bound, v - before[k]})
		}
	}
	slices.SortFunc(buckets, func(a, b bucket) int { return cmp.Compare(a.le, b.le) })
	if len(buckets) == 0 || buckets[len(buckets)-1].n == 0 {
		return 0
	}
	want := q * buckets[len(buckets)-1].n
	lower, below := 0.0, 0.0
	for _, bk := range buckets {
		if bk.n >= want {
			if math.IsInf(bk.le, 1) {
				return time.Duration(lower * float64(time.Second)) // past the last bound: the bound
			}
			at := lower + (bk.le-lower)*(want-below)/(bk.n-below) // below < want <= bk.n
			return time.Duration(at * float64(time.Second))
		}
		lower, below = bk.le, bk.n
	}
	return 0
}

// bucketBound is a histogram bucket's bound among its labels.
var bucketBound = regexp.MustCompile(`(?:^|,)le="([^"]+)"`)

// The bench's quantile of a histogram between two scrapes reads as
// PromQL's histogram_quantile: interpolated within its bucket, from the
// observations between the scrapes only.
func TestHistogramQuantile(t *testing.T) {
	t.Parallel()
	series := func(counts ...float64) map[string]float64 {
		m := map[string]float64{`other_bucket{le="0.001"}`: 99, `h_bucket{outcome="forbidden",le="0.001"}`: 99}
		for i, le := range []string{"0.001", "0.002", "0.005", "+Inf"} {
			m[`h_bucket{outcome="accepted",le="`+le+`"}`] = counts[i] // as client_golang writes them: le last
		}
		return m
	}
	before := series(10, 10, 10, 10)
	for _, c := range []struct {
		after []float64
		q     float64
		want  time.Duration
	}{
		{[]float64{10, 10, 10, 10}, 0.99, 0},                                          // nothing between
		{[]float64{60, 110, 110, 110}, 0.5, time.Millisecond},                         // 50 of 100 in the first bucket
		{[]float64{60, 110, 110, 110}, 0.99, time.Millisecond + 980*time.Microsecond}, // 99th: 49 into the second bucket's 50
		{[]float64{10, 10, 110, 110}, 0.99, 2*time.Millisecond + 2970*time.Microsecond},
		{[]float64{10, 10, 10, 110}, 0.99, 5 * time.Millisecond}, // past the last bound: the bound
	} {
		got := histogramQuantile(before, series(c.after...), "h", `outcome="accepted"`, c.q)
		if got.Round(time.Microsecond) != c.want.Round(time.Microsecond) {
			t.Errorf("q %.2f of %v: %v, want %v", c.q, c.after, got, c.want)
		}
	}
}
