package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace/noop"
)

func TestDeathCount(t *testing.T) {
	t.Parallel()
	h := amqp.Table{"x-death": []any{
		amqp.Table{"queue": "github-retry", "reason": "expired", "count": int64(3)},
		amqp.Table{"queue": "github", "reason": "rejected", "count": int64(3)},
		amqp.Table{"queue": "github-database", "reason": "rejected", "count": int64(7)},
	}}
	tests := []struct {
		queue string
		want  int64
	}{{"github", 3}, {"github-database", 7}, {"github-hooks", 0}}
	for _, tt := range tests {
		if got, ok := deathCount(h, tt.queue); got != tt.want || !ok {
			t.Errorf("deathCount(%s): got %d %t, want %d true", tt.queue, got, ok, tt.want)
		}
	}
	if got, ok := deathCount(nil, "github"); got != 0 || !ok {
		t.Errorf("no header: got %d %t, want 0 true", got, ok)
	}
	// LavinMQ up to 2.6.1 splits one queue's rejections over entries that
	// name different exchanges: they add up.
	split := amqp.Table{"x-death": []any{
		amqp.Table{"queue": "github", "reason": "rejected", "exchange": "", "count": int64(4)},
		amqp.Table{"queue": "github-retry", "reason": "expired", "exchange": "", "count": int64(10)},
		amqp.Table{"queue": "github", "reason": "rejected", "exchange": "github-exchange", "count": int64(6)},
	}}
	if got, ok := deathCount(split, "github"); got != 10 || !ok {
		t.Errorf("split entries: got %d %t, want 10 true", got, ok)
	}
	overflow := amqp.Table{"x-death": []any{
		amqp.Table{"queue": "github", "reason": "rejected", "count": int64(math.MaxInt64)},
		amqp.Table{"queue": "github", "reason": "rejected", "count": int64(1)},
	}}
	if _, ok := deathCount(overflow, "github"); ok {
		t.Errorf("counts that overflow: read as valid")
	}
	for _, count := range []any{int64(-1000000), int32(-1), "3", 2.5, nil} {
		forged := amqp.Table{"x-death": []any{amqp.Table{"queue": "github", "reason": "rejected", "count": count}}}
		if _, ok := deathCount(forged, "github"); ok {
			t.Errorf("count %#v: read as valid", count)
		}
	}
}

// consumeUntil runs Consume windows on b until ctx ends.
func consumeUntil(ctx context.Context, q *Queues, b *Broker, o ConsumeOptions) {
	for ctx.Err() == nil {
		if _, err := q.Consume(ctx, b, o, time.Second, nil); err != nil {
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// A transient failure goes to -retry, comes back after retry_ttl, and after
// max_attempts lands in -error with x-attempts; one that then succeeds is
// stored exactly once.
func TestRetryCycle(t *testing.T) {
	t.Parallel()
	for _, queueType := range []string{"classic", "quorum"} {
		t.Run(queueType, func(t *testing.T) {
			t.Parallel()
			testRetryCycle(t, queueType)
		})
	}
}

func testRetryCycle(t *testing.T, queueType string) {
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.MaxAttempts = 3
	cfg.Queue.Type = queueType
	p := newParts(t, cfg)
	store, brokers, q, log := p.store, p.brokers.List(), p.queues, p.log

	failing, flaky := newGUID(), newGUID()
	var mu sync.Mutex
	calls := map[string]int{}
	service := eventFunc(serviceHandler(nil, 0, false))
	h := func(ctx context.Context, tx *Tx, ev *Event) error {
		mu.Lock()
		calls[ev.DeliveryID]++
		n := calls[ev.DeliveryID]
		mu.Unlock()
		switch {
		case ev.DeliveryID == failing:
			return errors.New("database is locked (simulated)")
		case ev.DeliveryID == flaky && n <= 2:
			return errors.New("disk I/O error (simulated)")
		}
		return service(ctx, tx, ev)
	}
	if err := q.Reachable(context.Background(), brokers[0]); err != nil {
		t.Fatal(err)
	}
	body := loadFixture(t, "issues", "opened")
	publishRaw(t, vhost, exchangeName, "", eventMessage("issues", failing, body))
	publishRaw(t, vhost, exchangeName, "", eventMessage("issues", flaky, body))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		consumeUntil(ctx, q, brokers[0], EventOptions{Queue: queueGitHub, Handle: handlerOf(h), Batch: store, Log: log}.options())
		close(done)
	}()
	defer func() { cancel(); <-done }()

	eventually(t, 30*time.Second, "failing message in github-error", func() bool { return ready(t, vhost, errorQueue(queueGitHub)) == 1 })
	d := getOne(t, vhost, errorQueue(queueGitHub))
	if d.MessageId != failing {
		t.Errorf("error queue holds %s, want %s", d.MessageId, failing)
	}
	if got := tableString(d.Headers, hdrErrorAttempts); got != "4" {
		t.Errorf("x-attempts: got %q, want 4 (max_attempts 3, then the 4th failure)", got)
	}
	if got := tableString(d.Headers, hdrErrorReason); !strings.Contains(got, "database is locked") {
		t.Errorf("x-error-reason: got %q", got)
	}
	if string(d.Body) != string(body) {
		t.Errorf("error queue body differs from the original")
	}
	mu.Lock()
	if calls[failing] != 4 {
		t.Errorf("failing message handled %d times, want 4", calls[failing])
	}
	mu.Unlock()

	eventually(t, 10*time.Second, "flaky message stored", func() bool {
		var n int
		_ = store.r.QueryRow("SELECT count(*) FROM github WHERE delivery_id = $1", flaky).Scan(&n)
		return n == 1
	})
	mu.Lock()
	if calls[flaky] != 3 {
		t.Errorf("flaky message handled %d times, want 3", calls[flaky])
	}
	mu.Unlock()
	for _, name := range []string{queueGitHub, retryQueue(queueGitHub), errorQueue(queueGitHub)} {
		if n := ready(t, vhost, name); n != 0 {
			t.Errorf("%s: %d messages left, want 0", name, n)
		}
	}
	var count int
	_ = store.r.QueryRow("SELECT sum(count) FROM github_statistics_6h").Scan(&count)
	if count != 1 {
		t.Errorf("statistics: got %d, want 1 (the flaky message, counted once)", count)
	}
}

// A message whose x-death splits its 10 rejections over two entries (4 and
// 6, two exchanges, as LavinMQ up to 2.6.1 writes them) has used its 10
// attempts: its next failure moves it to -error, with x-attempts 11.
func TestSplitDeathCountEndsInError(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.MaxAttempts = 10
	p := newParts(t, cfg)
	var calls atomic.Int32
	h := func(ctx context.Context, tx *Tx, ev *Event) error {
		calls.Add(1)
		return errors.New("database is locked (simulated)")
	}
	if err := p.queues.Reachable(context.Background(), p.brokers.List()[0]); err != nil {
		t.Fatal(err)
	}
	msg := eventMessage("issues", newGUID(), loadFixture(t, "issues", "opened"))
	msg.Headers["x-death"] = []any{
		amqp.Table{"queue": queueGitHub, "reason": "rejected", "exchange": "", "count": int64(4), "routing-keys": []any{queueGitHub}},
		amqp.Table{"queue": queueGitHub, "reason": "rejected", "exchange": exchangeName, "count": int64(6), "routing-keys": []any{""}},
	}
	publishRaw(t, vhost, "", queueGitHub, msg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		consumeUntil(ctx, p.queues, p.brokers.List()[0], EventOptions{Queue: queueGitHub, Handle: handlerOf(h), Batch: p.store, Log: p.log}.options())
		close(done)
	}()
	defer func() { cancel(); <-done }()
	eventually(t, 30*time.Second, "the message in github-error", func() bool { return ready(t, vhost, errorQueue(queueGitHub)) == 1 })
	d := getOne(t, vhost, errorQueue(queueGitHub))
	if got := tableString(d.Headers, hdrErrorAttempts); got != "11" || calls.Load() != 1 {
		t.Errorf("x-attempts %q after %d failures, want 11 after its first failure here", got, calls.Load())
	}
}

// A malformed message lands in github-error with a reason, and the worker
// keeps going.
func TestMalformedMessages(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	eventually(t, 10*time.Second, "topology declared", func() bool {
		return d.queues.Reachable(context.Background(), d.brokers.List()[0]) == nil
	})
	body := loadFixture(t, "issues", "opened")

	bad := []struct {
		name   string
		msg    amqp.Publishing
		reason string
	}{
		{"no delivery GUID", amqp.Publishing{Type: "issues", Body: body, Headers: amqp.Table{hdrEvent: "issues"}}, "no delivery GUID"},
		{"no event", amqp.Publishing{MessageId: "no-event", Body: body}, "no event name"},
		{"non-JSON body", eventMessage("issues", "non-json", []byte("<html>nope</html>")), "not a JSON object"},
		{"truncated JSON", eventMessage("issues", "truncated", body[:len(body)/2]), "not valid JSON"},
		{"empty body", eventMessage("issues", "empty", nil), "empty body"},
		{"negative x-death count", withDeath(eventMessage("issues", "forged-death", body), int64(-1000000)), reasonBadDeath},
		{"x-death count not an integer", withDeath(eventMessage("issues", "text-death", body), "many"), reasonBadDeath},
	}
	for _, b := range bad {
		publishRaw(t, vhost, "", queueGitHub, b.msg)
	}
	good := newGUID()
	publishRaw(t, vhost, "", queueGitHub, eventMessage("issues", good, body))

	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "good message stored after the bad ones", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", good) == 1
	})
	if n := ready(t, vhost, errorQueue(queueGitHub)); n != len(bad) {
		t.Fatalf("github-error: got %d messages, want %d", n, len(bad))
	}
	for _, b := range bad {
		m := getOne(t, vhost, errorQueue(queueGitHub))
		if got := tableString(m.Headers, hdrErrorReason); !strings.Contains(got, b.reason) {
			t.Errorf("%s: x-error-reason %q, want it to say %q", b.name, got, b.reason)
		}
	}
	if got := queryInt(t, db, "SELECT count(*) FROM github"); got != 1 {
		t.Errorf("github rows: got %d, want 1", got)
	}
	d.stop(t)
	if !strings.Contains(d.logs.String(), "message moved to error queue") {
		t.Fatalf("no line says a message moved to the error queue")
	}
	noRepeatedKeys(t, d.logs.String())
}

// noRepeatedKeys fails for every slog text line that has a key twice (a
// child logger's key added again): log processors keep one of them.
func noRepeatedKeys(t *testing.T, logs string) {
	t.Helper()
	for _, line := range strings.Split(logs, "\n") {
		seen := map[string]bool{}
		for rest := line; rest != ""; {
			key, after, ok := strings.Cut(rest, "=")
			if !ok {
				break
			}
			key = strings.TrimSpace(key)
			if seen[key] {
				t.Errorf("key %q twice in: %s", key, line)
			}
			seen[key] = true
			if strings.HasPrefix(after, `"`) {
				q, err := strconv.QuotedPrefix(after)
				if err != nil {
					break
				}
				after = after[len(q):]
			} else if i := strings.IndexByte(after, ' '); i >= 0 {
				after = after[i:]
			} else {
				after = ""
			}
			rest = after
		}
	}
}

// withDeath gives msg an x-death entry for github, rejected, with count.
func withDeath(msg amqp.Publishing, count any) amqp.Publishing {
	msg.Headers["x-death"] = []any{amqp.Table{"queue": queueGitHub, "reason": "rejected", "count": count}}
	return msg
}

// The wrapped form {"headers": ..., "payload": ...} is read like a plain one.
func TestDecodeWrappedMessage(t *testing.T) {
	t.Parallel()
	payload := loadFixture(t, "pull_request", "opened")
	body := []byte(`{"headers": {"X-GitHub-Event": "pull_request", "X-GitHub-Delivery": "wrapped-1",
		"X-GitHub-Hook-ID": ["42"], "X-GitHub-Hook-Installation-Target-Type": "integration",
		"X-GitHub-Hook-Installation-Target-ID": "9"}, "payload": ` + string(payload) + `}`)
	ev, err := DecodeEvent(deliveryOf(&amqp.Delivery{Body: body}))
	if err != nil {
		t.Fatal(err)
	}
	if ev.DeliveryID != "wrapped-1" || ev.Name != "pull_request" || ev.Action != "opened" ||
		ev.HookID != 42 || ev.TargetType != "integration" || ev.TargetID != 9 {
		t.Errorf("got %+v", ev)
	}
	if string(ev.Payload) != strings.TrimSpace(string(payload)) {
		t.Errorf("payload not unwrapped byte for byte")
	}
	// An object that merely has headers and payload among other keys is a
	// plain payload.
	plain := []byte(`{"headers": {}, "payload": {}, "action": "x"}`)
	ev, err = DecodeEvent(deliveryOf(&amqp.Delivery{Body: plain, MessageId: "p", Type: "custom"}))
	if err != nil || ev.Action != "x" || string(ev.Payload) != string(plain) {
		t.Errorf("got %+v, %v", ev, err)
	}
}

// lockDatabase holds the database's write lock from another connection, as
// another process would, until unlock is called (or the test ends).
func lockDatabase(t testing.TB, path string) (unlock func()) {
	t.Helper()
	locker, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { locker.Close() })
	conn, err := locker.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(context.Background(), "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	unlock = func() {
		once.Do(func() {
			if _, err := conn.ExecContext(context.Background(), "ROLLBACK"); err != nil {
				t.Error(err)
			}
			conn.Close()
		})
	}
	t.Cleanup(unlock)
	return unlock
}

// Database writes failing (the file locked by another process past
// busy_timeout): messages go to -retry, none is acked, none is lost.
func TestDatabaseLockedRetries(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Database.BusyTimeout = 100 * time.Millisecond
	cfg.Queue.MaxAttempts = 1000
	d := startDaemon(t, cfg)

	// Another process's connection holds the write lock.
	unlock := lockDatabase(t, cfg.Database.Path)
	body := loadFixture(t, "issues", "opened")
	var guids []string
	for i := 0; i < 5; i++ {
		g := newGUID()
		guids = append(guids, g)
		if code := postWebhook(t, d.URL, "issues", g, body); code != http.StatusAccepted {
			t.Fatalf("got %d, want 202", code)
		}
	}
	eventually(t, 20*time.Second, "a transient failure retried", func() bool {
		return strings.Contains(d.logs.String(), "transient failure, message will retry")
	})
	logged(t, d.logs, "transient failure, message will retry", 5) // a few retry cycles while locked
	unlock()

	db := openStoreDB(t, cfg.Database)
	eventually(t, 30*time.Second, "all stored once the lock goes", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") == len(guids)
	})
	eventually(t, 30*time.Second, "database-service caught up", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM worker_deliveries") == len(guids)
	})
	d.stop(t)
	for _, g := range guids {
		if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", g); n != 1 {
			t.Errorf("delivery %s: %d rows, want 1", g, n)
		}
	}
	if n := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h"); n != len(guids) {
		t.Errorf("statistics: got %d, want %d", n, len(guids))
	}
	for _, q := range allQueues() {
		if n := ready(t, vhost, q); n != 0 {
			t.Errorf("%s: %d messages left", q, n)
		}
	}
}

// Every log line about a message says which worker, queue, broker, delivery
// and event it is about, including the handlers' own lines.
func TestMessageLogLines(t *testing.T) {
	t.Parallel()
	smtp, push := newSMTPSink(t), newPushSink(t)
	cfg := alertConfig(t, smtp.addr, push.srv.URL, "issues.opened")
	d := startDaemon(t, cfg)
	guid := newGUID()
	postWebhook(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened"))
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "alert recorded", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND alerted_at IS NOT NULL", guid) == 1
	})
	eventually(t, 20*time.Second, "database-service done", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = $1", guid) == 1
	})
	d.stop(t)
	var lines []string
	for _, l := range strings.Split(d.logs.String(), "\n") {
		if strings.Contains(l, guid) && !strings.Contains(l, "webhook queued") {
			lines = append(lines, l)
		}
	}
	if len(lines) < 2 {
		t.Fatalf("expected the alert and typed-table lines, got:\n%s", strings.Join(lines, "\n"))
	}
	noRepeatedKeys(t, d.logs.String())
	for _, l := range lines {
		keys := []string{"worker=", "queue=", "broker=", "delivery_id=", "event="}
		if strings.Contains(l, "worker=alerts") {
			// The alert sender works after the commit, from alert_outbox,
			// not on a message: no queue or broker to name.
			keys = []string{"channel=", "delivery_id=", "event="}
		}
		for _, key := range keys {
			if !strings.Contains(l, key) {
				t.Errorf("line lacks %s: %s", key, l)
			}
		}
	}
}

// With prefetch above 1, messages are committed in batches with one multiple
// ack: malformed and failing messages inside a batch are settled on their
// own, and everything else is stored exactly once, in order. A database
// locked past busy_timeout fails whole batches, whose messages retry.
func TestBatchedCommits(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	declareTestTopology(t, vhost, 200*time.Millisecond)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.Prefetch = 25
	cfg.Queue.MaxAttempts = 1000
	cfg.Database.BusyTimeout = 100 * time.Millisecond
	p := newParts(t, cfg)
	b := p.brokers.List()[0]

	body := loadFixture(t, "issues", "opened")
	var guids []string
	for i := 0; i < 200; i++ {
		g := fmt.Sprintf("batch-%03d-%s", i, randHex(3))
		guids = append(guids, g)
		publishRaw(t, vhost, "", queueGitHub, eventMessage("issues", g, body))
		if i%50 == 7 {
			publishRaw(t, vhost, "", queueGitHub, eventMessage("issues", "bad-"+g, []byte("not json")))
		}
	}
	failOnce := map[string]bool{guids[10]: true, guids[111]: true}
	var mu sync.Mutex
	service := eventFunc(serviceHandler(nil, 0, false))
	h := func(ctx context.Context, tx *Tx, ev *Event) error {
		mu.Lock()
		fail := failOnce[ev.DeliveryID]
		delete(failOnce, ev.DeliveryID)
		mu.Unlock()
		if fail {
			return errors.New("transient (simulated)")
		}
		return service(ctx, tx, ev)
	}

	// The database is locked while the first batches arrive.
	unlock := lockDatabase(t, cfg.Database.Path)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		consumeUntil(ctx, p.queues, b, EventOptions{Queue: queueGitHub, Handle: handlerOf(h), Batch: p.store, Log: p.log}.options())
		close(done)
	}()
	defer func() { cancel(); <-done }()
	eventually(t, 10*time.Second, "a failed batch", func() bool {
		return strings.Contains(p.logs.String(), "batch not committed")
	})
	unlock()

	eventually(t, 30*time.Second, "all stored", func() bool {
		var n int
		_ = p.store.r.QueryRow("SELECT count(*) FROM github").Scan(&n)
		return n == len(guids)
	})
	eventually(t, 10*time.Second, "queues settled", func() bool {
		return ready(t, vhost, queueGitHub) == 0 && ready(t, vhost, retryQueue(queueGitHub)) == 0
	})
	if n := ready(t, vhost, errorQueue(queueGitHub)); n != 4 {
		t.Errorf("github-error: %d, want the 4 malformed messages", n)
	}
	var stats int
	_ = p.store.r.QueryRow("SELECT sum(count) FROM github_statistics_6h").Scan(&stats)
	if stats != len(guids) {
		t.Errorf("statistics: %d, want %d", stats, len(guids))
	}
	if !strings.Contains(p.logs.String(), "transient failure") {
		t.Errorf("the simulated failures did not retry")
	}
	if n := p.queues.conns[0].inHand.Load(); n != 0 {
		t.Errorf("in-hand count after the run: %d, want 0", n)
	}
}

// A batch's messages are decoded (and prepared) ahead of its transaction: the
// handler of the first message sees a later one prepared before it returns,
// and the batch is still stored in the order it came in. The batch is handed
// to the handler whole: taken from a queue, how many messages make one
// batch depends on how fast they arrive (batchGap).
func TestBatchDecodesAhead(t *testing.T) {
	t.Parallel()
	p := newParts(t, testConfig(t, amqpURL("unused")))

	body := loadFixture(t, "issues", "opened")
	var guids []string
	var msgs []Message
	for i := 0; i < 20; i++ {
		g := fmt.Sprintf("ahead-%02d-%s", i, randHex(3))
		guids = append(guids, g)
		m := eventMessage("issues", g, body)
		msgs = append(msgs, Message{ID: m.MessageId, Type: m.Type, Headers: m.Headers, Body: m.Body, Timestamp: m.Timestamp})
	}
	var prepared atomic.Int64
	secondPrepared := make(chan struct{})
	decode := func(d Delivery) (Decoded, error) {
		ev, err := DecodeEvent(d)
		if prepared.Add(1) == 2 {
			close(secondPrepared)
		}
		return Decoded{Event: ev}, err
	}
	service := eventFunc(serviceHandler(nil, 0, false))
	var handled atomic.Int64
	h := func(ctx context.Context, tx *Tx, ev *Event) error {
		if handled.Add(1) == 1 {
			select {
			case <-secondPrepared:
			case <-time.After(30 * time.Second):
				t.Error("the second message was not decoded while the first was handled")
			}
		}
		return service(ctx, tx, ev)
	}
	o := EventOptions{Queue: queueGitHub, Handle: handlerOf(h), Decode: decode, Batch: p.store, Log: p.log}
	verdicts, err := o.handleBatch(context.Background(), msgs)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range verdicts {
		if v != nil {
			t.Errorf("%s: %v", guids[i], v)
		}
	}
	rows, err := p.store.r.Query("SELECT delivery_id FROM github ORDER BY rowid")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var g string
		if err := rows.Scan(&g); err != nil {
			t.Fatal(err)
		}
		got = append(got, g)
	}
	if !slices.Equal(got, guids) {
		t.Errorf("stored order:\n%v\nwant\n%v", got, guids)
	}
	if n := prepared.Load(); n != int64(len(guids)) {
		t.Errorf("prepared %d messages, want %d", n, len(guids))
	}
}

// unacked is the broker's count of messages delivered on queue and not yet
// acknowledged.
func unacked(t testing.TB, vhost, queue string) int {
	t.Helper()
	var q struct {
		Unacked int `json:"messages_unacknowledged"`
	}
	if managementGet(t, "/api/queues/"+url.PathEscape(vhost)+"/"+url.PathEscape(queue), &q) {
		return q.Unacked
	}
	needRabbitmqctl(t)
	out, err := exec.Command("rabbitmqctl", "-q", "--no-table-headers", "list_queues", "-p", vhost, "name", "messages_unacknowledged").CombinedOutput()
	if err != nil {
		t.Fatalf("list_queues: %v: %s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == queue {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	t.Fatalf("queue %s not listed on %s", queue, vhost)
	return 0
}

// A consumer holds at most queue.max_batch_bytes of messages, whatever the
// prefetch: 1 MB payloads at prefetch 200 and a 4 MiB bound are delivered
// four at a time, and payloads of a few KB then fill the whole window.
// The 1 MB payloads come zstd-compressed, a fifth of that on the wire: the
// window counts them as held, inflated.
func TestConsumerWindowBoundedByBytes(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.Prefetch = 200
	cfg.Queue.MaxBatchBytes = 4 << 20
	declareTestTopology(t, vhost, cfg.Queue.RetryTTL)
	big := paddedPayload(t, 1<<20)
	for i := 0; i < 40; i++ {
		msg := eventMessage("pull_request", fmt.Sprintf("big-%d", i), big)
		msg.Body, msg.ContentEncoding = compressZstd(big), encodingZstd
		publishRaw(t, vhost, "", queueGitHub, msg)
	}
	p := newParts(t, cfg)
	release := make(chan struct{})
	var handled atomic.Int64
	h := func(ctx context.Context, tx *Tx, ev *Event) error {
		if handled.Add(1) == 1 {
			<-release // hold the first batch until the broker's count is read
		}
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go consumeUntil(ctx, p.queues, p.brokers.List()[0], EventOptions{Queue: queueGitHub, Handle: handlerOf(h), Batch: p.store, Log: p.log}.options())
	eventually(t, 10*time.Second, "the first delivery handled", func() bool { return handled.Load() == 1 })
	if n := unacked(t, vhost, queueGitHub); n > 4 {
		t.Errorf("unacked 1 MB messages with a 4 MiB bound: %d, want at most 4", n)
	}
	close(release)
	eventually(t, 30*time.Second, "all 40 handled", func() bool { return handled.Load() == 40 })
	if got := p.queues.readers[0].window(queueGitHub); got != 4 {
		t.Errorf("window after 1 MB messages: %d, want 4", got)
	}
	small := loadFixture(t, "issues", "opened")
	for i := 0; i < 20; i++ {
		publishRaw(t, vhost, "", queueGitHub, eventMessage("issues", fmt.Sprintf("small-%d", i), small))
	}
	eventually(t, 30*time.Second, "the window grown for small messages", func() bool {
		return handled.Load() == 60 && p.queues.readers[0].window(queueGitHub) == 200
	})
}

// A batch waits batchGap for its next message, and once it is filling
// batchGap for each message it holds, never past its window: a lone message
// waits 2 ms, not the window's 10, and so do the few that queued behind a
// checkpoint.
func TestBatchWait(t *testing.T) {
	t.Parallel()
	far := time.Now().Add(time.Hour)
	if got := batchWait(1, far); got != batchGap {
		t.Errorf("one message held: waits %v, want %v", got, batchGap)
	}
	if got := batchWait(batchFilling-1, far); got != batchGap {
		t.Errorf("%d held: waits %v, want %v", batchFilling-1, got, batchGap)
	}
	if got := batchWait(batchFilling+1, far); got != (batchFilling+1)*batchGap {
		t.Errorf("%d held: waits %v, want %v", batchFilling+1, got, (batchFilling+1)*batchGap)
	}
	if got := batchWait(100, time.Now().Add(batchWindow)); got > batchWindow {
		t.Errorf("a hundred held with the window ending in %v: waits %v", batchWindow, got)
	}
	if got := batchWait(3, time.Now().Add(-time.Millisecond)); got > 0 {
		t.Errorf("window over: waits %v, want none", got)
	}
}

// The average message size follows how many messages were seen, not how
// they fell into batches: twenty small messages after 1 MB ones give the
// same window whether a batch closed full or on batchGap or batchWindow
// (the old per-batch rule left 1/16 of the megabyte after batches of 2, 4,
// 7 and 7).
func TestMessageSizesFollowMessages(t *testing.T) {
	t.Parallel()
	const small = 13_500
	for _, split := range [][]int{{20}, {2, 4, 7, 7}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {3, 3, 2, 2}} {
		var m messageSizes
		m.observe("q", 4, 4<<20)
		total := 0
		for _, n := range split {
			m.observe("q", n, int64(n*small))
			total += n
		}
		if got := m.get("q"); got > small+small/10 {
			t.Errorf("after %d small messages in batches %v: average %d, want within 10%% of %d", total, split, got, small)
		}
	}
	var m messageSizes
	m.observe("q", 20, 20*small)
	m.observe("q", 1, 1<<20)
	if got := m.get("q"); got < 1<<19 {
		t.Errorf("one 1 MB message after small ones: average %d, want at least half of it", got)
	}
}

// A batch's failures reach the broker only after its transaction: while the
// batch is still open, the message that failed for good earlier in it is not
// in -error yet (the old order published it there, and waited for the
// confirm, inside the transaction, on the only writer connection). One bad
// message in every ten, so that some of them sit mid-batch however the
// broker's deliveries fall into batches on a loaded machine.
func TestBatchFailuresSettledAfterCommit(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	declareTestTopology(t, vhost, time.Hour)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.RetryTTL = time.Hour
	p := newParts(t, cfg)
	body := loadFixture(t, "issues", "opened")
	bad := map[string]bool{}
	for i := 0; i < 100; i++ {
		id := newGUID()
		if i%10 == 0 {
			id = "bad-" + randHex(4)
			bad[id] = true
		}
		publishRaw(t, vhost, "", queueGitHub, eventMessage("issues", id, body))
	}

	var mu sync.Mutex
	inErrorAt := map[*Tx]int{} // -error's depth when a bad message failed in the transaction
	var after, early int       // messages handled in a bad one's transaction after it, and how many saw it in -error
	service := eventFunc(serviceHandler(nil, 0, false))
	h := func(ctx context.Context, tx *Tx, ev *Event) error {
		mu.Lock()
		defer mu.Unlock()
		if bad[ev.DeliveryID] {
			if _, seen := inErrorAt[tx]; !seen {
				inErrorAt[tx] = ready(t, vhost, errorQueue(queueGitHub))
			}
			return permanent("refused (simulated)")
		}
		if n, ok := inErrorAt[tx]; ok && tx != nil {
			after++
			if ready(t, vhost, errorQueue(queueGitHub)) > n {
				early++
			}
		}
		return service(ctx, tx, ev)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		consumeUntil(ctx, p.queues, p.brokers.List()[0], EventOptions{Queue: queueGitHub, Handle: handlerOf(h), Batch: p.store, Log: p.log}.options())
		close(done)
	}()
	defer func() { cancel(); <-done }()
	eventually(t, 30*time.Second, "the refused messages in -error, the others stored", func() bool {
		var n int
		_ = p.store.r.QueryRow("SELECT count(*) FROM github").Scan(&n)
		return n == 90 && ready(t, vhost, errorQueue(queueGitHub)) == len(bad)
	})
	mu.Lock()
	defer mu.Unlock()
	if after == 0 {
		t.Fatal("every refused message ended its batch: nothing to observe (no batch held more than one)")
	}
	if early > 0 {
		t.Errorf("%d of %d messages handled in a transaction after a refused one saw it in -error already", early, after)
	}
}

// declareTopologyOf declares the 12 queues on vhost as cfg says.
func declareTopologyOf(t testing.TB, vhost string, cfg QueueConfig) {
	t.Helper()
	cfg.DeclareTopology = true
	q := NewQueues(cfg, mustBrokers(t, amqpURL(vhost)), nil, noop.NewTracerProvider(), slog.New(slog.DiscardHandler))
	defer q.Close()
	if err := q.Reachable(context.Background(), q.conns[0].broker); err != nil {
		t.Fatal(err)
	}
}

// With queue.type = "quorum" every queue is declared quorum, and the whole
// cycle works on them: the drain check holds a Pending Switch until the
// active broker is drained, the Leftover Drain empties a broker nobody
// reads, and a replay from -error (a compressed message among them) is
// stored. (The retry cycle and -error: TestRetryCycle/quorum.)
func TestQuorumQueues(t *testing.T) {
	t.Parallel()
	a, b, c := newVhost(t), newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b), amqpURL(c))
	cfg.Queue.Type = "quorum"
	// A quorum queue's declaration goes through Raft: on a loaded machine
	// 36 of them take longer than the tests' call_timeout of 3 s. The
	// default's 10 s, as a user runs it.
	cfg.Queue.CallTimeout = DefaultConfig().Queue.CallTimeout
	for _, v := range []string{a, b, c} {
		declareTopologyOf(t, v, cfg.Queue)
	}
	if testBroker().local {
		out, err := exec.Command("rabbitmqctl", "-q", "list_queues", "-p", a, "name", "type").CombinedOutput()
		if n := strings.Count(string(out), "quorum"); err != nil || n != 12 {
			t.Errorf("queues of type quorum: %d (%v), want 12:\n%s", n, err, out)
		}
	}
	onA := publishN(t, a, "a", 10)
	onC := publishN(t, c, "c", 5) // neither active nor pending: the Leftover Drain's
	body := loadFixture(t, "issues", "opened")
	dead, packed := newGUID(), newGUID()
	publishRaw(t, a, "", errorQueue(queueGitHub), eventMessage("issues", dead, body))
	big := largeIssue(t, 2<<20)
	msg := eventMessage("issues", packed, big)
	msg.Body, msg.ContentEncoding = compressGzip(big), encodingGzip
	publishRaw(t, a, "", errorQueue(queueGitHub), msg)

	d := startDaemon(t, cfg)
	code, m := apiCall(t, "POST", d.URL+"/api/v1/broker/pending-switch", "producer-token-for-tests",
		notification("127.0.0.1", b, time.Now().UTC().Truncate(time.Second)))
	if code != 202 {
		t.Fatalf("notify: %d %v", code, m)
	}
	onB := publishN(t, b, "b", 5)
	storedAll(t, cfg.Database, append(append(append([]string{}, onA...), onB...), onC...), 60*time.Second)
	eventually(t, 30*time.Second, "the switch to b once a is drained", func() bool { return activeIndex(t, d.URL) == 1 })
	_, hiA := idRange(t, cfg.Database, onA)
	loB, _ := idRange(t, cfg.Database, onB)
	if hiA >= loB {
		t.Errorf("order broken: a message from a committed after one from b")
	}

	brokers := d.brokers.List()
	moved, total, err := d.queues.Replay(context.Background(), brokers[0], brokers[1], queueGitHub, 0, nil)
	if err != nil || moved != 2 || total != 2 {
		t.Fatalf("replay: %d of %d, %v; want 2 of 2", moved, total, err)
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, 30*time.Second, "the replayed deliveries stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id IN ($1, $2)", dead, packed) == 2
	})
	if got := storedPayload(t, d.store, packed); got != string(big) {
		t.Errorf("the compressed delivery stored with %d bytes, want its %d", len(got), len(big))
	}
	for _, v := range []string{a, c} {
		for _, q := range []string{queueGitHub, queueDatabase, retryQueue(queueGitHub), errorQueue(queueGitHub)} {
			if n := ready(t, v, q); n != 0 {
				t.Errorf("%s on %s: %d left", q, v, n)
			}
		}
	}
}
