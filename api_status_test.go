package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// statusScene is a daemon with two brokers, a Pending Switch to the second
// held by a message on the first's github-retry (whose TTL outlasts the
// test), and a message in the second's github-error.
func statusScene(t *testing.T) (d *testDaemon, a, b string) {
	t.Helper()
	a, b = newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	cfg.Queue.RetryTTL = time.Hour
	declareTestTopology(t, a, cfg.Queue.RetryTTL)
	declareTestTopology(t, b, cfg.Queue.RetryTTL)
	body := loadFixture(t, "issues", "opened")
	publishRaw(t, a, "", retryQueue(queueGitHub), eventMessage("issues", newGUID(), body))
	failed := eventMessage("issues", newGUID(), body)
	failed.Headers[hdrErrorReason] = "payload does not have the issues shape"
	publishRaw(t, b, "", errorQueue(queueGitHub), failed)
	d = startDaemon(t, cfg)
	for i := 0; i < 3; i++ {
		if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
			t.Fatalf("webhook: %d", code)
		}
	}
	// Forwarded to broker a before the switch is pending: after, the
	// outbox would publish them to its target, b.
	eventually(t, 30*time.Second, "the webhooks forwarded", func() bool {
		return scrape(t, d.URL+"/metrics")["switchyard_outbox_messages"] == 0
	})
	if code, m := apiCall(t, http.MethodPost, d.URL+"/api/v1/broker/pending-switch", "producer-token-for-tests",
		notification("127.0.0.1", b, time.Now())); code != http.StatusAccepted {
		t.Fatalf("notify: %d %v", code, m)
	}
	return d, a, b
}

// GET /api/v1/status: the active broker, the Pending Switch and the queue
// that holds it, every broker's queues with the -error depth, the workers,
// the statistics and the database; operator token only.
func TestStatusAPI(t *testing.T) {
	t.Parallel()
	onBothStores(t, testStatusAPI)
}

func testStatusAPI(t *testing.T) {
	d, _, _ := statusScene(t)
	var st Status
	// The workers take the three webhooks from the active broker, and cycle
	// (a consumer between two windows counts none).
	eventually(t, 30*time.Second, "the webhooks stored, every worker cycled, the service worker consuming", func() bool {
		req, _ := http.NewRequest(http.MethodGet, d.URL+"/api/v1/status", nil)
		req.Header.Set("Authorization", "Bearer operator-token-for-tests")
		code, raw := do(t, req)
		if code != http.StatusOK {
			t.Fatalf("GET /api/v1/status: %d %s", code, raw)
		}
		st = Status{}
		if err := json.Unmarshal([]byte(raw), &st); err != nil {
			t.Fatal(err)
		}
		for _, w := range st.Workers {
			if w.LastCycle.IsZero() {
				return false
			}
		}
		return st.Database.Rows["github"] == 3 && !st.Workers[0].LastStored.IsZero() && len(st.Brokers) == 2 && st.Brokers[0].Queues[queueGitHub].Ready == 0 &&
			st.Brokers[0].Queues[queueDatabase].Ready == 0 && st.Brokers[0].Queues[queueGitHub].Consumers == 1
	})
	if st.Active != 0 || st.Pending == nil || st.Pending.Index != 1 {
		t.Fatalf("active %d, pending %+v: want 0 and a switch to 1", st.Active, st.Pending)
	}
	if len(st.Pending.HeldBy) != 1 || st.Pending.HeldBy[0] != (QueueHold{Broker: 0, Queue: retryQueue(queueGitHub), Messages: 1}) {
		t.Errorf("held by %+v, want github-retry on broker 0 with 1 message", st.Pending.HeldBy)
	}
	if st.ErrorMessages != 1 || st.Brokers[1].Queues[errorQueue(queueGitHub)].Ready != 1 || !st.Brokers[1].Pending || !st.Brokers[0].Active {
		t.Errorf("brokers: %+v, error messages %d", st.Brokers, st.ErrorMessages)
	}
	if len(st.Workers) != 3 || len(st.Statistics) < 28 {
		t.Errorf("workers %d (want 3), statistics buckets %d (want 7 days of 4)", len(st.Workers), len(st.Statistics))
	}
	var counted int
	for _, bk := range st.Statistics {
		counted += bk.Count
	}
	if counted != 3 || st.Database.SizeBytes == 0 {
		t.Errorf("statistics count %d (want 3), database %d bytes", counted, st.Database.SizeBytes)
	}

	// switchyard status, from the config of the running daemon.
	cfg := *d.cfg
	cfg.Server.Listen = strings.TrimPrefix(d.URL, "http://")
	var text, js strings.Builder
	// The message in the spare's github-error needs the operator: exit 1,
	// naming it.
	errorProblem := "github-error on broker #1 holds 1 message"
	err := printStatus(context.Background(), &cfg, false, &text)
	if code := exitCode(err, io.Discard); code != 1 || !strings.Contains(err.Error(), errorProblem) {
		t.Errorf("switchyard status: exit %d (%v), want 1 naming %q", code, err, errorProblem)
	}
	for _, want := range []string{"active broker: #0 127.0.0.1", "pending switch: to #1", "waits for github-retry on #0: 1 message\n",
		"messages in -error queues: 1", "github-error=1", "service", "needs the operator:\n  " + errorProblem} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("switchyard status lacks %q:\n%s", want, text.String())
		}
	}
	err = printStatus(context.Background(), &cfg, true, &js)
	if code := exitCode(err, io.Discard); code != 1 {
		t.Errorf("switchyard status -json: exit %d (%v), want 1", code, err)
	}
	var fromJSON Status
	if err := json.Unmarshal([]byte(js.String()), &fromJSON); err != nil || fromJSON.Pending == nil || fromJSON.ErrorMessages != 1 {
		t.Errorf("switchyard status -json: %v %+v", err, fromJSON)
	}
	// No Go zero times and no null lists: a field without a value is absent.
	for _, absent := range []string{"0001-01-01", `"open_gaps":null`, `"problems":null`} {
		if strings.Contains(js.String(), absent) {
			t.Errorf("switchyard status -json has %s:\n%s", absent, js.String())
		}
	}
	cfg.API.OperatorToken = "wrong-token-wrong-token"
	err = printStatus(context.Background(), &cfg, false, &text)
	if code := exitCode(err, io.Discard); code != exitUnreachable || !strings.Contains(err.Error(), "401") {
		t.Errorf("switchyard status with a wrong token: exit %d (%v), want %d saying 401", code, err, exitUnreachable)
	}

	for _, tok := range []string{"", "producer-token-for-tests"} {
		if code, _ := apiCall(t, http.MethodGet, d.URL+"/api/v1/status", tok, ""); code == http.StatusOK {
			t.Errorf("GET /api/v1/status with %q: 200", tok)
		}
	}
	for _, creds := range [][2]string{{"", ""}, {"operator", "producer-token-for-tests"}, {"admin", "operator-token-for-tests"}} {
		req, _ := http.NewRequest(http.MethodGet, d.URL+"/status", nil)
		if creds[0] != "" {
			req.SetBasicAuth(creds[0], creds[1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Basic ") {
			t.Errorf("GET /status as %v: %d %q, want 401 asking for Basic auth", creds, resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
		}
	}
}

// switchyard status exits 0 when all is well, 1 naming what needs the
// operator (here a broker that stopped answering), and 3 when the daemon
// cannot be reached.
func TestStatusExitCodes(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	d := startDaemon(t, testConfig(t, amqpURL(a), proxy.URL(b)))
	eventually(t, 30*time.Second, "the spare's topology declared", func() bool { return queueExists(t, b, queueGitHub) })
	cfg := *d.cfg
	cfg.Server.Listen = strings.TrimPrefix(d.URL, "http://")
	status := func() (int, string, error) {
		var out strings.Builder
		err := printStatus(context.Background(), &cfg, false, &out)
		return exitCode(err, io.Discard), out.String(), err
	}

	eventually(t, 30*time.Second, "status exits 0", func() bool { code, _, _ := status(); return code == 0 })
	if _, out, _ := status(); !strings.Contains(out, "all is well") {
		t.Errorf("status with nothing wrong does not say so:\n%s", out)
	}

	proxy.Close()
	down := "broker #1 (127.0.0.1 vhost " + b + ") is down"
	eventually(t, 30*time.Second, "status exits 1 naming the stopped broker", func() bool {
		code, out, err := status()
		return code == 1 && strings.Contains(err.Error(), down) && strings.Contains(out, down)
	})

	d.stop(t)
	if code, _, err := status(); code != exitUnreachable || !strings.Contains(err.Error(), "is switchyard serving") {
		t.Errorf("status of a stopped daemon: exit %d (%v), want %d", code, err, exitUnreachable)
	}
}

// GET / sends a browser to the status page.
func TestRootRedirectsToStatus(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, testConfig(t, amqpURL(newVhost(t))))
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Get(d.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "/status" {
		t.Errorf("GET /: %d to %q, want 302 to /status", resp.StatusCode, resp.Header.Get("Location"))
	}
}

// chromium finds the headless browser the Makefile installs (Debian's
// chromium), or fails saying how to get it: the status page test must not
// pass by not running.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("no headless Chromium on PATH: `make test` installs Debian's chromium (apt-get install chromium); the status page test cannot run without it")
	return ""
}

// operatorProxy serves the daemon's /status with the operator's Basic auth
// added, as a browser asks after the login prompt.
func operatorProxy(t *testing.T, daemonURL string) string {
	t.Helper()
	target, _ := url.Parse(daemonURL)
	srv := httptest.NewServer(&httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) {
		r.SetURL(target)
		r.Out.SetBasicAuth("operator", "operator-token-for-tests")
	}})
	t.Cleanup(srv.Close)
	return srv.URL + "/status"
}

// runChromium runs headless Chromium with args on pageURL and returns its
// standard output.
func runChromium(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(chromium(t), append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
		"--no-first-run", "--user-data-dir=" + t.TempDir()}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium %v: %v\n%s", args, err, stderr.String())
	}
	return string(out)
}

// The status page rendered by headless Chromium shows the active broker, the
// Pending Switch's blocking queue and the non-zero -error depth the test put
// there.
func TestStatusPageInBrowser(t *testing.T) {
	t.Parallel()
	chromium(t)
	d, a, b := statusScene(t)
	page := operatorProxy(t, d.URL)
	dom := runChromium(t, "--dump-dom", page)
	for what, want := range map[string]string{
		"the active broker":        "Reading broker #0: 127.0.0.1 vhost " + a,
		"the pending switch":       "Pending switch to broker #1 (127.0.0.1 vhost " + b + ")",
		"what holds it":            "<b>github-retry</b> on broker #0 (1 message)",
		"the -error messages":      `id="errors">1 message in -error queues`,
		"the -error depth, marked": `<td>github-error</td><td class="n alert">1</td>`,
		"the chart":                `<svg class="chart"`,
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("the rendered page does not show %s: %q not in\n%s", what, want, dom)
		}
	}
}

// TestStatusScreenshot writes docs/status.png for the README when
// SWITCHYARD_SCREENSHOT names the file (`make screenshot`).
func TestStatusScreenshot(t *testing.T) {
	path := os.Getenv("SWITCHYARD_SCREENSHOT")
	if path == "" {
		t.Skip("set SWITCHYARD_SCREENSHOT=docs/status.png (make screenshot) to write the README's picture")
	}
	d, _, _ := statusScene(t)
	page := operatorProxy(t, d.URL)
	eventually(t, 30*time.Second, "the webhooks stored", func() bool {
		return strings.Contains(runChromium(t, "--dump-dom", page), "<td>github</td><td class=\"n\">3</td>")
	})
	runChromium(t, "--screenshot="+path, "--window-size=1000,1500", "--hide-scrollbars", page)
	if fi, err := os.Stat(path); err != nil || fi.Size() == 0 {
		t.Fatalf("no screenshot at %s: %v", path, errors.Join(err, fmt.Errorf("size %d", sizeOf(fi))))
	}
}

func sizeOf(fi os.FileInfo) int64 {
	if fi == nil {
		return 0
	}
	return fi.Size()
}

// A broker that stopped answering does not hold the status: it answers while
// the stall still holds, with that broker down and the others read.
func TestStatusWithStalledBroker(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, amqpURL(a), proxy.URL(b))
	cfg.Queue.CallTimeout = 10 * time.Minute // a stalled call would outlast the test
	d := startDaemon(t, cfg)
	eventually(t, 30*time.Second, "the spare's topology declared", func() bool { return queueExists(t, b, queueGitHub) })
	proxy.Stall(true)
	defer proxy.Stall(false)
	type answer struct {
		code int
		m    map[string]any
	}
	answered := make(chan answer, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodGet, d.URL+"/api/v1/status", nil)
		req.Header.Set("Authorization", "Bearer operator-token-for-tests")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			answered <- answer{}
			return
		}
		defer resp.Body.Close()
		var m map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&m)
		answered <- answer{resp.StatusCode, m}
	}()
	var code int
	var m map[string]any
	select {
	case ans := <-answered:
		code, m = ans.code, ans.m
	case <-time.After(time.Minute):
		t.Fatal("the status waits on the stalled broker")
	}
	if code != http.StatusOK {
		t.Fatalf("status with a stalled broker: %d %v", code, m)
	}
	brokers, _ := m["brokers"].([]any)
	if len(brokers) != 2 {
		t.Fatalf("brokers: %v", m["brokers"])
	}
	up0, _ := brokers[0].(map[string]any)["up"].(bool)
	up1, _ := brokers[1].(map[string]any)["up"].(bool)
	if !up0 || up1 {
		t.Errorf("up: %v, %v; want the reachable broker up and the stalled one down", up0, up1)
	}
	if e, _ := brokers[1].(map[string]any)["error"].(string); e == "" {
		t.Errorf("the stalled broker is down without saying why")
	}
}

// A worker before its first cycle is in its first window, not "never";
// github-forbidden's next read is said from the cleanup worker's schedule.
func TestWorkerScheduleWords(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	for _, tt := range []struct {
		name string
		w    WorkerState
		want string
	}{
		{"in its first window", WorkerState{WindowEnds: now.Add(4 * time.Minute)}, "first window ends in 4m0s"},
		{"pausing before its second", WorkerState{NextCycle: now.Add(time.Hour)}, "next cycle in 1h0m0s"},
		{"cycled", WorkerState{LastCycle: now.Add(-3 * time.Second), WindowEnds: now.Add(time.Minute)}, "3s ago"},
	} {
		if got := lastCycle(now, tt.w); got != tt.want {
			t.Errorf("%s: got %q, want %q", tt.name, got, tt.want)
		}
	}
	cleanup := WorkerState{Queue: queueForbidden, NextCycle: now.Add(50 * time.Minute)}
	if got := forbiddenRead(now, []WorkerState{{Queue: queueGitHub}, cleanup}); got != "next read in 50m0s" {
		t.Errorf("github-forbidden: got %q, want the next read in 50m0s", got)
	}
	cleanup.NextCycle, cleanup.WindowEnds = time.Time{}, now.Add(30*time.Second)
	if got := forbiddenRead(now, []WorkerState{cleanup}); got != "being read now (its window ends in 30s)" {
		t.Errorf("github-forbidden in its window: got %q", got)
	}
	b, _ := json.Marshal(WorkerState{Name: "service"})
	if strings.Contains(string(b), "0001-01-01") {
		t.Errorf("a worker that has not cycled marshals zero times: %s", b)
	}
}

// Wrong passwords are logged and, past 20 in a minute from one address,
// answered 429 with Retry-After whatever that address sends, the right
// password and the admin API included; another address is not held.
func TestFailedLoginsThrottled(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, testConfig(t, amqpURL(newVhost(t))))
	get := func(client *http.Client, path, user, pass string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, d.URL+path, nil)
		req.SetBasicAuth(user, pass)
		if pass == "bearer" {
			req.Header.Set("Authorization", "Bearer operator-token-for-tests")
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	for i := range authFailLimit {
		if resp := get(http.DefaultClient, "/status", "operator", fmt.Sprintf("guess-%d", i)); resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("wrong password %d: %d, want 401", i+1, resp.StatusCode)
		}
	}
	for _, c := range []struct{ what, path, pass string }{
		{"a 21st guess", "/status", "guess-21"},
		{"the right password", "/status", "operator-token-for-tests"},
		{"the admin API with the right token", "/api/v1/broker", "bearer"},
	} {
		resp := get(http.DefaultClient, c.path, "operator", c.pass)
		if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
			t.Errorf("%s after %d failures: %d, Retry-After %q; want 429 with Retry-After", c.what, authFailLimit, resp.StatusCode, resp.Header.Get("Retry-After"))
		}
	}
	other := &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 3)}}).DialContext}}
	if resp := get(other, "/status", "operator", "operator-token-for-tests"); resp.StatusCode != http.StatusOK {
		t.Errorf("another address: %d, want 200", resp.StatusCode)
	}
	logs := d.logs.String()
	for _, want := range []string{"authentication failed", "source refused for a minute", "source_ip=127.0.0.1"} {
		if !strings.Contains(logs, want) {
			t.Errorf("the log lacks %q", want)
		}
	}
	if n := strings.Count(logs, `msg="authentication failed"`); n > 2 {
		t.Errorf("%d log lines for %d failures in a moment; want them rate-limited", n, authFailLimit)
	}
}

// With 20,000 open gaps (some megabytes, were they all listed) the status
// stays small: 100 listed beside their total, the page and the JSON under
// 1 MiB, and `status` reads its answer whole (exit 1 for the gaps, not 3).
func TestStatusBoundedWithManyGaps(t *testing.T) {
	t.Parallel()
	onBothStores(t, testStatusBoundedWithManyGaps)
}

func testStatusBoundedWithManyGaps(t *testing.T) {
	const gaps = 20000
	cfg := testConfig(t, amqpURL(newVhost(t)))
	ctx := context.Background()
	store, err := OpenStore(ctx, cfg.Database, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	err = store.WriteTx(ctx, func(tx *Tx) error {
		_, err := tx.write(ctx, atOnce, `WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < $3)
			INSERT INTO delivery_gaps (guid, delivery_id, event, delivered_at, found_at)
			SELECT 'gap-' || CAST(1000000 + i AS TEXT), i, 'issues', $1, $2 FROM n`, formatTime(time.Now().Add(-5*time.Hour)), formatTime(time.Now()), gaps)
		return err
	})
	store.Close()
	if err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, cfg)

	req, _ := http.NewRequest(http.MethodGet, d.URL+"/status", nil)
	req.SetBasicAuth("operator", "operator-token-for-tests")
	code, page := do(t, req)
	if code != http.StatusOK || len(page) >= 1<<20 || !strings.Contains(page, fmt.Sprintf("%d open gaps", gaps)) {
		t.Errorf("/status: %d, %d bytes, want 200 under 1 MiB saying %d open gaps", code, len(page), gaps)
	}
	code, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
	var st Status
	if err := json.Unmarshal([]byte(raw), &st); err != nil || code != http.StatusOK || len(raw) >= 1<<20 ||
		st.GapsTotal != gaps || len(st.Gaps) != statusGaps {
		t.Errorf("/api/v1/status: %d, %d bytes, %d of %d gaps (%v); want under 1 MiB, %d of %d", code, len(raw), len(st.Gaps), st.GapsTotal, err, statusGaps, gaps)
	}
	c := *d.cfg
	c.Server.Listen = strings.TrimPrefix(d.URL, "http://")
	var out strings.Builder
	err = printStatus(ctx, &c, false, &out)
	if code := exitCode(err, io.Discard); code != 1 || !strings.Contains(out.String(), fmt.Sprintf("open delivery gaps: %d", gaps)) {
		t.Errorf("switchyard status: exit %d (%v), want 1 with the total:\n%s", code, err, out.String())
	}
}

// mustRequestAuth is a GET with the operator's bearer token.
func mustRequestAuth(t testing.TB, url string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer operator-token-for-tests")
	return req
}

// The deliveries search narrows by each filter, pages newest first by
// keyset without skipping or repeating a row while webhooks keep coming,
// refuses malformed filters naming the field, and the delivery page shows
// the story with hostile payload strings escaped; an unknown GUID is 404.
func TestDeliveriesSearch(t *testing.T) {
	t.Parallel()
	onBothStores(t, testDeliveriesSearch)
}

func testDeliveriesSearch(t *testing.T) {
	d := startDaemon(t, testConfig(t, amqpURL(newVhost(t))))
	db := openStoreDB(t, d.cfg.Database)
	// Raw, as GitHub sends it: encoding/json would write \u003c.
	hostile := []byte(strings.Replace(string(loadFixture(t, "issues", "opened")),
		`"title": "Webhooks from the second broker arrive twice"`, `"title": "<script>alert(\"x\")</script>"`, 1))
	var issues []string
	for i := range 7 {
		g := fmt.Sprintf("issue-%02d-%s", i, newGUID()[:8])
		issues = append(issues, g)
		postWebhook(t, d.URL, "issues", g, hostile)
	}
	for i := range 3 {
		postWebhook(t, d.URL, "pull_request", fmt.Sprintf("pull-%02d-%s", i, newGUID()[:8]), loadFixture(t, "pull_request", "opened"))
	}
	eventually(t, 20*time.Second, "all stored", func() bool { return queryInt(t, db, "SELECT count(*) FROM github") == 10 })
	get := func(path string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, d.URL+path, nil)
		req.SetBasicAuth("operator", "operator-token-for-tests")
		return do(t, req)
	}
	listed := func(page string) []string {
		var out []string
		for _, part := range strings.Split(page, `<a href="/status/deliveries/`)[1:] {
			g, _, _ := strings.Cut(part, `"`)
			g, _, _ = strings.Cut(g, "?")
			out = append(out, g)
		}
		return out
	}
	for _, c := range []struct {
		query string
		want  int
	}{{"event=pull_request", 3}, {"event=issues&action=opened", 7}, {"guid=pull-01", 1}, {"sender=mona", 10},
		{"repository=octo-org/switchyard-demo&event=issues", 7}, {"outcome=forbidden", 0}, {"from=2000-01-01T00:00:00Z&to=2001-01-01T00:00:00Z", 0}} {
		code, page := get("/status/deliveries?" + c.query)
		if got := listed(page); code != http.StatusOK || len(got) != c.want {
			t.Errorf("?%s: %d, %d rows, want %d", c.query, code, len(got), c.want)
		}
	}
	// Pages of 3, with a new webhook between pages: every issue once.
	seen := map[string]int{}
	next := "/status/deliveries?event=issues&limit=3"
	for pages := 0; next != "" && pages < 10; pages++ {
		code, page := get(next)
		if code != http.StatusOK {
			t.Fatalf("%s: %d", next, code)
		}
		for _, g := range listed(page) {
			seen[g]++
		}
		postWebhook(t, d.URL, "issues", "late-"+newGUID(), hostile)
		next = ""
		if _, rest, ok := strings.Cut(page, `<a id="next" href="`); ok {
			href, _, _ := strings.Cut(rest, `"`)
			next = strings.ReplaceAll(href, "&amp;", "&")
		}
	}
	for _, g := range issues {
		if seen[g] != 1 {
			t.Errorf("issue %s seen %d times across the pages, want once", g, seen[g])
		}
	}
	for g, n := range seen {
		if strings.HasPrefix(g, "late-") || n != 1 {
			t.Errorf("%s seen %d times: a webhook that came after the first page must not show, and none twice", g, n)
		}
	}
	for query, field := range map[string]string{"limit=0": "limit", "limit=1000": "limit", "from=yesterday": "from",
		"event=Bad%20Event": "event", "outcome=lost": "outcome", "after=garbage": "after",
		"from=2026-01-02T00:00:00Z&to=2026-01-01T00:00:00Z": "to"} {
		if code, body := get("/status/deliveries?" + query); code != http.StatusBadRequest || !strings.Contains(body, field+":") {
			t.Errorf("?%s: %d %q, want 400 naming %s", query, code, body, field)
		}
	}
	code, page := get("/status/deliveries/" + issues[0])
	if code != http.StatusOK || !strings.Contains(page, "&lt;script&gt;alert(") || strings.Contains(page, `<script>alert("x")`) ||
		!strings.Contains(page, "issues.opened") {
		t.Errorf("delivery page: %d, want the story with the payload escaped:\n%.2000s", code, page)
	}
	vhost := d.brokers.List()[0].Vhost
	for _, want := range []string{"<th>X-GitHub-Event</th><td>issues</td>", "<th>X-GitHub-Delivery</th><td>" + issues[0] + "</td>",
		"<th>from</th><td>127.0.0.1</td>", "came through " + d.brokers.List()[0].Host + " vhost " + vhost} {
		if !strings.Contains(page, want) {
			t.Errorf("the delivery page lacks %q (its request headers, the broker it came through):\n%.3000s", want, page)
		}
	}
	if code, body := get("/status/deliveries/" + issues[0] + "?download=1"); code != http.StatusOK || !strings.Contains(body, `<script>alert(\"x\")</script>`) {
		t.Errorf("download: %d, want the payload as it was", code)
	}
	if code, _ := get("/status/deliveries/no-such-delivery"); code != http.StatusNotFound {
		t.Errorf("unknown delivery: %d, want 404", code)
	}
	req, _ := http.NewRequest(http.MethodGet, d.URL+"/status/deliveries", nil)
	if code, _ := do(t, req); code != http.StatusUnauthorized {
		t.Errorf("without credentials: %d, want 401", code)
	}
}

// A message waiting in github-error is replayed from its delivery's page:
// refused without the form's token or from another origin (it stays where
// it is), moved and stored with both, and a second press does nothing new.
func TestReplayFromDeliveryPage(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	declareTestTopology(t, vhost, cfg.Queue.RetryTTL)
	guid := newGUID()
	failed := eventMessage("issues", guid, loadFixture(t, "issues", "opened"))
	failed.Headers[hdrErrorReason] = "database is locked (simulated)"
	publishRaw(t, vhost, "", errorQueue(queueGitHub), failed)
	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)

	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	page := func() (int, string) {
		req, _ := http.NewRequest(http.MethodGet, d.URL+"/status/deliveries/"+guid, nil)
		req.SetBasicAuth("operator", "operator-token-for-tests")
		return do(t, req)
	}
	code, body := page()
	_, rest, _ := strings.Cut(body, `name="token" value="`)
	token, _, _ := strings.Cut(rest, `"`)
	if code != http.StatusNotFound || token == "" {
		t.Fatalf("the page of a delivery not stored: %d, token %q; want 404 with the replay form", code, token)
	}
	post := func(origin, token string) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, d.URL+"/status/deliveries/"+guid+"/replay", strings.NewReader("token="+token))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.SetBasicAuth("operator", "operator-token-for-tests")
		if origin != "" {
			req.Header.Set("Origin", origin)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	for name, resp := range map[string]*http.Response{
		"no token":       post(d.URL, ""),
		"a wrong token":  post(d.URL, strings.Repeat("0", 64)),
		"another origin": post("https://evil.example", token),
		"no origin":      post("", token),
	} {
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, resp.StatusCode)
		}
	}
	if n := ready(t, vhost, errorQueue(queueGitHub)); n != 1 {
		t.Fatalf("github-error holds %d after refused posts, want the message still there", n)
	}
	resp := post(d.URL, token)
	if resp.StatusCode != http.StatusSeeOther || !strings.Contains(resp.Header.Get("Location"), "replayed=github") {
		t.Fatalf("replay: %d to %q, want 303 saying it was replayed from github-error", resp.StatusCode, resp.Header.Get("Location"))
	}
	eventually(t, 20*time.Second, "the replayed delivery stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
	})
	if resp := post(d.URL, token); resp.StatusCode != http.StatusSeeOther || !strings.Contains(resp.Header.Get("Location"), "replayed=none") {
		t.Errorf("a second press: %d to %q, want 303 saying nothing was done", resp.StatusCode, resp.Header.Get("Location"))
	}
	if !strings.Contains(d.logs.String(), "replayed from -error at the operator's request") || !strings.Contains(d.logs.String(), "source_ip=127.0.0.1") {
		t.Errorf("the replay is not logged with its source address")
	}
	if code, body := page(); code != http.StatusOK || !strings.Contains(body, "issues.opened") {
		t.Errorf("the page after the replay: %d, want the stored delivery's story", code)
	}
}

// browserProxy serves the daemon as a TLS-less reverse proxy in front of it
// would (the Host kept, the operator's Basic auth added, as a browser sends
// it after the login prompt). A page asked for with ?press=ID gets a script
// that submits the form of that id once loaded: headless Chromium's
// --dump-dom has no other way to press a button.
func browserProxy(t *testing.T, daemonURL string) string {
	t.Helper()
	target, _ := url.Parse(daemonURL)
	srv := httptest.NewServer(&httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(target)
			r.Out.Host = r.In.Host
			r.Out.SetBasicAuth("operator", "operator-token-for-tests")
		},
		ModifyResponse: func(resp *http.Response) error {
			press := resp.Request.URL.Query().Get("press")
			if press == "" || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
				return nil
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				return err
			}
			b = append(b, []byte(`<script>document.getElementById("`+press+`").submit()</script>`)...)
			resp.Body = io.NopCloser(strings.NewReader(string(b)))
			resp.ContentLength = int64(len(b))
			resp.Header.Set("Content-Length", strconv.Itoa(len(b)))
			return nil
		},
	})
	t.Cleanup(srv.Close)
	return srv.URL
}

// In headless Chromium: search for a delivery by GUID, open it, replay it
// from github-database-error with the page's button, and see it stored by
// database-service. With SWITCHYARD_SCREENSHOT_DELIVERIES set (make
// screenshot) it also writes the README's picture of the delivery page.
func TestDeliveriesInBrowser(t *testing.T) {
	t.Parallel()
	chromium(t)
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.GitHub.BotAppID = testBotAppID
	declareTestTopology(t, vhost, cfg.Queue.RetryTTL)
	guid := "browser-" + newGUID()
	msg := eventMessage("pull_request", guid, loadFixture(t, "pull_request", "opened"))
	msg.Headers[hdrTargetType], msg.Headers[hdrTargetID] = "integration", strconv.Itoa(testBotAppID)
	// The raw log has it; the typed tables' worker failed it for good.
	publishRaw(t, vhost, "", queueGitHub, msg)
	msg.Headers[hdrErrorReason] = "database is locked (simulated)"
	publishRaw(t, vhost, "", errorQueue(queueDatabase), msg)
	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "the raw row stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
	})
	base := browserProxy(t, d.URL)

	search := runChromium(t, "--dump-dom", base+"/status/deliveries?guid="+guid[:16])
	if !strings.Contains(search, `href="/status/deliveries/`+guid+`?hook=`) {
		t.Fatalf("the search does not list the delivery:\n%.3000s", search)
	}
	opened := runChromium(t, "--dump-dom", base+"/status/deliveries/"+guid)
	if !strings.Contains(opened, "pull_request.opened") || !strings.Contains(opened, "worker database-service</th><td>not yet") {
		t.Fatalf("the delivery page: want its story with database-service not done yet:\n%.3000s", opened)
	}
	pressed := runChromium(t, "--virtual-time-budget=10000", "--dump-dom", base+"/status/deliveries/"+guid+"?press=replay")
	if !strings.Contains(pressed, "Moved from github-database-error back to github-database") {
		t.Fatalf("after pressing replay: want the page saying it moved the message:\n%.3000s", pressed)
	}
	eventually(t, 20*time.Second, "the replayed delivery stored by database-service", func() bool {
		return strings.Contains(runChromium(t, "--dump-dom", base+"/status/deliveries/"+guid), "worker database-service</th><td>stored")
	})
	if path := os.Getenv("SWITCHYARD_SCREENSHOT_DELIVERIES"); path != "" {
		runChromium(t, "--screenshot="+path, "--window-size=1000,900", "--hide-scrollbars", base+"/status/deliveries/"+guid)
	}
}

// The daemon owns what it starts, the API's looks at brokers included: a
// status page that gave up on a stalled broker leaves its look running
// past the request, and Close waits for it. After Run and Close no
// goroutine is left. Not parallel: goleak sees every goroutine.
func TestDaemonCloseLeavesNoGoroutine(t *testing.T) {
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	a, b := newVhost(t), newVhost(t)
	stalled := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, amqpURL(a), stalled.URL(b))
	d := startDaemon(t, cfg)
	if code := postWebhook(t, d.URL, "issues", newGUID(), loadFixture(t, "issues", "opened")); code != http.StatusAccepted {
		t.Fatalf("webhook: %d", code)
	}
	if err := d.queues.Reachable(context.Background(), d.brokers.List()[1]); err != nil {
		t.Fatal(err)
	}
	stalled.Stall(true)
	req := mustRequestAuth(t, d.URL+"/api/v1/status")
	code, raw := do(t, req)
	var st Status
	if err := json.Unmarshal([]byte(raw), &st); code != http.StatusOK || err != nil || len(st.Brokers) != 2 || st.Brokers[1].Up || st.Brokers[1].Error == "" {
		t.Errorf("/api/v1/status with a stalled broker: %d %v, want 200 with broker #1 not answering", code, err)
	}
	d.stop(t)
	stalled.Close()
}

// The command and the page tell a delivery's story from one model
// (DeliveryStory.Lines): on a gap, a duplicate and a delivery one worker
// moved to -error, the page's story table holds exactly the command's
// lines, less the command's look into the -error and -retry queues (which
// the page does not take: each look is a delivery a plan bills).
func TestStoryOneModelTwoViews(t *testing.T) {
	t.Parallel()
	onBothStores(t, testStoryOneModelTwoViews)
}

func testStoryOneModelTwoViews(t *testing.T) {
	d, cfg, db := botDaemon(t)
	ctx := context.Background()
	dup := newGUID()
	postAs(t, d.URL, "pull_request", dup, loadFixture(t, "pull_request", "opened"), true)
	waitDatabase(t, db, dup)
	postAs(t, d.URL, "pull_request", dup, loadFixture(t, "pull_request", "opened"), true)
	eventually(t, 20*time.Second, "the duplicate counted", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND duplicates = 1", dup) == 1
	})
	gap := newGUID()
	if err := d.store.WriteTx(ctx, func(tx *Tx) error {
		_, err := tx.RecordGap(ctx, deliveryGap{GUID: gap, DeliveryID: 7, Event: "issues",
			DeliveredAt: time.Now().Add(-5 * time.Hour), FoundAt: time.Now()}, nil)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// Stored by the service worker; the database-service refuses it for
	// good (no node id), to github-database-error.
	failed := newGUID()
	postAs(t, d.URL, "issues", failed, mutate(t, loadFixture(t, "issues", "opened"), func(p map[string]any) {
		delete(obj(p, "issue"), "node_id")
	}), true)
	vhost := d.brokers.List()[0].Vhost
	eventually(t, 20*time.Second, "the delivery in github-database-error", func() bool {
		return ready(t, vhost, errorQueue(queueDatabase)) == 1 &&
			queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", failed) == 1
	})
	config := writeConfigWith(t, t.TempDir(), "127.0.0.1:1", databaseKeys(cfg.Database), "", cfg.Brokers[0].URL)
	cell := regexp.MustCompile(`<tr><th>(.*?)</th><td>(.*?)</td></tr>|<tr class="copy"><th colspan="2">(.*?)</th></tr>`)
	for name, guid := range map[string]string{"duplicate": dup, "gap": gap, "-error": failed} {
		var out bytes.Buffer
		if err := run(ctx, []string{"deliveries", "-config", config, "show", guid}, &out, &out); err != nil {
			t.Fatalf("%s: deliveries show: %v\n%s", name, err, out.String())
		}
		var command, queues []string
		for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
			label, text, _ := strings.Cut(line, "  ")
			line = label + " | " + strings.TrimSpace(text)
			if strings.HasPrefix(label, "in ") {
				queues = append(queues, line)
				continue
			}
			command = append(command, line)
		}
		req, _ := http.NewRequest(http.MethodGet, d.URL+"/status/deliveries/"+guid, nil)
		req.SetBasicAuth("operator", "operator-token-for-tests")
		code, page := do(t, req)
		if code != http.StatusOK {
			t.Fatalf("%s: page %d", name, code)
		}
		table, _, _ := strings.Cut(page[strings.Index(page, `<table id="story">`):], "</table>")
		var shown []string
		for _, m := range cell.FindAllStringSubmatch(table, -1) {
			if m[3] != "" {
				shown = append(shown, "copy | "+html.UnescapeString(m[3]))
				continue
			}
			shown = append(shown, html.UnescapeString(m[1])+" | "+html.UnescapeString(m[2]))
		}
		if strings.Join(command, "\n") != strings.Join(shown, "\n") {
			t.Errorf("%s: the command and the page differ:\ncommand:\n%s\npage:\n%s", name, strings.Join(command, "\n"), strings.Join(shown, "\n"))
		}
		if name == "-error" && (len(queues) != 1 || !strings.Contains(queues[0], "github-database-error")) {
			t.Errorf("the command's look into the queues: %q, want the message in github-database-error", queues)
		}
	}
}
