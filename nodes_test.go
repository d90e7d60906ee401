package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// testNode is one `switchyard serve` process of several sharing one
// PostgreSQL database.
type testNode struct {
	name, addr string
	cmd        *exec.Cmd
	out        *syncBuffer
	dead       atomic.Bool // read by the lease sampler
}

// startNode starts serve as node name on the database at dbURL, with
// brokers, its own listener and lease_ttl 2s.
func startNode(t *testing.T, name, dbURL string, brokers ...string) *testNode {
	t.Helper()
	n := &testNode{name: name, addr: freeAddr(t)}
	config := writeConfigWith(t, t.TempDir(), n.addr, fmt.Sprintf("driver = \"postgres\"\nurl = %q\nmax_conns = 4", dbURL),
		fmt.Sprintf("node_name = %q\nlease_ttl = \"2s\"", n.name), brokers...)
	n.cmd, n.out = startProcess(t, config, n.addr)
	return n
}

// leaseHolders samples, every 50 ms until stop, which live node says it
// holds each job's lease, and reports every sample where two did.
func leaseHolders(t *testing.T, nodes []*testNode, stop <-chan struct{}) (report func() []string) {
	var mu sync.Mutex
	var overlaps []string
	var wg sync.WaitGroup
	wg.Go(func() {
		client := &http.Client{Timeout: time.Second}
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			held := map[string][]string{}
			for _, n := range nodes {
				if n.dead.Load() {
					continue
				}
				for job, v := range scrapeWith(client, "http://"+n.addr+"/metrics", "switchyard_lease_held") {
					if v == 1 {
						held[job] = append(held[job], n.name)
					}
				}
			}
			for job, by := range held {
				if len(by) > 1 {
					mu.Lock()
					overlaps = append(overlaps, fmt.Sprintf("%s held by %v at %s", job, by, time.Now().Format(time.StampMilli)))
					mu.Unlock()
				}
			}
		}
	})
	return func() []string {
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return overlaps
	}
}

// scrapeWith reads one metric's samples by the value of their one label,
// leaving out a node that does not answer.
func scrapeWith(client *http.Client, url, metric string) map[string]float64 {
	out := map[string]float64{}
	resp, err := client.Get(url)
	if err != nil {
		return out
	}
	defer resp.Body.Close()
	var body strings.Builder
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		body.Write(buf[:n])
		if err != nil {
			break
		}
	}
	for _, line := range strings.Split(body.String(), "\n") {
		if !strings.HasPrefix(line, metric+"{") {
			continue
		}
		label, value, _ := strings.Cut(line[len(metric)+1:], "} ")
		_, quoted, _ := strings.Cut(label, "=")
		key, err := strconv.Unquote(quoted)
		v, verr := strconv.ParseFloat(value, 64)
		if err == nil && verr == nil {
			out[key] = v
		}
	}
	return out
}

// Three serve processes share one PostgreSQL database and the local
// RabbitMQ. Webhooks are spread over the three; one is SIGKILLed
// mid-stream, another cut from the database by a proxy for a while. Every
// 202 is stored once, the statistics count each event once, nothing
// reaches an -error queue, no message is retried; each lease moves to a
// live node and is never held by two at once; a pending switch posted to one node completes once,
// and every node follows.
func TestThreeNodesOneStore(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	a, b := newVhost(t), newVhost(t)
	dbURL := newPostgresDatabase(t)
	// Each node reaches the database through a proxy of its own, which
	// the test may close.
	var proxies []*tcpProxy
	var urls []string
	for range 3 {
		p := newTCPProxy(t, pgAddr(t, dbURL))
		u, _ := url.Parse(dbURL)
		u.Host = p.addr
		proxies, urls = append(proxies, p), append(urls, u.String())
	}
	// Node 1 starts alone and takes every lease; then the other two.
	nodes := []*testNode{startNode(t, "node-1", urls[0], amqpURL(a), amqpURL(b))}
	first := DefaultConfig()
	first.Server.NodeName = "node-1"
	jobs := leaseJobs(first)
	eventually(t, 20*time.Second, "node 1 holding every lease", func() bool {
		held := scrapeWith(http.DefaultClient, "http://"+nodes[0].addr+"/metrics", "switchyard_lease_held")
		for _, job := range jobs {
			if held[job] != 1 {
				return false
			}
		}
		return true
	})
	for i := 1; i < 3; i++ {
		nodes = append(nodes, startNode(t, fmt.Sprintf("node-%d", i+1), urls[i], amqpURL(a), amqpURL(b)))
	}
	stop := make(chan struct{})
	overlaps := leaseHolders(t, nodes, stop)

	body := loadFixture(t, "issues", "opened")
	var accepted sync.Map
	var sent, refused atomic.Int64
	post := func(n *testNode) {
		guid := newGUID()
		code, _ := do(t, webhookRequest(t, "http://"+n.addr, "issues", guid, body))
		sent.Add(1)
		if code == http.StatusAccepted {
			accepted.Store(guid, true)
		} else {
			refused.Add(1)
		}
	}
	stream := func(count int, to []*testNode) {
		var wg sync.WaitGroup
		for i := range count {
			wg.Go(func() { post(to[i%len(to)]) })
			if i%8 == 7 {
				wg.Wait()
			}
		}
		wg.Wait()
	}
	stream(150, nodes)
	// Node 1 dies with messages in hand, and its leases with it.
	if err := nodes[0].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = nodes[0].cmd.Wait()
	nodes[0].dead.Store(true)
	live := []*testNode{nodes[1], nodes[2]}
	stream(60, live)
	// The node that took the leases loses the database, and with it its
	// leases; it keeps taking webhooks.
	var cut int
	eventually(t, 20*time.Second, "node 2 or 3 holding the leases", func() bool {
		for _, i := range []int{1, 2} {
			if scrapeWith(http.DefaultClient, "http://"+nodes[i].addr+"/metrics", "switchyard_lease_held")[jobAlerts] == 1 {
				cut = i
				return true
			}
		}
		return false
	})
	proxies[cut].Close()
	stream(90, live)
	// Ready still (a webhook takes the broker's path), naming the
	// database.
	eventually(t, 30*time.Second, nodes[cut].name+" telling /readyz that its database is lost", func() bool {
		code, body, err := doQuiet(http.DefaultClient, httpRequest(t, http.MethodGet, "http://"+nodes[cut].addr+"/readyz", "", ""))
		return err == nil && code == http.StatusOK && strings.Contains(body, `"database":"not writable"`)
	})
	eventually(t, 30*time.Second, "the leases moved to the other node", func() bool {
		return scrapeWith(http.DefaultClient, "http://"+nodes[3-cut].addr+"/metrics", "switchyard_lease_held")[jobAlerts] == 1
	})
	proxies[cut].Reopen()
	stream(100, live)

	db := openStoreDB(t, DatabaseConfig{Driver: "postgres", URL: dbURL})
	var want int
	accepted.Range(func(_, _ any) bool { want++; return true })
	if want == 0 || refused.Load() > sent.Load()/10 {
		t.Fatalf("%d of %d webhooks accepted", want, sent.Load())
	}
	eventually(t, 90*time.Second, fmt.Sprintf("all %d accepted webhooks stored", want), func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") >= want
	})
	accepted.Range(func(k, _ any) bool {
		if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", k); n != 1 {
			t.Errorf("delivery %s stored %d times, want once", k, n)
		}
		return true
	})
	eventually(t, 60*time.Second, "database-service done with every delivery", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE worker = 'database-service'") >= want
	})
	if n := queryInt(t, db, "SELECT count(*) FROM github"); n != want {
		t.Errorf("github rows: %d, want %d", n, want)
	}
	if n := queryInt(t, db, "SELECT CAST(coalesce(sum(count), 0) AS BIGINT) FROM github_statistics_6h"); n != want {
		t.Errorf("statistics count %d events, want %d: each once", n, want)
	}
	for _, vhost := range []string{a, b} {
		for _, q := range logicalQueues {
			if n := ready(t, vhost, errorQueue(q)); n != 0 {
				t.Errorf("%s on %s holds %d messages, want none", errorQueue(q), vhost, n)
			}
		}
	}

	// Every lease moved to a live node, which says it holds it: but the
	// dead node's own outbox's, which no other node asks for (they adopt
	// its rows instead).
	shared := slices.DeleteFunc(slices.Clone(jobs), func(job string) bool { return strings.HasPrefix(job, outboxJobPrefix) })
	eventually(t, 30*time.Second, "every lease held by a live node", func() bool {
		for _, job := range shared {
			holders := 0
			for _, n := range live {
				holders += int(scrapeWith(http.DefaultClient, "http://"+n.addr+"/metrics", "switchyard_lease_held")[job])
			}
			var node string
			if holders != 1 || db.QueryRow("SELECT node FROM leases WHERE job = $1", job).Scan(&node) != nil || node == nodes[0].name {
				return false
			}
		}
		return true
	})

	// A pending switch posted to node 2 completes once; every node follows.
	notify := httpRequest(t, http.MethodPost, "http://"+nodes[1].addr+"/api/v1/broker/pending-switch",
		fmt.Sprintf(`{"host":"127.0.0.1","vhost":%q,"switchedAt":%q}`, b, time.Now().UTC().Format(time.RFC3339Nano)), "producer-token-for-tests")
	if code, answer := do(t, notify); code != http.StatusAccepted {
		t.Fatalf("pending switch: %d %s", code, answer)
	}
	for _, n := range live {
		eventually(t, 30*time.Second, n.name+" following the switch", func() bool {
			req := httpRequest(t, http.MethodGet, "http://"+n.addr+"/api/v1/broker", "", "operator-token-for-tests")
			_, answer := do(t, req)
			return strings.Contains(answer, `"active":{"index":1`) && strings.Contains(answer, `"pending_switch":null`)
		})
	}
	completed := 0
	for _, n := range nodes {
		completed += strings.Count(n.out.String(), "pending switch completed")
	}
	if completed != 1 {
		t.Errorf("the switch completed %d times, want once", completed)
	}

	for _, n := range nodes {
		t.Logf("%s: took %d leases, lost %d; handed back %d batches", n.name, strings.Count(n.out.String(), `msg="lease taken"`),
			strings.Count(n.out.String(), `msg="lease lost`), strings.Count(n.out.String(), "handed back unacknowledged"))
		// A database cut off, or a pooler's answer, hands a message back;
		// it never burns one of its attempts.
		if c := strings.Count(n.out.String(), "will retry"); c > 0 {
			t.Errorf("%s: %d messages retried, want none", n.name, c)
		}
	}
	close(stop)
	if o := overlaps(); len(o) > 0 {
		t.Errorf("a lease held by two nodes at once:\n%s", strings.Join(o, "\n"))
	}
	for _, n := range live {
		stopProcess(t, n.cmd, n.out, 30*time.Second)
	}
}

// pgAddr is the host:port of a PostgreSQL URL.
func pgAddr(t testing.TB, raw string) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	if u.Port() == "" {
		return u.Hostname() + ":5432"
	}
	return u.Host
}

// httpRequest is a request with a JSON body (or none) and a bearer token.
func httpRequest(t testing.TB, method, url, body, token string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	return req
}

// An SQLite file has one serve: a second on the same file is refused,
// naming the node that serves it; once the first has stopped, it starts.
func TestSecondServeOnSQLiteRefused(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, amqpURL(newVhost(t)))
	cfg.Server.NodeName = "first-node"
	d := startDaemon(t, cfg)
	eventually(t, 10*time.Second, "the first node's row", func() bool {
		return queryInt(t, openStoreDB(t, cfg.Database), "SELECT count(*) FROM nodes WHERE name = 'first-node'") == 1
	})
	second := *cfg
	second.Server.NodeName = "second-node"
	_, err := NewDaemon(t.Context(), &second, slog.New(slog.DiscardHandler))
	if err == nil || !strings.Contains(err.Error(), `served by node "first-node"`) || exitCode(err, io.Discard) != 1 {
		t.Fatalf("a second serve on the file: %v, want exit 1 naming the first node", err)
	}
	d.stop(t)
	again, err := NewDaemon(t.Context(), &second, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("serve once the first stopped: %v", err)
	}
	if err := again.Close(); err != nil {
		t.Fatal(err)
	}
}

// The status lists every node with the leases it holds, and each lease;
// switchyard_lease_held is 1 for each job on its holder.
func TestStatusShowsNodesAndLeases(t *testing.T) {
	t.Parallel()
	onBothStores(t, testStatusShowsNodesAndLeases)
}

func testStatusShowsNodesAndLeases(t *testing.T) {
	cfg := testConfig(t, amqpURL(newVhost(t)))
	cfg.Server.NodeName = "status-node"
	d := startDaemon(t, cfg)
	jobs := leaseJobs(cfg)
	waitTaken(t, d.leases, 10*time.Second, jobs...)
	m := scrape(t, d.URL+"/metrics")
	for _, job := range jobs {
		if m[`switchyard_lease_held{job="`+job+`"}`] != 1 {
			t.Errorf("switchyard_lease_held{job=%q} = %v once taken, want 1", job, m[`switchyard_lease_held{job="`+job+`"}`])
		}
	}
	var st Status
	_, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		t.Fatal(err)
	}
	if st.Node != "status-node" || len(st.Nodes) != 1 || st.Nodes[0].Name != "status-node" || st.Nodes[0].Gone ||
		fmt.Sprint(sortedCopy(st.Nodes[0].Leases)) != fmt.Sprint(sortedCopy(jobs)) || len(st.Leases) != len(jobs) {
		t.Errorf("status: node %q, nodes %+v, leases %+v; want this node holding %v", st.Node, st.Nodes, st.Leases, jobs)
	}
	for _, l := range st.Leases {
		if !l.Live || l.Node != "status-node" {
			t.Errorf("lease %+v, want live on status-node", l)
		}
	}
	c := *d.cfg
	c.Server.Listen = strings.TrimPrefix(d.URL, "http://")
	var out bytes.Buffer
	if err := printStatus(context.Background(), &c, false, &out); err != nil || !strings.Contains(out.String(), "status-node (this one)") {
		t.Errorf("switchyard status: %v\n%s\nwant the node listed", err, out.String())
	}
}

// sortedCopy is a sorted copy of s.
func sortedCopy(s []string) []string {
	c := slices.Clone(s)
	slices.Sort(c)
	return c
}

// A job whose lease has had no live holder for twice lease_ttl needs the
// operator; one whose holder's lease just expired does not yet.
func TestStatusJobWithoutHolder(t *testing.T) {
	now := time.Now().UTC()
	st := Status{Now: now, StartedAt: now.Add(-time.Hour), LeaseTTL: 30 * time.Second, Jobs: []string{jobAlerts, jobRetention, jobHooks},
		Leases: []LeaseView{
			{Job: jobAlerts, Node: "gone-node", Orphaned: 61 * time.Second},
			{Job: jobRetention, Node: "a", Orphaned: 20 * time.Second},
		}}
	ps := strings.Join(st.problems(), "\n")
	for _, want := range []string{"job alerts has had no live holder for 1m1s (last held by node gone-node)", "job hooks has no node holding its lease"} {
		if !strings.Contains(ps, want) {
			t.Errorf("problems:\n%s\nwant %q", ps, want)
		}
	}
	if strings.Contains(ps, "retention") {
		t.Errorf("problems:\n%s\nname a lease that expired 20 s ago, less than twice lease_ttl", ps)
	}
}

// A lease holder paused past its lease (SIGSTOP for 3 x lease_ttl) while
// another node takes the leases over takes no step once it resumes: no
// HealthChecks ping of its after SIGCONT, and the leases table names the
// other node.
func TestPausedHolderTakesNoStep(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	vhost := newVhost(t)
	dbURL := newPostgresDatabase(t)
	var mu sync.Mutex
	var pings []string // "node-N at" each ping's time
	var resumed time.Time
	late := 0
	hc := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		node := strings.Trim(r.URL.Path, "/")
		node, _, _ = strings.Cut(node, "/")
		pings = append(pings, node)
		if node == "node-1" && !resumed.IsZero() {
			late++
		}
	}))
	defer hc.Close()
	const ttl = 2 * time.Second
	start := func(name string) *testNode {
		n := &testNode{name: name, addr: freeAddr(t)}
		config := writeConfigWith(t, t.TempDir(), n.addr, fmt.Sprintf("driver = \"postgres\"\nurl = %q\nmax_conns = 4", dbURL),
			fmt.Sprintf("node_name = %q\nlease_ttl = %q", name, ttl.String()), amqpURL(vhost))
		appendFile(t, config, fmt.Sprintf("[healthchecks]\nservice = %q\ndatabase_service = %q\n", hc.URL+"/"+name, hc.URL+"/"+name))
		n.cmd, n.out = startProcess(t, config, n.addr)
		return n
	}
	holds := func(n *testNode) bool {
		return scrapeWith(http.DefaultClient, "http://"+n.addr+"/metrics", "switchyard_lease_held")[jobHealthChecks] == 1
	}
	one := start("node-1")
	eventually(t, 20*time.Second, "node 1 holding the leases", func() bool { return holds(one) })
	two := start("node-2")
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node 1:\n%s\nnode 2:\n%s", one.out, two.out)
		}
	})
	eventually(t, 20*time.Second, "node 1 pinging", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.Contains(pings, "node-1")
	})
	if err := one.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "node 2 taking the leases over", func() bool { return holds(two) })
	eventually(t, 20*time.Second, "node 2 pinging", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.Contains(pings, "node-2")
	})
	// Paused for 3 x lease_ttl in all: the scenario's length, not a wait
	// for something to happen.
	time.Sleep(3*ttl - ttl)
	mu.Lock()
	resumed = time.Now()
	mu.Unlock()
	if err := one.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// Node 1 has resumed: from its first answer on, its metrics and its
	// status say it holds no lease (what Held says when they are read,
	// not what its last renewal before the pause wrote).
	var held map[string]float64
	eventually(t, 30*time.Second, "node 1 answering after it resumed", func() bool {
		held = scrapeWith(http.DefaultClient, "http://"+one.addr+"/metrics", "switchyard_lease_held")
		return len(held) > 0
	})
	// Its own outbox's lease, which no other node asks for, it may
	// take again at its first renewal: the others, another node holds.
	for job, v := range held {
		if v != 0 && job != outboxJob("node-1") {
			t.Errorf("node 1's switchyard_lease_held{job=%q} right after it resumed: %v, want 0", job, v)
		}
	}
	_, raw := do(t, mustRequestAuth(t, "http://"+one.addr+"/api/v1/status"))
	var st Status
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		t.Fatal(err)
	}
	for _, l := range st.Leases {
		if l.Node == "node-1" && l.Live && l.Job != outboxJob("node-1") {
			t.Errorf("node 1's status after it resumed: lease %s live on node 1", l.Job)
		}
	}
	// It runs its cycles: its workers' next windows come and go, and
	// node 2 pings on.
	before := func() int { mu.Lock(); defer mu.Unlock(); return len(pings) }()
	eventually(t, 30*time.Second, "more pings after node 1 resumed", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(pings) >= before+4
	})
	mu.Lock()
	if late > 0 {
		t.Errorf("node 1 pinged HealthChecks %d times after it resumed, its leases taken over", late)
	}
	mu.Unlock()
	db := openStoreDB(t, DatabaseConfig{Driver: "postgres", URL: dbURL})
	var holder string
	if err := db.QueryRow("SELECT node FROM leases WHERE job = $1", jobHealthChecks).Scan(&holder); err != nil || holder != "node-2" {
		t.Errorf("leases table: healthchecks held by %q (%v), want node-2", holder, err)
	}
}

// A lease counts as held only until its validity runs out on this node's
// monotonic clock, whatever the renewal loop has said so far: the state a
// holder resumes in after a pause (SIGSTOP, a frozen VM), before its loop
// runs. The job's Holding says so the moment it is asked, and a step
// that checks it is not taken; a holding of an earlier term is not held.
func TestLeaseHeldOnlyWhileValid(t *testing.T) {
	t.Parallel()
	l := heldLease(jobAlerts, 3)
	ls := l.ls
	ls.leases = []*Lease{l}
	h := Holding{lease: l, term: 3}
	if !h.Held() || h.Check() != nil || !ls.Holds(jobAlerts) {
		t.Fatal("a holding valid for an hour is not held")
	}
	if (Holding{lease: l, term: 2}).Held() {
		t.Error("a holding of an earlier term is held")
	}
	lapse(l)
	if h.Held() || ls.Holds(jobAlerts) {
		t.Error("a lease past its validity is held")
	}
	if err := h.Check(); !errors.Is(err, ErrNotHeld) {
		t.Errorf("a step past the lease's validity: %v, want ErrNotHeld", err)
	}
	if !(Holding{}).Held() {
		t.Error("the zero Holding, a job of every node, is not held")
	}
}

// heldLease is node n's lease of job in term, taken and valid for an
// hour, its renewal loop not running.
func heldLease(job string, term int64) *Lease {
	ls := &Leases{ttl: time.Minute, node: "n"}
	return &Lease{Job: job, ls: ls, held: true, term: term, until: time.Now().Add(time.Hour), taken: make(chan struct{}), lost: make(chan struct{})}
}

// lapse ends l's validity as a pause past it does: its holder has not
// been told, its loop has not run.
func lapse(l *Lease) {
	l.mu.Lock()
	l.until = time.Now().Add(-time.Millisecond)
	l.mu.Unlock()
}

// waitTaken waits, on the leases' own signal (the channel a lease closes
// when it is taken), until this node holds each of jobs' leases, within
// timeout in all.
func waitTaken(t *testing.T, ls *Leases, timeout time.Duration, jobs ...string) {
	t.Helper()
	deadline := time.After(timeout)
	for _, job := range jobs {
		l := ls.Lease(job)
		if l == nil {
			t.Fatalf("no lease of job %s kept", job)
		}
		select {
		case <-l.whenTaken():
		case <-deadline:
			t.Fatalf("the lease of %s not taken within %s", job, timeout)
		}
	}
}
