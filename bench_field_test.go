package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The field rows: switchyard as its users run it, against a
// broker across a WAN link over amqps, with the default config. Each raw
// baseline goes through the same proxy at the same concurrency.

// benchRTTs are the round-trip times of the WAN rows: BENCH_RTT, else
// 20 ms and 50 ms.
func benchRTTs(b testing.TB) []time.Duration {
	spec := os.Getenv("BENCH_RTT")
	if spec == "" {
		spec = "20ms,50ms"
	}
	var out []time.Duration
	for _, s := range strings.Split(spec, ",") {
		d, err := time.ParseDuration(strings.TrimSpace(s))
		if err != nil {
			b.Fatalf("BENCH_RTT: %v", err)
		}
		out = append(out, d)
	}
	return out
}

// benchProcess is the real binary, serving with a config of defaults but
// for what a bench must set.
type benchProcess struct {
	cmd    *exec.Cmd
	addr   string
	dbPath string
	url    string
	// database is its store: the SQLite file at dbPath, or PostgreSQL
	// (startBenchNode).
	database DatabaseConfig
}

// startBenchProcess runs `switchyard serve` over brokerURL with the default
// config (topology declared beforehand, as production brokers are), plus
// extra TOML lines in their sections ("queue.prefetch = 64"), which replace
// the bench's own setting of the same key.
func startBenchProcess(b testing.TB, brokerURL, dbPath string, extra ...string) *benchProcess {
	b.Helper()
	return startBenchBinary(b, builtBinary(b), brokerURL, dbPath, extra...)
}

// startBenchBinary is startBenchProcess with the daemon of the binary bin.
func startBenchBinary(b testing.TB, bin, brokerURL, dbPath string, extra ...string) *benchProcess {
	b.Helper()
	dir := b.TempDir()
	if dbPath == "" {
		dbPath = filepath.Join(dir, "bench.db")
	}
	addr := freeAddr(b)
	sections := map[string][]string{
		"server":   {fmt.Sprintf("listen = %q", addr), fmt.Sprintf("metrics_listen = %q", addr)},
		"database": {fmt.Sprintf("path = %q", dbPath)},
		"api":      {`operator_token = "bench-operator-token-0123456789abcdef"`, `producer_token = "bench-producer-token-0123456789abcdef"`},
		"github":   {fmt.Sprintf("webhook_secret = %q", testSecret), `allowed_cidrs = ["127.0.0.0/8"]`, fmt.Sprintf("bot_app_id = %d", testBotAppID)},
		"log":      {`level = "warn"`},
	}
	for _, e := range extra {
		section, line, _ := strings.Cut(e, ".")
		key, _, _ := strings.Cut(line, "=")
		sections[section] = slices.DeleteFunc(sections[section], func(l string) bool {
			k, _, _ := strings.Cut(l, "=")
			return strings.TrimSpace(k) == strings.TrimSpace(key)
		})
		sections[section] = append(sections[section], line)
	}
	var text strings.Builder
	for _, s := range []string{"server", "database", "api", "github", "queue", "workers", "log", "tracing"} {
		if len(sections[s]) > 0 { // no empty section: a binary of before it knew the section refuses it
			fmt.Fprintf(&text, "[%s]\n%s\n", s, strings.Join(sections[s], "\n"))
		}
	}
	fmt.Fprintf(&text, "[[brokers]]\nurl = %q\n", brokerURL)
	config := filepath.Join(dir, "bench.toml")
	if err := os.WriteFile(config, []byte(text.String()), 0o600); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(bin, "serve", "-config", config)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	p := &benchProcess{cmd: cmd, addr: addr, dbPath: dbPath, url: "http://" + addr,
		database: DatabaseConfig{Driver: "sqlite", Path: dbPath}}
	eventually(b, 30*time.Second, "daemon up", func() bool {
		resp, err := http.Get(p.url + "/readyz")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == http.StatusOK
	})
	return p
}

// peakRSS is the process's VmHWM in MB.
func (p *benchProcess) peakRSS(b testing.TB) float64 {
	_, peak := rss(b, p.cmd.Process.Pid)
	return float64(peak) / (1 << 20)
}

// cpu is the process's user + system CPU time so far.
func (p *benchProcess) cpu(b testing.TB) time.Duration { return procCPU(b, p.cmd.Process.Pid) }

// procCPU is process pid's user + system CPU time so far.
func procCPU(b testing.TB, pid int) time.Duration {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	return statCPU(stat)
}

// statCPU is the user + system CPU time of a /proc/PID/stat line.
func statCPU(stat []byte) time.Duration {
	// Fields after the command name (which may hold spaces): utime is the
	// 14th field of the line, stime the 15th, in clock ticks (100 a second).
	rest := string(stat[bytes.LastIndexByte(stat, ')')+2:])
	f := strings.Fields(rest)
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// brokerCPU returns a reader of the local RabbitMQ's (beam.smp's) CPU time
// so far; it reads 0 when this machine has no broker process this one may
// read.
func brokerCPU(b testing.TB) func() time.Duration {
	return func() time.Duration { return commCPU("beam.smp") }
}

// commCPU is the CPU time so far of the processes named comm that are
// alive: the local PostgreSQL's are its server and a backend per
// connection (those of a pool live as long as it).
func commCPU(comm string) time.Duration {
	var sum time.Duration
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if c, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err != nil || strings.TrimSpace(string(c)) != comm {
			continue
		}
		if stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
			sum += statCPU(stat)
		}
	}
	return sum
}

// selfCPU is this process's user + system CPU time so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchWANIngest: 64 clients POST through the daemon to a broker behind the
// WAN proxy, against 64 goroutines publishing the same message with a
// confirm each over one amqps connection through the same proxy. Rounds
// alternate, on purged queues.
func benchWANIngest(b *testing.B, payload []byte, rtt time.Duration, mbit float64) (ours, base float64) {
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANLink(b, testBrokerAddr(), rtt, mbit)
	cfg := testConfig(b, proxy.URL(vhost))
	cfg.Queue.DeclareTopology = false
	return ingestRounds(b, cfg, vhost, proxy.URL(vhost), payload, 64, 4, 1000)
}

// wanEndToEnd is a row of benchWANEndToEnd: the daemon's rate, the raw
// pipeline's moving the payloads as they are and moving them
// zstd-compressed; the CPU per webhook of the daemon, the broker (under
// each of the three) and this process; the bytes per webhook the link
// carried for each; and how long the compressed raw pipeline's publishes
// waited for their confirms, on average.
type wanEndToEnd struct {
	rate, raw, rawPacked                              float64
	daemon, broker, bench, rawBroker, rawPackedBroker time.Duration
	bytes, rawBytes, rawPackedBytes                   float64
	rawPackedConfirm                                  time.Duration
}

// benchWANEndToEnd: the real binary with the default config over amqps to a
// broker behind the WAN proxy, 64 clients for 30 s: the rate, and the CPU
// per webhook of the daemon (its 202 and both rows), of the broker and of
// this process (the load generator and the proxy), which share the two
// cores: steadier than the rate, and what says which of them bounds it.
// Beside it the raw pipeline, twice: moving the payloads as they are (what
// a user gets without switchyard), and moving the same payloads
// zstd-compressed at the fastest level (what the broker allows for the
// bytes switchyard moves).
func benchWANEndToEnd(b *testing.B, payload []byte, rtt time.Duration, mbit float64) (r wanEndToEnd) {
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANLink(b, testBrokerAddr(), rtt, mbit)
	brokerCPU := brokerCPU(b)
	// The baselines first, on the same vhost and proxy: its queues are
	// empty again when each returns.
	m0, b0 := proxy.moved.Load(), brokerCPU()
	var n int
	r.raw, n, _ = rawPipeline(b, proxy.URL(vhost), payload, false, 64, 30*time.Second)
	r.rawBytes, r.rawBroker = float64(proxy.moved.Load()-m0)/float64(n), (brokerCPU()-b0)/time.Duration(n)
	m0, b0 = proxy.moved.Load(), brokerCPU()
	r.rawPacked, n, r.rawPackedConfirm = rawPipeline(b, proxy.URL(vhost), payload, true, 64, 30*time.Second)
	r.rawPackedBytes, r.rawPackedBroker = float64(proxy.moved.Load()-m0)/float64(n), (brokerCPU()-b0)/time.Duration(n)
	prof := newBenchProfile(b, profileName("e2e", rtt, mbit))
	p := startBenchProcess(b, proxy.URL(vhost), "", prof.config...)
	defer p.stop(b) // idle, it would still cost the rows after it
	// A second of webhooks first, not counted, stored before the clock
	// starts: the row is the rate the daemon sustains, and a daemon opens
	// its confirm lanes (two round trips each) on its first publishes.
	// Counted, that cost the row about 2 % at 50 ms (four pairs, cold
	// 966-1,074, warm 1,026-1,078 webhooks/s).
	sustained(b, p, payload, 64, time.Second)
	profiled := prof.take(b, 5*time.Second, 20*time.Second)
	d0, b0, s0, m0 := p.cpu(b), brokerCPU(), selfCPU(), proxy.moved.Load()
	r.rate, n = sustained(b, p, payload, 64, 30*time.Second)
	profiled()
	per := func(d time.Duration) time.Duration { return d / time.Duration(n) }
	r.daemon, r.broker, r.bench = per(p.cpu(b)-d0), per(brokerCPU()-b0), per(selfCPU()-s0)
	r.bytes = float64(proxy.moved.Load()-m0) / float64(n)
	return r
}

// benchProfile is BENCH_PROFILE=DIR: a CPU profile of a daemon over a
// row's stream, written to DIR/NAME.pprof through server.pprof.
type benchProfile struct {
	config []string // the daemon's config for it; none without BENCH_PROFILE
	addr   string   // its metrics listener
	path   string
}

func newBenchProfile(b testing.TB, name string) *benchProfile {
	dir := os.Getenv("BENCH_PROFILE")
	if dir == "" {
		return &benchProfile{}
	}
	addr := freeAddr(b)
	return &benchProfile{
		config: []string{"server.pprof = true", fmt.Sprintf("server.metrics_listen = %q", addr)},
		addr:   addr, path: filepath.Join(dir, name+".pprof"),
	}
}

// profileName names a row's profile by its link: e2e-20ms, e2e-20ms-100mbit.
func profileName(row string, rtt time.Duration, mbit float64) string {
	if mbit > 0 {
		return fmt.Sprintf("%s-%s-%gmbit", row, rtt, mbit)
	}
	return fmt.Sprintf("%s-%s", row, rtt)
}

// metrics is the URL of p's /metrics: on the main listener, or on the
// profile's own.
func (bp *benchProfile) metrics(p *benchProcess) string {
	if bp.addr != "" {
		return "http://" + bp.addr + "/metrics"
	}
	return p.url + "/metrics"
}

// take starts a profile of d after into the stream about to begin; wait
// returns once it is written.
func (bp *benchProfile) take(b testing.TB, after, d time.Duration) (wait func()) {
	if bp.path == "" {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		time.Sleep(after)
		resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", bp.addr, int(d.Seconds())))
		if err != nil {
			b.Errorf("profile: %v", err)
			return
		}
		defer resp.Body.Close()
		f, err := os.Create(bp.path)
		if err != nil {
			b.Errorf("profile: %v", err)
			return
		}
		defer f.Close()
		_, _ = io.Copy(f, resp.Body)
	}()
	return func() { <-done }
}

// startBenchNode is startBenchProcess on the PostgreSQL database at
// pgURL, as node name.
func startBenchNode(b testing.TB, brokerURL, pgURL, name string, extra ...string) *benchProcess {
	b.Helper()
	p := startBenchProcess(b, brokerURL, "", append([]string{`database.driver = "postgres"`, fmt.Sprintf("database.url = %q", pgURL),
		fmt.Sprintf("server.node_name = %q", name)}, extra...)...)
	p.database = DatabaseConfig{Driver: "postgres", URL: pgURL}
	return p
}

// benchPostgres: end to end over amqps at rtt with the default config, on
// SQLite and then on PostgreSQL, 64 clients for 30 s each, in one run; then
// two nodes on that PostgreSQL, 32 clients each, the same machine's cores
// shared by both. cpu is the CPU per webhook of the one node on
// PostgreSQL, its server's (the local PostgreSQL's processes) and the
// broker's; BENCH_PROFILE profiles that node (postgres-RTT.pprof).
func benchPostgres(b *testing.B, payload []byte, rtt time.Duration) (sqlite, pg, twoNodes float64, cpu [3]time.Duration) {
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANProxy(b, testBrokerAddr(), rtt)
	brokerCPU := brokerCPU(b)
	// run is the rate over nodes, and the CPU per webhook of the first
	// node, PostgreSQL and the broker.
	run := func(prof *benchProfile, nodes ...*benchProcess) (float64, [3]time.Duration) {
		sustainedOn(b, nodes, payload, 64, time.Second) // warm, as benchWANEndToEnd
		profiled := prof.take(b, 5*time.Second, 20*time.Second)
		d0, p0, b0 := nodes[0].cpu(b), commCPU("postgres"), brokerCPU()
		rate, n := sustainedOn(b, nodes, payload, 64, 30*time.Second)
		per := func(d time.Duration) time.Duration { return d / time.Duration(max(n, 1)) }
		cpu := [3]time.Duration{per(nodes[0].cpu(b) - d0), per(commCPU("postgres") - p0), per(brokerCPU() - b0)}
		profiled()
		for _, p := range nodes {
			p.stop(b)
		}
		return rate, cpu
	}
	sqlite, _ = run(&benchProfile{}, startBenchProcess(b, proxy.URL(vhost), ""))
	prof := newBenchProfile(b, fmt.Sprintf("postgres-%s", rtt))
	pg, cpu = run(prof, startBenchNode(b, proxy.URL(vhost), newPostgresDatabase(b), "bench-1", prof.config...))
	shared := newPostgresDatabase(b)
	twoNodes, _ = run(&benchProfile{}, startBenchNode(b, proxy.URL(vhost), shared, "bench-1"), startBenchNode(b, proxy.URL(vhost), shared, "bench-2"))
	return sqlite, pg, twoNodes, cpu
}

// stop ends the process and waits for it.
func (p *benchProcess) stop(b testing.TB) {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	_ = p.cmd.Wait()
}

// benchBurst: 2,000 webhooks at once from 200 connections, through a daemon
// whose broker is behind the WAN proxy; every answer must be 202.
func benchBurst(b *testing.B, payload []byte, rtt time.Duration) (p50, p99 float64) {
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANProxy(b, testBrokerAddr(), rtt)
	p := startBenchProcess(b, proxy.URL(vhost), "")
	defer p.stop(b) // idle, it would still cost the rows after it
	const n, conns = 2000, 200
	body := newBotBody(b, payload)
	client := newLoadClient(p.url, conns)
	lat := make([]float64, n)
	var next atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	start := make(chan struct{})
	for c := 0; c < conns; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
				d, err := botPost(client, fmt.Sprintf("burst-%d-%s", i, randHex(3)), body)
				if err != nil {
					failed.CompareAndSwap(nil, err)
				}
				lat[i] = float64(d.Microseconds()) / 1000
			}
		}()
	}
	close(start)
	wg.Wait()
	if err := failed.Load(); err != nil {
		b.Fatalf("burst: not every answer was 202: %v", err)
	}
	sort.Float64s(lat)
	return lat[n/2], lat[n*99/100]
}

// benchWANDrain: the Leftover Drain of 5,000 messages from a broker behind
// the WAN proxy, against a basic_get loop through the same proxy (over 200
// messages: at one round trip each, 5,000 would take minutes).
func benchWANDrain(b *testing.B, payload []byte, rtt time.Duration) (ours, base float64) {
	const n, baseN = 5000, 200
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANProxy(b, testBrokerAddr(), rtt)
	fillQueue(b, vhost, queueGitHub, payload, n)
	store, cfg := benchStore(b)
	defer store.Close()
	ours = drainRate(b, store, cfg, proxy.URL(vhost), n)

	fillQueue(b, vhost, queueGitHub, payload, baseN)
	conn, err := amqp.Dial(proxy.URL(vhost))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, _ := conn.Channel()
	start := time.Now()
	for i := 0; i < baseN; i++ {
		d, ok, err := ch.Get(queueGitHub, false)
		if err != nil || !ok {
			b.Fatalf("raw get: %v %v", ok, err)
		}
		rawInsert(b, store.w, d.MessageId, d.Body)
		_ = d.Ack(false)
	}
	return ours, baseN / time.Since(start).Seconds()
}

// benchDatabaseBytes: 10,000 webhooks of the real fixtures through the
// service and database-service handlers into a fresh database; its size
// per 10,000, and the share of it that is raw payload.
func benchDatabaseBytes(b *testing.B) (total, payloads int64, corpus string) {
	store, _ := benchStore(b)
	defer store.Close()
	svc, dbh := eventFunc(serviceHandler(nil, 0, false)), eventFunc(databaseHandler(testBotAppID))
	// The recorded corpus of GitHub's payloads when it lies beside the
	// repository, else the project's own.
	fixtures, corpus := loadFixtures(b), payloadDir
	if _, err := os.Stat(recordedCorpus); err == nil {
		fixtures, corpus = readFixtures(b, recordedCorpus), "the recorded corpus"
	}
	ctx := context.Background()
	// The database's size before: the schema's own pages are not the
	// payloads' cost.
	if _, err := store.w.Exec("PRAGMA wal_checkpoint(TRUNCATE)"); err != nil {
		b.Fatal(err)
	}
	empty, err := os.Stat(store.path)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < 10000; i += 100 {
		err := store.WriteTx(ctx, func(tx *Tx) error {
			for j := i; j < i+100; j++ {
				f := fixtures[j%len(fixtures)]
				msg := eventMessage(f.Event, fmt.Sprintf("size-%d", j), f.Body)
				msg.Headers[hdrTargetType], msg.Headers[hdrTargetID] = "integration", strconv.Itoa(testBotAppID)
				ev, err := DecodeEvent(delivered(msg))
				if err != nil {
					continue // a fixture the workers refuse is not stored either
				}
				payloads += int64(len(ev.Payload))
				if err := svc(ctx, tx, ev); err != nil {
					return err
				}
				var perm *MalformedError
				if err := dbh(ctx, tx, ev); err != nil && !errors.As(err, &perm) && !errors.Is(err, ErrDuplicate) {
					return err
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	if _, err := store.w.Exec("PRAGMA wal_checkpoint(TRUNCATE)"); err != nil {
		b.Fatal(err)
	}
	fi, err := os.Stat(store.path)
	if err != nil {
		b.Fatal(err)
	}
	return fi.Size() - empty.Size(), payloads, corpus
}

// benchSearchPages is the slowest first page of the deliveries search over
// the store's rows, among filters that match every row, some, or none.
func benchSearchPages(b *testing.B, store *Store) time.Duration {
	var slowest time.Duration
	for _, f := range []DeliveryFilter{{}, {Event: "pull_request"}, {Event: "issues"}, {Repository: "octo/repo"},
		{Sender: "nobody"}, {GUIDPrefix: "old-00012"}, {Outcome: "stale"}, {Outcome: "forbidden"},
		{From: time.Now().Add(-30 * 24 * time.Hour), To: time.Now().Add(-29 * 24 * time.Hour)}} {
		start := time.Now()
		if _, _, err := store.SearchDeliveries(context.Background(), f, deliveriesPageSize); err != nil {
			b.Fatal(err)
		}
		slowest = max(slowest, time.Since(start))
	}
	return slowest
}

// benchBigTable: end to end (localhost, default config, 64 clients) with
// 1,000,000 rows already in github, against an empty database, in rounds of
// 10 s taken big, empty, empty, big: the machine's speed drifts within a
// minute, and a ratio of two halves taken one after the other measured the
// drift as much as the table.
func benchBigTable(b *testing.B, payload []byte) (big, empty float64, slowestPage time.Duration) {
	dir := b.TempDir()
	full := filepath.Join(dir, "full.db")
	store, err := OpenStore(context.Background(), DatabaseConfig{Path: full, Synchronous: "NORMAL", BusyTimeout: 5 * time.Second}, nil)
	if err != nil {
		b.Fatal(err)
	}
	if _, _, err := store.Migrate(context.Background()); err != nil {
		b.Fatal(err)
	}
	// A million rows of deliveries, with a payload of 2 KB each, one every 7
	// seconds: 81 days, inside the default database.raw_retention (90 days),
	// as a busy App's table stands. (Spread over a year, the cleanup worker's
	// first cycle would delete 750,000 of them while the row is measured.)
	// Stored as serve stores them, compressed: rows of text, as an upgrade
	// leaves them, would have the cleanup worker compress them while the
	// row is measured (it read 0.88 so, 0.93-0.99 before the compression).
	packed := compressZstd(fmt.Appendf(nil, `{"pad":%q}`, strings.Repeat("0", 2000)))
	_, err = store.w.Exec(`WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000)
		INSERT INTO github (delivery_id, event, action, repository, sender, payload, payload_zstd, received_at, processed_at)
		SELECT printf('old-%07d', i), 'pull_request', 'opened', 'octo/repo', 'octocat', '', $1,
			strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('-%d seconds', (1000000 - i) * 7)),
			strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('-%d seconds', (1000000 - i) * 7))
		FROM n`, packed)
	if err != nil {
		b.Fatal(err)
	}
	slowestPage = benchSearchPages(b, store)
	store.Close()
	// Write the new file's 2 GB out before measuring: left to the kernel's
	// writeback, it competes with the measured daemon's fsyncs for the disk.
	syscall.Sync()
	type side struct {
		path string // "": a new, empty database each round
		n    int
		secs float64
	}
	full1M, fresh := &side{path: full}, &side{}
	for _, s := range []*side{full1M, fresh, fresh, full1M} {
		vhost := newVhost(b)
		declareTestTopology(b, vhost, 10*time.Minute)
		p := startBenchProcess(b, amqpURL(vhost), s.path)
		rate, n := sustained(b, p, payload, 64, 10*time.Second)
		// Gone before the next round opens the same file.
		p.cmd.Process.Kill()
		p.cmd.Wait()
		s.n += n
		s.secs += float64(n) / rate
	}
	return float64(full1M.n) / full1M.secs, float64(fresh.n) / fresh.secs, slowestPage
}

// benchPeakRSS: 400 webhooks of 1 MB from 16 clients, until both tables hold
// them, with extra config lines; the daemon's peak RSS in MB.
func benchPeakRSS(b *testing.B, extra ...string) float64 {
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	p := startBenchProcess(b, amqpURL(vhost), "", extra...)
	defer p.stop(b) // idle, it would still cost the rows after it
	body := newBotBody(b, paddedPayload(b, 1<<20))
	client := newLoadClient(p.url, 16)
	db := openDB(b, p.dbPath)
	parallelRate(b, 16, 400, func(i int) error {
		_, err := botPost(client, fmt.Sprintf("mb-%d", i), body)
		return err
	})
	eventually(b, 5*time.Minute, "400 large webhooks stored", func() bool {
		return queryInt(b, db, "SELECT count(*) FROM github_pull_requests") == 400 && queryInt(b, db, "SELECT count(*) FROM github") == 400
	})
	return p.peakRSS(b)
}

// benchCPU: the daemon's CPU time per accepted webhook on the ingest path
// alone (localhost, 16 clients, 4,000 webhooks: read, verify, publish with a
// confirm, answer 202), beside the raw confirm-publisher's CPU per message
// for the same messages: like for like, neither side stores anything. The
// daemon's broker user may not read the queues (RabbitMQ's read permission
// denied, the topology declared beforehand), so its workers take nothing
// while the webhooks come in.
func benchCPU(b *testing.B, payload []byte) (ours, raw time.Duration) {
	const n = 4000
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	user := "sy-bench-cpu-" + randHex(4)
	rabbitmqctl(b, "add_user", user, "bench-password")
	b.Cleanup(func() { _ = exec.Command("rabbitmqctl", "-q", "delete_user", user).Run() })
	rabbitmqctl(b, "set_permissions", "-p", vhost, user, ".*", ".*", "^$")
	// The workers' refused consumes are expected here: log errors only.
	p := startBenchProcess(b, "amqp://"+user+":bench-password@127.0.0.1:5672/"+vhost, "", "queue.declare_topology = false", `log.level = "error"`)
	defer p.stop(b) // idle, it would still cost the rows after it
	body := newBotBody(b, payload)
	client := newLoadClient(p.url, 16)
	before := p.cpu(b)
	parallelRate(b, 16, n, func(i int) error {
		_, err := botPost(client, fmt.Sprintf("cpu-%d", i), body)
		return err
	})
	ours = (p.cpu(b) - before) / n
	if got := ready(b, vhost, queueGitHub); got != n {
		b.Fatalf("github holds %d, want all %d: the daemon's workers took some, and its CPU is not the ingest's alone", got, n)
	}

	conn, err := amqp.Dial(amqpURL(vhost))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	chans := make(chan *amqp.Channel, 16)
	for i := 0; i < 16; i++ {
		ch, _ := conn.Channel()
		_ = ch.Confirm(false)
		chans <- ch
	}
	h := http.Header{}
	h.Set("X-GitHub-Event", "pull_request")
	before = selfCPU()
	parallelRate(b, 16, n, func(i int) error {
		ch := <-chans
		defer func() { chans <- ch }()
		h := h.Clone()
		h.Set("X-GitHub-Delivery", fmt.Sprintf("raw-cpu-%d", i))
		dc, err := ch.PublishWithDeferredConfirm(exchangeName, "", true, false, newPublishing(h, payload, "127.0.0.1", time.Now()))
		if err != nil || !dc.Wait() {
			return fmt.Errorf("raw publish: %v", err)
		}
		return nil
	})
	raw = (selfCPU() - before) / n
	return ours, raw
}

// billing is what the billing row measured: the billable AMQP methods
// (basic.publish, basic.deliver, basic.get-ok: what a plan's quota counts)
// the WAN proxy saw while the daemon sat idle, and per webhook over the
// daemon's whole life (start, idle, a steady stream, stop), beside
// switchyard's own count (broker_usage) over the same life; each
// webhook's time from its 202 to its typed row; the daemon's CPU per
// webhook of the stream.
type billing struct {
	idle                time.Duration
	idleWire            int64
	wirePer, oursPer    float64
	webhooks            int
	p50, p99            float64 // ms, 202 to typed row
	daemonCPUPerWebhook time.Duration
}

// billingRate and billingWebhooks are the steady stream of the billing
// row: 20 webhooks a second for 30 s.
const (
	billingRate     = 20
	billingWebhooks = 600
	billingIdle     = 60 * time.Second
)

// benchBilling: the real binary with the default config over amqps to a
// broker behind the WAN proxy, which counts the billable methods that pass
// it. First billingIdle with nothing to do; then billingWebhooks at a
// steady billingRate, each timed from its 202 to its github_pull_requests
// row (the typed row's updated_at, the daemon's clock, which is this
// machine's); then the daemon stops, which writes its last counts, and its
// broker_usage over its whole life is set beside the wire's.
func benchBilling(b *testing.B, payload []byte, rtt time.Duration) billing {
	vhost := newVhost(b)
	declareTestTopology(b, vhost, 10*time.Minute)
	proxy := newWANProxy(b, testBrokerAddr(), rtt)
	wire := proxy.countFrames()
	billable := func() int64 { return wire.publish.Load() + wire.deliver.Load() + wire.getOK.Load() }
	p := startBenchProcess(b, proxy.URL(vhost), "")
	defer p.stop(b) // idle, it would still cost the rows after it
	var res billing

	// Idle: the daemon's workers consume, its fleet keeps alive and checks,
	// but no webhook comes. (A timed window is the measurement here.)
	before := billable()
	time.Sleep(billingIdle)
	res.idle, res.idleWire = billingIdle, billable()-before

	body := newBotBody(b, payload)
	client := newLoadClient(p.url, 16)
	db := openDB(b, p.dbPath)
	prefix := "bill-" + randHex(3) + "-"
	var mu sync.Mutex
	accepted := map[string]time.Time{}
	var failed atomic.Value
	var wg sync.WaitGroup
	cpu0 := p.cpu(b)
	tick := time.NewTicker(time.Second / billingRate)
	for i := range billingWebhooks {
		<-tick.C
		guid := fmt.Sprintf("%s%d", prefix, i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := botPost(client, guid, body); err != nil {
				failed.CompareAndSwap(nil, err)
				return
			}
			at := time.Now()
			mu.Lock()
			accepted[guid] = at
			mu.Unlock()
		}()
	}
	tick.Stop()
	wg.Wait()
	if err := failed.Load(); err != nil {
		b.Fatal(err)
	}
	eventually(b, 5*time.Minute, "every webhook in github and github_pull_requests", func() bool {
		return queryInt(b, db, "SELECT count(*) FROM github WHERE delivery_id LIKE $1", prefix+"%") == billingWebhooks &&
			queryInt(b, db, "SELECT count(*) FROM github_pull_requests WHERE delivery_id LIKE $1", prefix+"%") == billingWebhooks
	})
	res.daemonCPUPerWebhook = (p.cpu(b) - cpu0) / billingWebhooks
	res.webhooks = billingWebhooks

	var lat []float64
	rows, err := db.Query(`SELECT delivery_id, updated_at FROM github_pull_requests WHERE delivery_id LIKE $1`, prefix+"%")
	if err != nil {
		b.Fatal(err)
	}
	for rows.Next() {
		var id, at string
		if err := rows.Scan(&id, &at); err != nil {
			b.Fatal(err)
		}
		t, err := time.Parse(time.RFC3339Nano, at)
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, float64(t.Sub(accepted[id]).Microseconds())/1000)
	}
	rows.Close()
	sort.Float64s(lat)
	res.p50, res.p99 = lat[len(lat)/2], lat[len(lat)*99/100]

	// Stopped, the daemon writes what it counted since its last write.
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		b.Fatal(err)
	}
	_ = p.cmd.Wait()
	total := billable()
	ours := int64(queryInt(b, db, "SELECT coalesce(sum(published + delivered), 0) FROM broker_usage"))
	if ours != total {
		b.Errorf("billing: switchyard counted %d billable messages, the wire carried %d", ours, total)
	}
	res.wirePer, res.oursPer = float64(total)/billingWebhooks, float64(ours)/billingWebhooks
	return res
}
