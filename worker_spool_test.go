package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// sent is one webhook of an open-loop stream: its place in the order
// sent, its delivery, and its answer (code 0 when the request failed).
type sent struct {
	seq  int
	guid string
	code int
	body string
	err  error
}

// openLoop sends a signed webhook to url every every, each in its own
// request on a new connection with GitHub's 10 s timeout, whatever the
// earlier ones take, as GitHub does, until stop is called; stop waits for
// every answer and returns them in the order sent.
func openLoop(t testing.TB, url func() string, every time.Duration) (stop func() []sent) {
	return webhooksEvery(t, url, every, false)
}

// orderedStream sends a signed webhook to url every every, each once the
// one before it was answered (so that the order they were sent in is the
// order they arrived in), until stop is called; stop returns every answer
// in the order sent.
func orderedStream(t testing.TB, url string, every time.Duration) (stop func() []sent) {
	return webhooksEvery(t, func() string { return url }, every, true)
}

// webhooksEvery is openLoop, or orderedStream when inOrder.
func webhooksEvery(t testing.TB, url func() string, every time.Duration, inOrder bool) (stop func() []sent) {
	body := loadFixture(t, "issues", "opened")
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	var mu sync.Mutex
	var got []sent
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(every)
		defer tick.Stop()
		for seq := 0; ; seq++ {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			s := sent{seq: seq, guid: newGUID()}
			req := webhookRequest(t, url(), "issues", s.guid, body)
			send := func() {
				s.code, s.body, s.err = doQuiet(client, req)
				mu.Lock()
				got = append(got, s)
				mu.Unlock()
			}
			if inOrder {
				send()
			} else {
				wg.Go(send)
			}
		}
	})
	var once sync.Once
	stop = func() []sent {
		once.Do(func() { close(done) })
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		out := make([]sent, len(got))
		for _, s := range got {
			out[s.seq] = s
		}
		return out
	}
	t.Cleanup(func() { stop() }) // a test that failed before stopping it
	return stop
}

// doQuiet sends req and reads its answer, without failing the test.
func doQuiet(client *http.Client, req *http.Request) (int, string, error) {
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// allSpooledOrQueued fails the test for every answer that is not a 202,
// and returns how many were spooled.
func allSpooledOrQueued(t testing.TB, answers []sent) (spooled int) {
	t.Helper()
	bad := 0
	for _, a := range answers {
		if a.code != http.StatusAccepted {
			if bad++; bad <= 5 {
				t.Errorf("webhook %d (%s): %d %q %v, want 202", a.seq, a.guid, a.code, a.body, a.err)
			}
			continue
		}
		if strings.Contains(a.body, `"status":"spooled"`) {
			spooled++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d webhooks not answered 202", bad, len(answers))
	}
	return spooled
}

// storedInOrder checks that every webhook of answers is stored once in
// the raw log, and in the order sent.
func storedInOrder(t testing.TB, db DatabaseConfig, answers []sent) {
	t.Helper()
	guids := make([]string, len(answers))
	seq := map[string]int{}
	for i, a := range answers {
		guids[i], seq[a.guid] = a.guid, a.seq
	}
	storedAll(t, db, guids, 2*time.Minute)
	conn := openStoreDB(t, db)
	rows, err := conn.Query("SELECT delivery_id, count(*) OVER (PARTITION BY delivery_id) FROM github ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	last, stored := -1, 0
	for rows.Next() {
		var guid string
		var copies int
		if err := rows.Scan(&guid, &copies); err != nil {
			t.Fatal(err)
		}
		n, ours := seq[guid]
		if !ours {
			continue
		}
		stored++
		if copies != 1 {
			t.Errorf("webhook %d (%s) stored %d times, want once", n, guid, copies)
		}
		if n < last {
			t.Errorf("webhook %d (%s) stored after webhook %d (%s): not in the order sent", n, guid, last, answers[last].guid)
		}
		last = max(last, n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if stored != len(answers) {
		t.Errorf("%d rows for %d webhooks", stored, len(answers))
	}
}

// The broker's link cut for 45 s under a steady stream of 20 webhooks a
// second, each sent once the one before was answered: every request is answered 202 (from the spool while the link is
// down), /readyz stays 200 naming the spool, the spool's gauges show it,
// and once the link is back every webhook is stored once, in the order
// sent, the spooled ones' stories telling when they were spooled and
// published.
func TestSpoolBrokerLinkCut(t *testing.T) {
	t.Parallel()
	onBothStores(t, testSpoolBrokerLinkCut)
}

func testSpoolBrokerLinkCut(t *testing.T) {
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Log.Level = "info"
	d := startDaemon(t, cfg)
	// The stream starts once the daemon answers: webhooks that waited
	// for it together would be taken at once, in no order.
	eventually(t, 30*time.Second, "the daemon ready", func() bool { return answersOK(d.URL + "/readyz") })
	stop := orderedStream(t, d.URL, 50*time.Millisecond)

	eventually(t, 30*time.Second, "webhooks stored before the cut", func() bool {
		return scrape(t, d.URL+"/metrics")[`switchyard_webhooks_received_total{outcome="accepted"}`] >= 20
	})
	proxy.Close()
	eventually(t, 30*time.Second, "webhooks spooled while the link is cut", func() bool {
		return scrape(t, d.URL+"/metrics")["switchyard_spool_messages"] >= 20
	})
	code, ready := do(t, httpRequest(t, http.MethodGet, d.URL+"/readyz", "", ""))
	if code != http.StatusOK || !strings.Contains(ready, `"spool"`) {
		t.Errorf("/readyz while spooling: %d %s, want 200 naming the spool", code, ready)
	}
	for i := 0; i < 45; i++ { // 45 s of the cut, the stream going on
		time.Sleep(time.Second)
	}
	back := time.Now()
	if proxy.Reopen(); t.Failed() {
		stop()
		return
	}
	eventually(t, time.Minute, "the spool drained", func() bool {
		m := scrape(t, d.URL+"/metrics")
		return m["switchyard_spool_messages"] == 0 && m[`switchyard_webhooks_received_total{outcome="accepted"}`] > 0 &&
			!d.spool.Spooling()
	})
	consumersBackWithBroker(t, d.Daemon, back)
	before := scrape(t, d.URL+"/metrics")[`switchyard_webhooks_received_total{outcome="accepted"}`]
	eventually(t, 30*time.Second, "webhooks published directly again", func() bool {
		return scrape(t, d.URL+"/metrics")[`switchyard_webhooks_received_total{outcome="accepted"}`] >= before+20
	})
	answers := stop()
	spooled := allSpooledOrQueued(t, answers)
	if spooled < 45*20/2 {
		t.Errorf("%d of %d webhooks spooled, want the cut's 45 s of them", spooled, len(answers))
	}
	storedInOrder(t, cfg.Database, answers)

	// A spooled webhook's story says when it was spooled and published.
	for _, a := range answers {
		if !strings.Contains(a.body, "spooled") {
			continue
		}
		st, err := d.store.Story(context.Background(), a.guid)
		if err != nil || len(st.Spooled) != 1 || st.Spooled[0].PublishedAt == nil || st.Spooled[0].Reason == "" {
			t.Errorf("the story of spooled webhook %s: %v %+v, want it spooled and published once", a.guid, err, st.Spooled)
		}
		var text strings.Builder
		for _, l := range st.Lines() {
			text.WriteString(l.Label + ": " + l.Text + "\n")
		}
		if !strings.Contains(text.String(), "spooled: ") || !strings.Contains(text.String(), "published") {
			t.Errorf("the story's text of spooled webhook %s does not tell the spool:\n%s", a.guid, text.String())
		}
		break
	}
}

// A spool full (a small queue.spool_max_bytes) with the broker away: a
// webhook it cannot take is answered 503 naming the spool, and every one
// answered 202 before is stored once the broker is back.
func TestSpoolFull(t *testing.T) {
	t.Parallel()
	onBothStores(t, testSpoolFull)
}

func testSpoolFull(t *testing.T) {
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Queue.SpoolMaxBytes = 64 << 10
	cfg.Log.Level = "info"
	d := startDaemon(t, cfg)
	eventually(t, 30*time.Second, "the daemon ready", func() bool { return answersOK(d.URL + "/readyz") })
	proxy.Close()
	body := loadFixture(t, "issues", "opened")
	var accepted []string
	var refused string
	for i := 0; i < 1000 && refused == ""; i++ {
		guid := newGUID()
		switch code, answer := do(t, webhookRequest(t, d.URL, "issues", guid, body)); code {
		case http.StatusAccepted:
			if !strings.Contains(answer, `"spooled"`) {
				t.Fatalf("a webhook while the broker is away: %s, want it spooled", answer)
			}
			accepted = append(accepted, guid)
		case http.StatusServiceUnavailable:
			refused = answer
		default:
			t.Fatalf("a webhook while the broker is away: %d %s", code, answer)
		}
	}
	if refused == "" || !strings.Contains(refused, "spool is full") || !strings.Contains(refused, "broker unreachable") {
		t.Fatalf("the spool full: %q, want 503 naming the broker and the full spool", refused)
	}
	if len(accepted) < 2 {
		t.Fatalf("only %d webhooks spooled before the spool was full", len(accepted))
	}
	code, ready := do(t, httpRequest(t, http.MethodGet, d.URL+"/readyz", "", ""))
	if code != http.StatusServiceUnavailable || !strings.Contains(ready, `"spool":"full"`) {
		t.Errorf("/readyz with the spool full: %d %s, want 503 naming the spool", code, ready)
	}
	// The status names the spool, full, and the webhooks of the last
	// hour spooled and refused, with why.
	var st Status
	eventually(t, 30*time.Second, "the refusal in the status", func() bool {
		_, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
		st = Status{}
		return json.Unmarshal([]byte(raw), &st) == nil && len(st.Refused) > 0
	})
	if sp := st.Spool; sp == nil || !sp.Full || sp.Messages != int64(len(accepted)) || sp.Oldest == nil || len(sp.Brokers) != 1 {
		t.Errorf("the status's spool: %+v, want %d webhooks waiting, full", sp, len(accepted))
	}
	// The first found the broker away; the others went in behind it.
	spooled, why := 0, map[string]int{}
	for _, r := range st.Spooled {
		spooled += r.Count
		why[r.Reason] += r.Count
	}
	if spooled != len(accepted) || why["broker unreachable"] == 0 || why["broker unreachable"]+why["behind earlier spooled webhooks"] != spooled ||
		st.Refused[0].Status != http.StatusServiceUnavailable || !strings.HasPrefix(st.Refused[0].Reason, "broker unreachable") {
		t.Errorf("the last hour in the status: spooled %+v, refused %+v", st.Spooled, st.Refused)
	}
	problems := strings.Join(st.Problems, "\n")
	for _, want := range []string{"the spool is full", "refused with 503 in the last hour"} {
		if !strings.Contains(problems, want) {
			t.Errorf("the status's problems lack %q:\n%s", want, problems)
		}
	}
	var text bytes.Buffer
	writeStatus(&text, st)
	if !strings.Contains(text.String(), "spool: "+plural(len(accepted), "webhook")) || !strings.Contains(text.String(), "refused in the last hour") {
		t.Errorf("status's text does not tell the spool and the refusals:\n%s", text.String())
	}
	proxy.Reopen()
	storedAll(t, cfg.Database, accepted, time.Minute)
	eventually(t, 30*time.Second, "the spool drained", func() bool { return !d.spool.Spooling() })
	if code, answer := do(t, webhookRequest(t, d.URL, "issues", newGUID(), body)); code != http.StatusAccepted ||
		!strings.Contains(answer, `"queued"`) {
		t.Errorf("a webhook once the spool drained: %d %s, want 202 queued", code, answer)
	}
}

// serve SIGKILLed while it spools, the broker away: once the broker is
// back and serve runs again, every webhook answered 202 is stored once.
func TestSpoolSurvivesSIGKILL(t *testing.T) {
	t.Parallel()
	onBothStores(t, testSpoolSurvivesSIGKILL)
}

func testSpoolSurvivesSIGKILL(t *testing.T) {
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	dir := t.TempDir()
	db := testStore(t)
	if db.Driver != "postgres" {
		db.Path = filepath.Join(dir, "switchyard.db")
	}
	addr := freeAddr(t)
	config := writeConfigWith(t, dir, addr, databaseKeys(db), "", proxy.URL(vhost))
	cmd, out := startProcess(t, config, addr)
	url := "http://" + addr
	proxy.Close()
	stop := openLoop(t, func() string { return url }, 20*time.Millisecond)
	eventually(t, 30*time.Second, "webhooks spooled", func() bool {
		return scrape(t, url+"/metrics")["switchyard_spool_messages"] >= 50
	})
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	answers := stop()
	var accepted []string
	for _, a := range answers {
		if a.code == http.StatusAccepted {
			accepted = append(accepted, a.guid)
		}
	}
	// Those spooled were answered as the kill came, or not (an answer the
	// kill cut is no 202): the bound is loose.
	if len(accepted) < 25 {
		t.Fatalf("%d webhooks answered 202 before the kill:\n%s", len(accepted), out)
	}
	proxy.Reopen()
	startProcess(t, config, addr)
	storedAll(t, db, accepted, time.Minute)
	conn := openStoreDB(t, db)
	for _, g := range accepted {
		if n := queryInt(t, conn, "SELECT count(*) FROM github WHERE delivery_id = $1", g); n != 1 {
			t.Errorf("delivery %s: %d rows, want 1", g, n)
		}
	}
	if n := queryInt(t, conn, "SELECT count(*) FROM spooled_webhooks WHERE published_at IS NULL"); n != 0 {
		t.Errorf("%d webhooks left in the spool", n)
	}
}

// A publish whose connection closes before its confirm came back is sent
// again on a fresh one while publish_timeout lasts: the webhook is
// answered 202 queued, not 503, even without the spool, and the copy that
// had landed is a duplicate, stored once.
func TestPublishSentAgainWhenConfirmLost(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	frames := proxy.countFrames()
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Queue.SpoolMaxBytes = 0
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("before the stall: %d", code)
	}
	proxy.StallReplies(true)
	published := frames.publish.Load()
	guid := newGUID()
	answered := make(chan string, 1)
	go func() {
		code, answer, err := doQuiet(http.DefaultClient, webhookRequest(t, d.URL, "issues", guid, body))
		answered <- strings.Join([]string{http.StatusText(code), answer, errText(err)}, " ")
	}()
	// Its publish reached the broker, its confirm is held: the
	// connection goes before the confirm comes back.
	eventually(t, 10*time.Second, "the webhook's publish sent", func() bool { return frames.publish.Load() > published })
	proxy.Cut()
	proxy.StallReplies(false)
	if got := <-answered; !strings.HasPrefix(got, "Accepted") || !strings.Contains(got, `"queued"`) {
		t.Errorf("a webhook whose confirm was lost with its connection: %s, want 202 queued", got)
	}
	storedAll(t, cfg.Database, []string{guid}, 30*time.Second)
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// The spool table's rows as the drain leaves them: published rows keep
// their times, not their messages, and PruneSpool deletes them past
// spoolKeptFor.
func TestSpoolRowsPublishedAndPruned(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		db := testStore(t)
		store := migratedStoreOf(t, db)
		ctx := context.Background()
		old := time.Now().Add(-8 * 24 * time.Hour)
		rows := []SpooledWebhook{
			{GUID: "g-1", Hook: 7, Event: "issues", ReceivedAt: old, SpooledAt: old, Node: "n", Reason: "broker unreachable",
				Exchange: exchangeName, Headers: `{"x-github-event":"issues"}`, Body: []byte(`{"a":1}`)},
			{GUID: "g-2", Hook: -1, Event: "push", ReceivedAt: old.Add(time.Second), SpooledAt: old, Node: "n",
				Reason: "broker unreachable", Exchange: "", Key: queueForbidden, Headers: `{}`, Body: []byte(`{"b":2}`)},
		}
		if err := store.WriteTx(ctx, func(tx *Tx) error { return tx.Spool(ctx, rows) }); err != nil {
			t.Fatal(err)
		}
		head, err := store.SpoolHead(ctx, 10)
		if err != nil || len(head) != 2 || head[0].GUID != "g-1" || head[1].Hook != -1 || string(head[1].Body) != `{"b":2}` {
			t.Fatalf("the spool's head: %v %+v", err, head)
		}
		st, err := store.SpoolState(ctx)
		if err != nil || st.Messages != 2 || st.Bytes != rows[0].size()+rows[1].size() || st.Oldest == nil {
			t.Fatalf("the spool's state: %v %+v", err, st)
		}
		if err := store.WriteTx(ctx, func(tx *Tx) error { return tx.SpoolPublished(ctx, []int64{head[0].ID}, 0, old) }); err != nil {
			t.Fatal(err)
		}
		// Marked twice: a stale drain's, refused.
		if err := store.WriteTx(ctx, func(tx *Tx) error { return tx.SpoolPublished(ctx, []int64{head[0].ID}, 0, old) }); err == nil {
			t.Error("a row marked published twice, want an error")
		}
		if head, _ := store.SpoolHead(ctx, 10); len(head) != 1 || head[0].GUID != "g-2" {
			t.Errorf("the spool after one published: %+v", head)
		}
		conn := openStoreDB(t, db)
		var body []byte
		var published sql.NullString
		if err := conn.QueryRow("SELECT body, published_at FROM spooled_webhooks WHERE delivery_id = 'g-1'").Scan(&body, &published); err != nil ||
			len(body) != 0 || !published.Valid {
			t.Errorf("a published row: body %q, published_at %v (%v), want the message gone, the time kept", body, published, err)
		}
		var n int64
		if err := store.WriteTx(ctx, func(tx *Tx) (err error) { n, err = tx.PruneSpool(ctx, time.Now()); return err }); err != nil || n != 1 {
			t.Errorf("pruned %d (%v), want the one published row past its week", n, err)
		}
		if st, _ := store.SpoolState(ctx); st.Messages != 1 {
			t.Errorf("the spool after pruning: %+v, want the unpublished row kept", st)
		}
		b, _ := json.Marshal(st)
		if !strings.Contains(string(b), `"oldest_spooled_at"`) {
			t.Errorf("the state's JSON: %s", b)
		}
	})
}

// A broker that blocks the connection (RabbitMQ's memory alarm): with the
// spool, a webhook is answered 202 spooled at once, while the block still
// holds, and stored once the alarm clears. Not parallel: the alarm blocks
// every test's publishers, so it runs in the sequential phase.
func TestSpoolWhileBlocked(t *testing.T) {
	needRabbitmqctl(t)
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.PublishTimeout, cfg.Queue.SpoolAfter = time.Minute, 50*time.Second // a 202 before these is the block's doing
	cfg.Log.Level = "info"
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("before the alarm: %d", code)
	}
	restore := func() { _ = exec.Command("rabbitmqctl", "-q", "set_vm_memory_high_watermark", "0.4").Run() }
	t.Cleanup(restore)
	rabbitmqctl(t, "set_vm_memory_high_watermark", "0.0000001")
	var spooled []string
	for range 2 { // the first is what the block stops; the second is refused before it is sent
		guid := newGUID()
		code, answer := do(t, webhookRequest(t, d.URL, "issues", guid, body))
		stillBlocked := scrape(t, d.URL+"/metrics")[`switchyard_broker_blocked{broker="0"}`] == 1
		if code != http.StatusAccepted || !strings.Contains(answer, `"spooled"`) || !stillBlocked {
			t.Errorf("a webhook while the broker blocks: %d %s (block still on: %v), want 202 spooled while it holds", code, answer, stillBlocked)
		}
		spooled = append(spooled, guid)
	}
	restore()
	storedAll(t, cfg.Database, spooled, time.Minute)
}

// The broker away and the store taking no write (the SQLite file locked
// by another process past busy_timeout): the webhook is answered 503
// naming both, not 202, and once the lock is gone it is spooled again.
func TestSpoolRefusedByTheStore(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Database.BusyTimeout = 300 * time.Millisecond
	d := startDaemon(t, cfg)
	eventually(t, 30*time.Second, "the daemon ready", func() bool { return answersOK(d.URL + "/readyz") })
	proxy.Close()
	unlock := lockDatabase(t, cfg.Database.Path)
	body := loadFixture(t, "issues", "opened")
	code, answer := do(t, webhookRequest(t, d.URL, "issues", newGUID(), body))
	if code != http.StatusServiceUnavailable || !strings.Contains(answer, "broker unreachable, and the spool did not take it") {
		t.Errorf("a webhook with the broker away and the store locked: %d %s, want 503 naming both", code, answer)
	}
	unlock()
	if code, answer := do(t, webhookRequest(t, d.URL, "issues", newGUID(), body)); code != http.StatusAccepted || !strings.Contains(answer, `"spooled"`) {
		t.Errorf("a webhook once the lock is gone: %d %s, want 202 spooled", code, answer)
	}
}

// Overload costs latency, not refusals: bursts past what the broker's link
// carries (5 Mbit/s at 20 ms: some 40 webhooks of 25 KB a second), twice
// that for 2 s then a quarter over it for 8 s, sent as GitHub sends (each
// at its time, whatever the answers before it take, each giving up after
// GitHub's 10 s), are answered 202 in full, spooled where the broker did not
// confirm in time, and each stored once.
func TestBurstAnsweredInFull(t *testing.T) {
	t.Parallel()
	link := newWANLink(t, testBrokerAddr(), 20*time.Millisecond, 5)
	dir := t.TempDir()
	addr := freeAddr(t)
	dbPath := filepath.Join(dir, "switchyard.db")
	// The least server.max_inflight_bytes, as the default is to a fast
	// link: a webhook waiting for its confirm holds its compressed bytes,
	// not its body's (Spool.Take), or the burst would be refused with
	// "too many webhook bytes in flight".
	config := writeConfigWith(t, dir, addr, fmt.Sprintf("path = %q", dbPath), "max_inflight_bytes = 1048576", link.URL(newVhost(t)))
	cmd, out := startProcess(t, config, addr)
	payload := paddedPayload(t, 25<<10)
	github := &http.Client{Timeout: 10 * time.Second}
	var mu sync.Mutex
	var answers []sent
	send := func(i int) error {
		guid := newGUID()
		code, body, err := doQuiet(github, webhookRequest(t, "http://"+addr, "pull_request", guid, payload))
		mu.Lock()
		answers = append(answers, sent{seq: len(answers), guid: guid, code: code, body: body, err: err})
		mu.Unlock()
		if code != http.StatusAccepted {
			return fmt.Errorf("%d %v", code, err)
		}
		return nil
	}
	for _, burst := range []struct {
		rate float64
		d    time.Duration
	}{{80, 2 * time.Second}, {50, 8 * time.Second}} {
		step := openLoopAt(burst.rate, burst.d, send)
		t.Logf("%.0f webhooks/s for %s: %d sent, %d not 202, p50 %s, p99 %s", burst.rate, burst.d, step.sent, step.refused, step.p50, step.p99)
	}
	spooled := allSpooledOrQueued(t, answers)
	db := openDB(t, dbPath)
	eventually(t, 2*time.Minute, "every webhook answered 202 stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") >= len(answers)
	})
	if n, distinct := queryInt(t, db, "SELECT count(*) FROM github"), queryInt(t, db, "SELECT count(DISTINCT delivery_id) FROM github"); n != len(answers) || distinct != n {
		t.Errorf("github holds %d rows of %d deliveries, want each of the %d once", n, distinct, len(answers))
	}
	t.Logf("%d webhooks, %d of them spooled", len(answers), spooled)
	stopProcess(t, cmd, out, 30*time.Second)
}
