package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestParseBrokerAndMatch(t *testing.T) {
	t.Parallel()
	bs := &Brokers{}
	for i, u := range []string{
		"amqps://u:p@A.example.com/vh%2Fone",
		"amqp://u:p@b.example.com",
		"amqp://u:p@b.example.com:5673/prod",
	} {
		b, err := ParseBroker(i, u)
		if err != nil {
			t.Fatal(err)
		}
		bs.list = append(bs.list, b)
	}
	if b := bs.list[0]; b.Port != 5671 || b.Vhost != "vh/one" || b.Host != "A.example.com" {
		t.Errorf("broker 0: got %+v", b)
	}
	tests := []struct {
		host, vhost string
		want        int
	}{
		{"a.example.com", "vh/one", 0},
		{"A.EXAMPLE.COM", "vh/one", 0},
		{"a.example.com", "vh%2Fone", 0},
		{"b.example.com", "", 1},
		{"b.example.com", "/", 1},
		{"B.example.com", "prod", 2},
		{"b.example.com", "other", -1},
		{"c.example.com", "/", -1},
	}
	for _, tt := range tests {
		b, err := bs.Match(tt.host, tt.vhost)
		switch {
		case tt.want < 0 && err == nil:
			t.Errorf("Match(%q, %q): got broker %d, want ErrUnknownBroker", tt.host, tt.vhost, b.Index)
		case tt.want >= 0 && (err != nil || b.Index != tt.want):
			t.Errorf("Match(%q, %q): got %v %v, want %d", tt.host, tt.vhost, b, err, tt.want)
		}
	}
	for _, bad := range []string{"", "http://x/", "amqp://u:p@h:notaport/"} {
		if _, err := ParseBroker(0, bad); err == nil {
			t.Errorf("ParseBroker(%q): got no error", bad)
		}
	}
}

// apiCall sends a JSON request to the admin API.
func apiCall(t testing.TB, method, url, token, body string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	req.Header.Set("Content-Type", "application/json")
	code, raw := do(t, req)
	var m map[string]any
	if err := json.Unmarshal([]byte(raw), &m); err != nil {
		t.Fatalf("%s %s: answer is not a JSON object: %q", method, url, raw)
	}
	return code, m
}

func notification(host, vhost string, at time.Time) string {
	return fmt.Sprintf(`{"host": %q, "vhost": %q, "switchedAt": %q}`, host, vhost, at.UTC().Format(time.RFC3339))
}

// activeIndex reads the active broker from GET /api/v1/broker.
func activeIndex(t testing.TB, url string) int {
	t.Helper()
	code, m := apiCall(t, http.MethodGet, url+"/api/v1/broker", "operator-token-for-tests", "")
	if code != 200 {
		t.Fatalf("GET /api/v1/broker: %d %v", code, m)
	}
	return int(m["active"].(map[string]any)["index"].(float64))
}

// The admin API: tokens, statuses, the JSON operators script against, stale notifications
// and cancelling.
func TestBrokerAPI(t *testing.T) {
	t.Parallel()
	onBothStores(t, testBrokerAPI)
}

func testBrokerAPI(t *testing.T) {
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	// The HTTP side alone: no worker completes a Pending Switch under the test.
	d := startAPI(t, cfg)
	base := d.URL + "/api/v1/broker"
	t0 := time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)

	auth := []struct {
		name, method, path, token, body string
		want                            int
	}{
		{"no token", "GET", "", "", "", 401},
		{"wrong token", "GET", "", "nope", "", 401},
		{"producer on status", "GET", "", "producer-token-for-tests", "", 403},
		{"producer on switch", "POST", "/switch/1", "producer-token-for-tests", "", 403},
		{"producer on cancel", "DELETE", "/pending-switch", "producer-token-for-tests", "", 403},
		{"wrong token on notify", "POST", "/pending-switch", "nope", notification("127.0.0.1", b, t0), 401},
		{"switch index not an integer", "POST", "/switch/one", "operator-token-for-tests", "", 400},
		{"switch index out of range", "POST", "/switch/7", "operator-token-for-tests", "", 404},
		{"switch index negative", "POST", "/switch/-1", "operator-token-for-tests", "", 404},
		{"notify malformed JSON", "POST", "/pending-switch", "producer-token-for-tests", `{"host": `, 400},
		{"notify missing switchedAt", "POST", "/pending-switch", "producer-token-for-tests", `{"host": "127.0.0.1", "vhost": "x"}`, 400},
		{"notify missing vhost", "POST", "/pending-switch", "producer-token-for-tests", `{"host": "127.0.0.1", "switchedAt": "2026-11-29T10:00:00Z"}`, 400},
		{"notify bad time", "POST", "/pending-switch", "producer-token-for-tests", `{"host": "127.0.0.1", "vhost": "x", "switchedAt": "yesterday"}`, 400},
		{"notify unknown host", "POST", "/pending-switch", "producer-token-for-tests", notification("c.example.com", b, t0), 404},
		{"notify unknown vhost", "POST", "/pending-switch", "producer-token-for-tests", notification("127.0.0.1", "nope", t0), 404},
		{"notify too large", "POST", "/pending-switch", "producer-token-for-tests", `{"host": "` + strings.Repeat("a", maxAdminBody) + `"}`, 413},
	}
	for _, tt := range auth {
		t.Run(tt.name, func(t *testing.T) {
			code, m := apiCall(t, tt.method, base+tt.path, tt.token, tt.body)
			if code != tt.want {
				t.Errorf("got %d %v, want %d", code, m, tt.want)
			}
			if _, ok := m["error"].(string); !ok {
				t.Errorf("answer %v has no error", m)
			}
		})
	}
	if got := activeIndex(t, d.URL); got != 0 {
		t.Fatalf("bad requests moved the broker to %d", got)
	}

	// GET: the shape operators script against.
	code, m := apiCall(t, "GET", base, "operator-token-for-tests", "")
	if code != 200 || m["pending_switch"] != nil || m["last_switch"] != nil {
		t.Fatalf("GET: %d %v", code, m)
	}
	list := m["brokers"].([]any)
	if len(list) != 2 {
		t.Fatalf("brokers: %v", list)
	}
	first := list[0].(map[string]any)
	wantPort, _ := strconv.Atoi(testBrokerAddr()[strings.LastIndex(testBrokerAddr(), ":")+1:])
	if first["host"] != "127.0.0.1" || first["port"] != float64(wantPort) || first["vhost"] != a || first["active"] != true || first["pending"] != false {
		t.Errorf("brokers[0]: %v", first)
	}

	// Accepted notification for another broker: 202 pending. The producer may
	// send the vhost URL-encoded or not, the host in any case.
	code, m = apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, t0))
	if code != 202 || m["status"] != "pending" {
		t.Fatalf("notify B: %d %v", code, m)
	}
	ps := m["pending_switch"].(map[string]any)
	if ps["index"] != float64(1) || ps["vhost"] != b || ps["switched_at"] != "2026-11-29T10:00:00Z" || ps["recorded_at"] == "" {
		t.Errorf("pending_switch: %v", ps)
	}
	// The same notification again, and an older one: stale, nothing changes.
	for _, at := range []time.Time{t0, t0.Add(-time.Minute)} {
		code, m = apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, at))
		if code != 200 || m["status"] != "ignored" || m["reason"] != "stale" {
			t.Errorf("stale notify at %s: %d %v", at, code, m)
		}
	}
	// DELETE cancels without moving; a second DELETE has nothing to cancel.
	code, m = apiCall(t, "DELETE", base+"/pending-switch", "operator-token-for-tests", "")
	if code != 200 || m["cancelled"] != true || m["pending_switch"] != nil || m["active"].(map[string]any)["index"] != float64(0) {
		t.Errorf("DELETE: %d %v", code, m)
	}
	code, m = apiCall(t, "DELETE", base+"/pending-switch", "operator-token-for-tests", "")
	if code != 200 || m["cancelled"] != false {
		t.Errorf("second DELETE: %d %v", code, m)
	}
	// A notification naming the active broker: 200 active.
	code, m = apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", a, t0.Add(time.Minute)))
	if code != 200 || m["status"] != "active" {
		t.Errorf("notify active: %d %v", code, m)
	}

	// Operator switch: moves now, drops the pending switch, and a late copy
	// of the notification that preceded it cannot undo it.
	t1 := t0.Add(2 * time.Minute)
	if code, m = apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, t1)); code != 202 {
		t.Fatalf("notify B again: %d %v", code, m)
	}
	if _, _, err := d.brokers.CancelPending(context.Background()); err != nil {
		t.Fatal(err)
	}
	code, m = apiCall(t, "POST", base+"/switch/1", "operator-token-for-tests", "")
	if code != 200 || m["active"].(map[string]any)["index"] != float64(1) || m["pending_switch"] != nil {
		t.Fatalf("switch/1: %d %v", code, m)
	}
	ls := m["last_switch"].(map[string]any)
	if ls["from"] != float64(0) || ls["to"] != float64(1) || ls["reason"] != "operator" {
		t.Errorf("last_switch: %v", ls)
	}
	code, m = apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", a, t1))
	if code != 200 || m["status"] != "ignored" {
		t.Errorf("late notification after operator switch: %d %v", code, m)
	}
	if got := activeIndex(t, d.URL); got != 1 {
		t.Errorf("active after late notification: got %d, want 1", got)
	}
	// The settings rows keep the names the README gives them.
	db := openStoreDB(t, cfg.Database)
	var pending, watermark string
	if err := db.QueryRow("SELECT value FROM settings WHERE key = 'broker.pending_switch'").Scan(&pending); err != nil || pending != "" {
		t.Errorf("broker.pending_switch: %q %v, want \"\"", pending, err)
	}
	if err := db.QueryRow("SELECT value FROM settings WHERE key = 'broker.switch_watermark'").Scan(&watermark); err != nil || watermark != "2026-11-29T10:02:00Z" {
		t.Errorf("broker.switch_watermark: %q %v", watermark, err)
	}
}

// startAPI serves a Daemon's HTTP handler without running its workers.
func startAPI(t *testing.T, cfg *Config) *testDaemon {
	t.Helper()
	log := slog.New(slog.NewTextHandler(&logSink{t: t}, nil))
	withMigratedStore(t, cfg.Database)
	d, err := NewDaemon(context.Background(), cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d.api.Handler())
	t.Cleanup(func() {
		srv.Close()
		d.Close()
	})
	return &testDaemon{Daemon: d, URL: srv.URL}
}

// A stored pending target that is no longer configured reads as none.
func TestPendingTargetNoLongerConfigured(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	ctx := context.Background()
	p := newParts(t, cfg)
	if _, _, err := p.brokers.Notify(ctx, "127.0.0.1", b, time.Now()); err != nil {
		t.Fatal(err)
	}
	// Broker b is dropped from the config.
	bs2, err := NewBrokers(ctx, cfg.Brokers[:1], p.store, nil, p.log)
	if err != nil {
		t.Fatal(err)
	}
	st, err := bs2.State(ctx)
	if err != nil || st.Pending != nil || st.Active != 0 {
		t.Errorf("got %+v %v, want no pending switch", st, err)
	}
}

// publishN publishes n deliveries through github-exchange on vhost, as the
// producer does, and returns their GUIDs.
func publishN(t testing.TB, vhost, prefix string, n int) []string {
	t.Helper()
	ch := amqpChannel(t, vhost)
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	body := loadFixture(t, "pull_request", "synchronize")
	var guids []string
	var dcs []*amqp.DeferredConfirmation
	for i := 0; i < n; i++ {
		g := fmt.Sprintf("%s-%03d-%s", prefix, i, randHex(4))
		dc, err := ch.PublishWithDeferredConfirm(exchangeName, "", true, false, eventMessage("pull_request", g, body))
		if err != nil {
			t.Fatal(err)
		}
		dcs = append(dcs, dc)
		guids = append(guids, g)
	}
	for _, dc := range dcs {
		if !dc.Wait() {
			t.Fatal("publish not confirmed")
		}
	}
	return guids
}

// idRange returns the lowest and highest github.id of the deliveries, i.e.
// their commit order.
func idRange(t testing.TB, store DatabaseConfig, guids []string) (lo, hi int) {
	t.Helper()
	db := openStoreDB(t, store)
	lo, hi = 1<<62, -1
	for _, g := range guids {
		id := queryInt(t, db, "SELECT id FROM github WHERE delivery_id = $1", g)
		lo, hi = min(lo, id), max(hi, id)
	}
	return lo, hi
}

// storedAll waits until every delivery is in github and was seen by
// database-service.
func storedAll(t testing.TB, store DatabaseConfig, guids []string, timeout time.Duration) {
	t.Helper()
	db := openStoreDB(t, store)
	want := map[string]bool{}
	for _, g := range guids {
		want[g] = true
	}
	var ids []any
	for g := range want {
		ids = append(ids, g)
	}
	count := func(query string) int {
		n := 0
		for chunk := range slices.Chunk(ids, 500) {
			n += queryInt(t, db, numberParams(query+" IN (?"+strings.Repeat(", ?", len(chunk)-1)+")"), chunk...)
		}
		return n
	}
	// Where they stopped, should they not all arrive: which step of the
	// data path a failed run's log names.
	defer func() {
		if t.Failed() {
			t.Logf("at the end of the wait: %d of %d in the outbox, %d of them published, %d refused; %d in github; %d in database-service's ledger",
				count("SELECT count(DISTINCT delivery_id) FROM outbox WHERE delivery_id"), len(want),
				count("SELECT count(DISTINCT delivery_id) FROM outbox WHERE published_at IS NOT NULL AND delivery_id"),
				count("SELECT count(DISTINCT delivery_id) FROM outbox WHERE refused_at IS NOT NULL AND delivery_id"),
				count("SELECT count(DISTINCT delivery_id) FROM github WHERE delivery_id"),
				count("SELECT count(DISTINCT delivery_id) FROM worker_deliveries WHERE worker = 'database-service' AND delivery_id"))
		}
	}()
	eventually(t, timeout, fmt.Sprintf("%d deliveries stored", len(want)), func() bool {
		return count("SELECT count(DISTINCT delivery_id) FROM github WHERE delivery_id") == len(want) &&
			count("SELECT count(DISTINCT delivery_id) FROM worker_deliveries WHERE worker = 'database-service' AND delivery_id") == len(want)
	})
}

// afterChecks waits until the workers have checked a Pending Switch n more
// times and declined to flip, so that an assertion that nothing happened
// follows checks that ran, not a guess at how long they take.
func afterChecks(t testing.TB, logs *logSink, n int) {
	t.Helper()
	logged(t, logs, "pending switch waits", n)
}

// Producer rotates A -> B: everything on A, including what waits in
// github-retry, is processed before anything published to B, and the flip
// waits for A's main and retry queues but not for its -error queues.
func TestProducerRotation(t *testing.T) {
	t.Parallel()
	onBothStores(t, testProducerRotation)
}

func testProducerRotation(t *testing.T) {
	a, b := newVhost(t), newVhost(t)
	// Long enough that A's retry queues still hold their messages through
	// four drain checks after the notification, however slow the machine
	// is to start the daemon and publish to B (3 s lost that race once,
	// 10 s in a full run on a loaded 2-core machine).
	retryTTL := 20 * time.Second
	declareTestTopology(t, a, retryTTL)
	declareTestTopology(t, b, retryTTL)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	cfg.Queue.RetryTTL = retryTTL

	onA := publishN(t, a, "a", 20)
	body := loadFixture(t, "pull_request", "closed")
	var retrying []string
	for _, q := range []string{queueGitHub, queueDatabase} {
		g := "a-retry-" + q + "-" + randHex(4)
		msg := eventMessage("issues", g, body)
		publishRaw(t, a, "", retryQueue(q), msg)
		retrying = append(retrying, g)
	}
	// The same delivery must reach both queues to be "stored" by both
	// workers; the retry copies above each went to one queue only, so give
	// each its twin in the other queue's retry.
	publishRaw(t, a, "", retryQueue(queueDatabase), eventMessage("issues", retrying[0], body))
	publishRaw(t, a, "", retryQueue(queueGitHub), eventMessage("issues", retrying[1], body))
	publishRaw(t, a, "", errorQueue(queueGitHub), eventMessage("issues", "a-dead", body))

	d := startDaemon(t, cfg)
	t0 := time.Now().UTC().Truncate(time.Second)
	code, m := apiCall(t, "POST", d.URL+"/api/v1/broker/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, t0))
	if code != 202 {
		t.Fatalf("notify: %d %v", code, m)
	}
	// The producer now publishes to B, and so does the webhook endpoint.
	onB := publishN(t, b, "b", 20)
	viaWebhook := newGUID()
	if code := postWebhook(t, d.URL, "pull_request", viaWebhook, loadFixture(t, "pull_request", "synchronize")); code != 202 {
		t.Fatalf("webhook: %d", code)
	}
	onB = append(onB, viaWebhook)

	// While A's retry queues hold messages, the switch stays pending: checks
	// run and decline.
	afterChecks(t, d.logs, 4)
	if got := activeIndex(t, d.URL); got != 0 {
		t.Fatalf("flipped to %d while A's retry queues were not empty", got)
	}

	all := append(append(append([]string{}, onA...), retrying...), onB...)
	storedAll(t, cfg.Database, all, 60*time.Second)
	_, hiA := idRange(t, cfg.Database, append(append([]string{}, onA...), retrying...))
	loB, _ := idRange(t, cfg.Database, onB)
	if hiA >= loB {
		var late string
		_ = openStoreDB(t, cfg.Database).QueryRow("SELECT delivery_id FROM github WHERE id = $1", hiA).Scan(&late)
		t.Errorf("order broken: a message from A (%s) committed (id %d) after one from B (id %d)", late, hiA, loB)
		rows, _ := openStoreDB(t, cfg.Database).Query("SELECT id, delivery_id, processed_at FROM github WHERE id >= $1 ORDER BY id", loB-3)
		for rows.Next() {
			var id int
			var g, at string
			rows.Scan(&id, &g, &at)
			t.Logf("github row %d %s %s", id, g, at)
		}
		rows.Close()
	}
	code, m = apiCall(t, "GET", d.URL+"/api/v1/broker", "operator-token-for-tests", "")
	ls, _ := m["last_switch"].(map[string]any)
	if code != 200 || m["active"].(map[string]any)["index"] != float64(1) || m["pending_switch"] != nil ||
		ls == nil || ls["reason"] != "drained" || ls["from"] != float64(0) || ls["to"] != float64(1) {
		t.Fatalf("after the drain: %d %v", code, m)
	}
	if n := ready(t, a, errorQueue(queueGitHub)); n != 1 {
		t.Errorf("A's github-error: got %d, want the 1 dead message left alone", n)
	}
}

// Double rotation A -> B -> C before the first flip: B is never read while it
// is the pending target; once C is the target, B's stranded messages are
// taken by the Leftover Drain; nothing is left anywhere.
func TestDoubleRotation(t *testing.T) {
	t.Parallel()
	a, b, c := newVhost(t), newVhost(t), newVhost(t)
	// Long enough for the daemon to start and run its checks on a loaded
	// machine while the hold below keeps A from draining.
	retryTTL := 10 * time.Second
	for _, v := range []string{a, b, c} {
		declareTestTopology(t, v, retryTTL)
	}
	cfg := testConfig(t, amqpURL(a), amqpURL(b), amqpURL(c))
	cfg.Queue.RetryTTL = retryTTL

	onA := publishN(t, a, "a", 10)
	// Something in A's retry keeps A from draining for retry_ttl.
	holdA := "a-hold-" + randHex(4)
	body := loadFixture(t, "pull_request", "closed")
	publishRaw(t, a, "", retryQueue(queueGitHub), eventMessage("issues", holdA, body))
	publishRaw(t, a, "", retryQueue(queueDatabase), eventMessage("issues", holdA, body))

	d := startDaemon(t, cfg)
	t0 := time.Now().UTC().Truncate(time.Second)
	if code, m := apiCall(t, "POST", d.URL+"/api/v1/broker/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, t0)); code != 202 {
		t.Fatalf("notify B: %d %v", code, m)
	}
	// The producer publishes to B, then rotates again before A drains.
	onB := publishN(t, b, "b", 10)
	afterChecks(t, d.logs, 4) // cycles ran, with their leftover drains
	left := map[string]int{}
	for _, q := range []string{queueGitHub, queueDatabase} {
		left[q] = ready(t, b, q)
	}
	// An order of events: B is not read while A is not drained, which
	// holds as long as the hold is still in A's retry queues.
	if ready(t, a, retryQueue(queueGitHub))+ready(t, a, retryQueue(queueDatabase)) == 2 {
		for q, n := range left {
			if n != len(onB) {
				t.Fatalf("B's %s was read while B was the pending target: %d of %d left", q, n, len(onB))
			}
		}
	} else {
		t.Logf("the hold left A's retry queues before the checks ran: B's reads tell nothing (%v)", left)
	}
	if code, m := apiCall(t, "POST", d.URL+"/api/v1/broker/pending-switch", "producer-token-for-tests", notification("127.0.0.1", c, t0.Add(time.Second))); code != 202 {
		t.Fatalf("notify C: %d %v", code, m)
	}
	onC := publishN(t, c, "c", 10)

	all := append(append(append(append([]string{}, onA...), holdA), onB...), onC...)
	storedAll(t, cfg.Database, all, 60*time.Second)
	_, hiAB := idRange(t, cfg.Database, append(append(append([]string{}, onA...), holdA), onB...))
	loC, _ := idRange(t, cfg.Database, onC)
	if hiAB >= loC {
		t.Errorf("order broken: a message from A or B committed (id %d) after one from C (id %d)", hiAB, loC)
	}
	if got := activeIndex(t, d.URL); got != 2 {
		t.Errorf("active: got %d, want 2", got)
	}
	d.stop(t)
	for _, v := range []string{a, b, c} {
		for _, q := range allQueues() {
			if n := ready(t, v, q); n != 0 {
				t.Errorf("%s on %s: %d messages left", q, v, n)
			}
		}
	}
}

// An operator switch ends every worker's window at once: with 1-minute windows
// and an hourly cleanup, all three workers read the new broker while their
// windows still hold. An order of events, not a time bound: the wait's
// deadline (30 s) is half a window.
func TestOperatorSwitchMovesWorkers(t *testing.T) {
	t.Parallel()
	onBothStores(t, testOperatorSwitchMovesWorkers)
}

func testOperatorSwitchMovesWorkers(t *testing.T) {
	a, b := newVhost(t), newVhost(t)
	declareTestTopology(t, b, 200*time.Millisecond)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	cfg.Workers.Window = time.Minute
	cfg.Workers.CleanupEvery = time.Hour
	cfg.Workers.CleanupWindow = time.Minute
	d := startDaemon(t, cfg)
	consuming(t, a, queueGitHub, queueDatabase, queueForbidden)

	if code, m := apiCall(t, "POST", d.URL+"/api/v1/broker/switch/1", "operator-token-for-tests", ""); code != 200 {
		t.Fatalf("switch: %d %v", code, m)
	}
	onB := publishN(t, b, "b", 3)
	forbidden := "forbidden-" + randHex(4)
	publishRaw(t, b, "", queueForbidden, eventMessage("issues", forbidden, loadFixture(t, "issues", "opened")))

	db := openStoreDB(t, cfg.Database)
	eventually(t, cfg.Workers.Window/2, "all workers reading B within their windows", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE forbidden = 0") == len(onB) &&
			queryInt(t, db, "SELECT count(*) FROM github WHERE forbidden = 1") == 1 &&
			queryInt(t, db, "SELECT count(*) FROM worker_deliveries") == len(onB)
	})
}

// Active broker unreachable while a switch is pending: no flip and a warning;
// once it is back and drained, the flip. A spare broker that is down does not
// fail a cycle.
func TestPendingSwitchWaitsForUnreachableActive(t *testing.T) {
	t.Parallel()
	a, b, spare := newVhost(t), newVhost(t), newVhost(t)
	declareTestTopology(t, a, 200*time.Millisecond)
	declareTestTopology(t, b, 200*time.Millisecond)
	proxyA := newTCPProxy(t, testBrokerAddr())
	proxySpare := newTCPProxy(t, testBrokerAddr())
	proxySpare.Close() // the spare is down from the start
	cfg := testConfig(t, proxyA.URL(a), amqpURL(b), proxySpare.URL(spare))
	d := startDaemon(t, cfg)

	// Messages on A are processed while the spare is down: its drain is a
	// warning, not a failed cycle.
	onA := publishN(t, a, "a", 3)
	storedAll(t, cfg.Database, onA, 20*time.Second)
	if !strings.Contains(d.logs.String(), "leftover drain skipped broker") {
		t.Errorf("no warning about the unreachable spare")
	}
	if strings.Contains(d.logs.String(), "cycle failed") {
		t.Errorf("a cycle failed because of the spare")
	}

	proxyA.Close()
	t0 := time.Now().UTC().Truncate(time.Second)
	if code, m := apiCall(t, "POST", d.URL+"/api/v1/broker/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, t0)); code != 202 {
		t.Fatalf("notify: %d %v", code, m)
	}
	eventually(t, 10*time.Second, "a warning that the switch waits", func() bool {
		return strings.Contains(d.logs.String(), "pending switch waits")
	})
	afterChecks(t, d.logs, 3)
	if got := activeIndex(t, d.URL); got != 0 {
		t.Fatalf("flipped to %d while the active broker was unreachable", got)
	}

	proxyA.Reopen()
	eventually(t, 30*time.Second, "the flip once A is back", func() bool { return activeIndex(t, d.URL) == 1 })
	onB := publishN(t, b, "b", 3)
	storedAll(t, cfg.Database, onB, 20*time.Second)
}

// Four workers checking the drain at the same moment produce one flip and one
// last_switch.
func TestConcurrentDrainChecks(t *testing.T) {
	t.Parallel()
	onBothStores(t, testConcurrentDrainChecks)
}

func testConcurrentDrainChecks(t *testing.T) {
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	ctx := context.Background()
	p := newParts(t, cfg)
	store, bs, q := p.store, p.brokers, p.queues
	if _, _, err := bs.Notify(ctx, "127.0.0.1", b, time.Now()); err != nil {
		t.Fatal(err)
	}

	var wg sync.WaitGroup
	start := make(chan struct{})
	flips := make(chan bool, 4)
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			ok, err := bs.CompleteIfDrained(ctx, func(ctx context.Context, b *Broker) (bool, error) {
				return q.Drained(ctx, b, logicalQueues)
			})
			if err != nil {
				t.Error(err)
			}
			flips <- ok
		}()
	}
	close(start)
	wg.Wait()
	close(flips)
	n := 0
	for ok := range flips {
		if ok {
			n++
		}
	}
	if n != 1 {
		t.Errorf("flips: got %d, want 1", n)
	}
	st, err := bs.State(ctx)
	if err != nil || st.Active != 1 || st.Pending != nil || st.Last == nil || st.Last.From != 0 || st.Last.To != 1 {
		t.Errorf("state after the flip: %+v %v", st, err)
	}
	var updates int
	if err := store.r.QueryRow("SELECT count(*) FROM settings WHERE key = 'broker.last_switch'").Scan(&updates); err != nil || updates != 1 {
		t.Errorf("last_switch rows: %d %v", updates, err)
	}
}

// A message nacked on a non-active broker during the Leftover Drain goes
// through that broker's retry cycle and is processed later, exactly once.
func TestLeftoverDrainRetry(t *testing.T) {
	t.Parallel()
	onBothStores(t, testLeftoverDrainRetry)
}

func testLeftoverDrainRetry(t *testing.T) {
	a, b := newVhost(t), newVhost(t)
	declareTestTopology(t, b, 200*time.Millisecond)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p := newParts(t, cfg)
	store, bs, q, log, sink := p.store, p.brokers, p.queues, p.log, p.logs

	guid := "leftover-" + randHex(4)
	publishRaw(t, b, "", queueGitHub, eventMessage("issues", guid, loadFixture(t, "issues", "opened")))
	var mu sync.Mutex
	calls := 0
	service := eventFunc(serviceHandler(nil, 0, false))
	h := func(ctx context.Context, tx *Tx, ev *Event) error {
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n == 1 {
			return fmt.Errorf("transient (simulated)")
		}
		return service(ctx, tx, ev)
	}
	w := NewEventWorker(WorkerOptions{Name: "service", Queue: queueGitHub, Window: 300 * time.Millisecond},
		EventOptions{Handle: handlerOf(h), Batch: store}, cfg.Workers, bs, q, log)
	done := make(chan struct{})
	go func() { _ = w.Run(ctx, Holding{}); close(done) }()
	defer func() { cancel(); <-done }()

	eventually(t, 20*time.Second, "the leftover stored", func() bool {
		var n int
		_ = store.r.QueryRow("SELECT count(*) FROM github WHERE delivery_id = $1", guid).Scan(&n)
		return n == 1
	})
	cancel()
	<-done
	mu.Lock()
	if calls != 2 {
		t.Errorf("handled %d times, want 2 (one nack, one success)", calls)
	}
	mu.Unlock()
	if !strings.Contains(sink.String(), "transient failure") {
		t.Errorf("no retry logged")
	}
	for _, name := range []string{queueGitHub, retryQueue(queueGitHub), errorQueue(queueGitHub)} {
		if n := ready(t, b, name); n != 0 {
			t.Errorf("%s on B: %d left", name, n)
		}
	}
}

// `queues` lists all 12 queues on every broker and says which are
// unreachable; `replay` moves -error messages back, a limited number at a time.
func TestQueuesAndReplayCommands(t *testing.T) {
	t.Parallel()
	a := newVhost(t)
	declareTestTopology(t, a, time.Hour)
	proxy := newTCPProxy(t, testBrokerAddr())
	proxy.Close()
	dir := t.TempDir()
	config := writeConfig(t, dir, freeAddr(t), dir+"/switchyard.db", amqpURL(a), proxy.URL("gone"))
	body := loadFixture(t, "issues", "opened")
	for i, name := range allQueues() {
		for j := 0; j <= i%3; j++ {
			publishRaw(t, a, "", name, eventMessage("issues", fmt.Sprintf("%s-%d", name, j), body))
		}
	}

	var out bytes.Buffer
	if err := run(context.Background(), []string{"migrate", "-config", config}, &out, &out); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if err := run(context.Background(), []string{"queues", "-config", config}, &out, &out); err != nil {
		t.Fatalf("queues: %v\n%s", err, out.String())
	}
	for i, name := range allQueues() {
		line := fmt.Sprintf("active  %s  %d  0", name, i%3+1)
		if !strings.Contains(regexpSpaces(out.String()), line) {
			t.Errorf("queues output lacks %q:\n%s", line, out.String())
		}
	}
	var js bytes.Buffer
	if err := run(context.Background(), []string{"queues", "-config", config, "-json"}, &js, &js); err != nil {
		t.Fatalf("queues -json: %v\n%s", err, js.String())
	}
	var views []BrokerView
	if err := json.Unmarshal(js.Bytes(), &views); err != nil {
		t.Fatalf("queues -json: %v\n%s", err, js.String())
	}
	if len(views) != 2 || !views[0].Active || !views[0].Up || views[0].Queues[errorQueue(queueGitHub)].Ready != 3 || views[1].Up || views[1].Error == "" {
		t.Errorf("queues -json: %+v", views)
	}
	if !strings.Contains(out.String(), "unreachable") {
		t.Errorf("queues output does not say the second broker is unreachable:\n%s", out.String())
	}
	if strings.Contains(out.String(), "guest:guest") {
		t.Errorf("queues output shows credentials")
	}

	// github-error holds 3 messages (index 2 in allQueues).
	out.Reset()
	if err := run(context.Background(), []string{"replay", "-config", config, "github", "-limit", "2"}, &out, &out); err != nil {
		t.Fatalf("replay: %v\n%s", err, out.String())
	}
	if got, want := ready(t, a, errorQueue(queueGitHub)), 1; got != want {
		t.Errorf("github-error after replay -limit 2: got %d, want %d", got, want)
	}
	if got, want := ready(t, a, queueGitHub), 1+2; got != want {
		t.Errorf("github after replay: got %d, want %d", got, want)
	}
	if err := run(context.Background(), []string{"replay", "-config", config, "github-error"}, &out, &out); err != nil {
		t.Fatalf("replay: %v", err)
	}
	if got := ready(t, a, errorQueue(queueGitHub)); got != 0 {
		t.Errorf("github-error after full replay: %d left", got)
	}
	if got := ready(t, a, queueGitHub); got != 4 {
		t.Errorf("github after full replay: got %d, want 4", got)
	}
	// Each message moved is a basic.get-ok and a publish on broker a: the
	// command counts them in broker_usage, as the daemon counts its own.
	db := openDB(t, dir+"/switchyard.db")
	if pub, del := queryInt(t, db, "SELECT coalesce(sum(published), 0) FROM broker_usage"),
		queryInt(t, db, "SELECT coalesce(sum(delivered), 0) FROM broker_usage"); pub != 3 || del != 3 {
		t.Errorf("broker_usage after replaying 3 messages: %d published, %d delivered; want 3 and 3", pub, del)
	}
	// A replayed message starts its attempts anew.
	for i := 0; i < 4; i++ {
		m := getOne(t, a, queueGitHub)
		if m.Headers[hdrErrorReason] != nil || m.Headers["x-death"] != nil {
			t.Errorf("replayed message keeps its error headers: %v", m.Headers)
		}
	}
	if err := run(context.Background(), []string{"replay", "-config", config, "nope"}, &out, &out); exitCode(err, &out) != 2 {
		t.Errorf("replay of an unknown queue: got %v, want a usage error", err)
	}
}

// regexpSpaces folds runs of spaces to two, as tabwriter pads columns.
func regexpSpaces(s string) string {
	for strings.Contains(s, "   ") {
		s = strings.ReplaceAll(s, "   ", "  ")
	}
	return s
}

// The cache the webhook routes by never goes back to a state older than the
// last change, however many workers read the state meanwhile.
func TestCachedStateNeverGoesBack(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	p := newParts(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				_, _ = p.brokers.State(ctx)
			}
		}()
	}
	defer func() { cancel(); wg.Wait() }()
	at := time.Now()
	for i := 0; i < 100; i++ {
		at = at.Add(time.Second)
		if _, _, err := p.brokers.Notify(ctx, "127.0.0.1", b, at); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // let any stale read land
		if p.brokers.Cached().Pending == nil {
			t.Fatalf("round %d: the cache lost the Pending Switch just recorded", i)
		}
		if _, _, err := p.brokers.CancelPending(ctx); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond)
		if p.brokers.Cached().Pending != nil {
			t.Fatalf("round %d: the cache brought back a cancelled Pending Switch", i)
		}
	}
}

// Every admin route takes at most 1 MiB of body, whether it reads one or
// not: over that is 413, and nothing changes.
func TestAdminAPIBodyLimits(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	d := startAPI(t, cfg)
	base := d.URL + "/api/v1/broker"
	if code, m := apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, time.Now())); code != 202 {
		t.Fatalf("notify: %d %v", code, m)
	}
	big := strings.Repeat("x", 2<<20)
	for _, tt := range []struct{ method, path, token string }{
		{"POST", "/switch/1", "operator-token-for-tests"},
		{"DELETE", "/pending-switch", "operator-token-for-tests"},
		{"DELETE", "/watermark", "operator-token-for-tests"},
		{"GET", "", "operator-token-for-tests"},
		{"POST", "/pending-switch", "producer-token-for-tests"},
	} {
		t.Run(tt.method+" "+tt.path, func(t *testing.T) {
			if code, m := apiCall(t, tt.method, base+tt.path, tt.token, big); code != http.StatusRequestEntityTooLarge {
				t.Errorf("got %d %v, want 413", code, m)
			}
		})
	}
	code, m := apiCall(t, "GET", base, "operator-token-for-tests", "")
	if code != 200 || m["active"].(map[string]any)["index"] != float64(0) || m["pending_switch"] == nil || m["watermark"] == nil {
		t.Errorf("after the large bodies: %d %v, want broker 0 active, the pending switch and the watermark kept", code, m)
	}
}

// A switchedAt beyond api.max_clock_skew is refused; one within it still
// blocks later real notifications until the operator clears the watermark.
func TestNotifyClockSkewAndWatermark(t *testing.T) {
	t.Parallel()
	onBothStores(t, testNotifyClockSkewAndWatermark)
}

func testNotifyClockSkewAndWatermark(t *testing.T) {
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	d := startAPI(t, cfg)
	base := d.URL + "/api/v1/broker"
	far := time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)
	if code, m := apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, far)); code != 400 {
		t.Fatalf("switchedAt in 9999: got %d %v, want 400", code, m)
	}
	// Four minutes ahead is within the default 5m skew: accepted.
	ahead := time.Now().Add(4 * time.Minute)
	if code, m := apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, ahead)); code != 202 {
		t.Fatalf("switchedAt 4m ahead: got %d %v, want 202", code, m)
	}
	if code, m := apiCall(t, "DELETE", base+"/pending-switch", "operator-token-for-tests", ""); code != 200 {
		t.Fatalf("cancel: %d %v", code, m)
	}
	if code, m := apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, time.Now())); code != 200 || m["reason"] != "stale" {
		t.Fatalf("real notification behind the watermark: got %d %v, want 200 stale", code, m)
	}
	// The producer token may not clear it; the operator may.
	if code, _ := apiCall(t, "DELETE", base+"/watermark", "producer-token-for-tests", ""); code != 403 {
		t.Errorf("producer clearing the watermark: got %d, want 403", code)
	}
	code, m := apiCall(t, "DELETE", base+"/watermark", "operator-token-for-tests", "")
	if code != 200 || m["watermark"] != nil || m["active"] == nil {
		t.Fatalf("DELETE watermark: got %d %v, want 200 with the state and no watermark", code, m)
	}
	if code, m := apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, time.Now())); code != 202 {
		t.Errorf("notification after the watermark was cleared: got %d %v, want 202", code, m)
	}
}

// The watermark keeps nanoseconds: a notification with them, repeated after
// an operator switch, is stale and does not move the broker back.
func TestWatermarkNanoseconds(t *testing.T) {
	t.Parallel()
	onBothStores(t, testWatermarkNanoseconds)
}

func testWatermarkNanoseconds(t *testing.T) {
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	d := startAPI(t, cfg)
	base := d.URL + "/api/v1/broker"
	at := time.Now().Add(-time.Minute).Truncate(time.Second).Add(123456789).Format(time.RFC3339Nano)
	body := fmt.Sprintf(`{"host": "127.0.0.1", "vhost": %q, "switchedAt": %q}`, b, at)
	if code, m := apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", body); code != 202 {
		t.Fatalf("notify: %d %v", code, m)
	}
	if code, m := apiCall(t, "POST", base+"/switch/0", "operator-token-for-tests", ""); code != 200 {
		t.Fatalf("operator switch: %d %v", code, m)
	}
	if code, m := apiCall(t, "POST", base+"/pending-switch", "producer-token-for-tests", body); code != 200 || m["reason"] != "stale" {
		t.Errorf("the same notification again: got %d %v, want 200 stale", code, m)
	}
	code, m := apiCall(t, "GET", base, "operator-token-for-tests", "")
	if code != 200 || m["pending_switch"] != nil || m["active"].(map[string]any)["index"] != float64(0) {
		t.Errorf("state: %d %v, want broker 0 and no pending switch", code, m)
	}
}

// /readyz runs its checks apart, each with its own deadline: a locked
// database is named, and never makes the reachable broker look down too;
// the node stays ready (a webhook takes the broker's path) while the
// broker takes publishes.
func TestReadyzChecksApart(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startAPI(t, cfg)
	if code, answer := do(t, mustRequest(t, http.MethodGet, d.URL+"/readyz")); code != 200 {
		t.Fatalf("/readyz before: %d %s", code, answer)
	}
	lockDatabase(t, cfg.Database.Path)
	for i := 0; i < 4; i++ {
		code, answer := do(t, mustRequest(t, http.MethodGet, d.URL+"/readyz"))
		var got struct{ Problems map[string]string }
		if err := json.Unmarshal([]byte(answer), &got); err != nil {
			t.Fatal(err)
		}
		if code != 200 || got.Problems["database"] == "" {
			t.Errorf("/readyz with the database locked: got %d %s, want 200 naming the database", code, answer)
		}
		if p, ok := got.Problems["broker"]; ok {
			t.Errorf("/readyz blames the reachable broker: %s", p)
		}
	}
}

// With the hooks worker off, a message on github-hooks does not hold a
// Pending Switch: the switch completes, and a warning names the queue.
func TestPendingSwitchIgnoresUnconsumedQueues(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b)) // github.app_id = 0
	declareTestTopology(t, a, cfg.Queue.RetryTTL)
	publishRaw(t, a, "", queueHooks, amqp.Publishing{ContentType: "application/json", Body: []byte(`{"delivery_id": 1, "guid": "g"}`)})
	d := startDaemon(t, cfg)
	if code, m := apiCall(t, "POST", d.URL+"/api/v1/broker/pending-switch", "producer-token-for-tests", notification("127.0.0.1", b, time.Now())); code != 202 {
		t.Fatalf("notify: %d %v", code, m)
	}
	eventually(t, 20*time.Second, "the switch to broker 1", func() bool { return activeIndex(t, d.URL) == 1 })
	if !strings.Contains(d.logs.String(), "unconsumed_queue=github-hooks") {
		t.Errorf("no warning names github-hooks")
	}
	if n := ready(t, a, queueHooks); n != 1 {
		t.Errorf("github-hooks on the old broker: %d messages, want the one left alone", n)
	}
}

// replay while serve runs, with messages that fail again at once: it moves
// what github-error held when it began, once each, and stops; it never
// loops on them. -dry-run lists them and moves nothing; -broker N takes a
// spare broker's stranded errors to the active broker.
func TestReplayWhileServing(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	dir := t.TempDir()
	config := writeConfigWith(t, dir, "127.0.0.1:1", databaseKeys(cfg.Database), "", amqpURL(a), amqpURL(b))
	declareTestTopology(t, a, cfg.Queue.RetryTTL)
	declareTestTopology(t, b, cfg.Queue.RetryTTL)
	for i := 0; i < 5; i++ {
		msg := eventMessage("issues", fmt.Sprintf("bad-%d", i), []byte("<html>not json</html>"))
		msg.Headers[hdrErrorReason] = "payload is not a JSON object"
		msg.Headers[hdrErrorAttempts] = int64(3)
		publishRaw(t, a, "", errorQueue(queueGitHub), msg)
	}
	d := startDaemon(t, cfg)

	var out bytes.Buffer
	if err := run(context.Background(), []string{"replay", "-config", config, "github", "-dry-run"}, &out, &out); err != nil {
		t.Fatalf("replay -dry-run: %v\n%s", err, out.String())
	}
	for i := 0; i < 5; i++ {
		if !strings.Contains(out.String(), fmt.Sprintf("bad-%d", i)) {
			t.Errorf("dry run does not list bad-%d:\n%s", i, out.String())
		}
	}
	if !strings.Contains(regexpSpaces(out.String()), "issues  3  payload is not a JSON object") {
		t.Errorf("dry run lacks event, attempts and reason:\n%s", out.String())
	}
	if n := ready(t, a, errorQueue(queueGitHub)); n != 5 {
		t.Fatalf("github-error after the dry run: %d, want all 5 still there", n)
	}

	out.Reset()
	if err := run(context.Background(), []string{"replay", "-config", config, "github"}, &out, &out); err != nil {
		t.Fatalf("replay: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "replayed 5 of 5 message(s)") {
		t.Errorf("replay moved other than the 5 it found:\n%s", out.String())
	}
	// The service worker fails them again, straight back to github-error.
	eventually(t, 20*time.Second, "the 5 back in github-error", func() bool { return ready(t, a, errorQueue(queueGitHub)) == 5 })

	// Stranded on the spare broker: -broker 1 moves them to the active one.
	body := loadFixture(t, "issues", "opened")
	stranded := []string{newGUID(), newGUID()}
	for _, g := range stranded {
		publishRaw(t, b, "", errorQueue(queueGitHub), eventMessage("issues", g, body))
	}
	out.Reset()
	if err := run(context.Background(), []string{"replay", "-config", config, "-broker", "1", "github-error"}, &out, &out); err != nil {
		t.Fatalf("replay -broker 1: %v\n%s", err, out.String())
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "the stranded deliveries stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id IN ($1, $2)", stranded[0], stranded[1]) == 2
	})
	if n := ready(t, b, errorQueue(queueGitHub)); n != 0 {
		t.Errorf("github-error on broker 1 after replay -broker 1: %d left", n)
	}
	if err := run(context.Background(), []string{"replay", "-config", config, "-broker", "7", "github"}, &out, &out); exitCode(err, &out) != 2 {
		t.Errorf("replay -broker 7: got %v, want a usage error", err)
	}
	d.stop(t)
}

// check-broker passes on the local RabbitMQ (exit 0, every line ok; its
// 20 MiB message zstd-compressed as the daemon publishes, gzip with
// compression off) and fails (exit 1) with the failing line on a vhost
// whose github-retry queue has no TTL, where a failed message would wait
// for ever; its own queues are gone afterwards.
func TestCheckBrokerCommand(t *testing.T) {
	t.Parallel()
	good, noTTL := newVhost(t), newVhost(t)
	ch := amqpChannel(t, noTTL)
	if _, err := ch.QueueDeclare(retryQueue(queueGitHub), true, false, false, false,
		amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": queueGitHub}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	config := writeConfig(t, dir, freeAddr(t), dir+"/switchyard.db", amqpURL(good), amqpURL(noTTL))

	out, code := runBinary(t, "check-broker", "-config", config)
	if code != 0 || strings.Contains(out, "FAIL") || !strings.Contains(out, "the broker fits") {
		t.Errorf("check-broker on the local RabbitMQ: exit %d\n%s", code, out)
	}
	for _, want := range []string{"nack -> -retry -> back", "compressed message, 20 MiB", "(zstd), read back whole", "mandatory publish, no route", "billable messages"} {
		if !strings.Contains(out, want) {
			t.Errorf("check-broker does not tell %q:\n%s", want, out)
		}
	}
	// Its large message goes as the daemon would publish it: gzip with
	// compression off.
	text, err := os.ReadFile(config)
	if err != nil {
		t.Fatal(err)
	}
	gzipConfig := filepath.Join(dir, "gzip.toml")
	if err := os.WriteFile(gzipConfig, []byte(strings.Replace(string(text), "[queue]\n", "[queue]\ncompress = \"none\"\n", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, code := runBinary(t, "check-broker", "-config", gzipConfig, "-broker", "0"); code != 0 || !strings.Contains(out, "(gzip), read back whole") {
		t.Errorf("check-broker with compress = \"none\": exit %d, want its 20 MiB message as gzip\n%s", code, out)
	}
	if n := strings.Count(listQueueNames(t, good), "switchyard-check-"); n != 0 {
		t.Errorf("check-broker left %d queues of its own", n)
	}

	out, code = runBinary(t, "check-broker", "-config", config, "-broker", "1")
	failing := ""
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "FAIL") {
			failing = line
		}
	}
	if code != 1 || !strings.Contains(failing, "topology") || !strings.Contains(failing, "x-message-ttl") {
		t.Errorf("check-broker on a -retry queue without TTL: exit %d, failing line %q\n%s", code, failing, out)
	}
}

// A broker that drops the connection on check-broker's 20 MiB message (its
// size limit lower than that) is named as such, on the last line: every
// check before it is told as the broker answered it.
func TestCheckBrokerDroppedOnLargeMessage(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	proxy.mu.Lock()
	proxy.dropOver = 4 << 20
	proxy.mu.Unlock()
	dir := t.TempDir()
	config := writeConfig(t, dir, freeAddr(t), dir+"/switchyard.db", proxy.URL(vhost))
	out, code := runBinary(t, "check-broker", "-config", config)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var fails []string
	for _, l := range lines {
		if strings.HasPrefix(l, "FAIL") {
			fails = append(fails, l)
		}
	}
	if code != 1 || len(fails) != 1 || !strings.Contains(fails[0], "compressed message") ||
		!strings.Contains(fails[0], "dropped the connection") || !strings.Contains(fails[0], "max_message_bytes") {
		t.Errorf("check-broker through a broker that drops large messages: exit %d, failing lines %q\n%s", code, fails, out)
	}
}

// listQueueNames is rabbitmqctl's list of vhost's queues.
func listQueueNames(t testing.TB, vhost string) string {
	t.Helper()
	var qs []struct{ Name string }
	if managementGet(t, "/api/queues/"+url.PathEscape(vhost), &qs) {
		var names []string
		for _, q := range qs {
			names = append(names, q.Name)
		}
		return strings.Join(names, "\n")
	}
	needRabbitmqctl(t)
	out, err := exec.Command("rabbitmqctl", "-q", "list_queues", "-p", vhost, "name").CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl list_queues: %v %s", err, out)
	}
	return string(out)
}
