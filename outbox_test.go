package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
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

// allAnswered202 fails the test for every answer that is not a 202, and
// returns how many were published to the broker directly (the store did
// not take them) rather than queued in the outbox.
func allAnswered202(t testing.TB, answers []sent) (published int) {
	t.Helper()
	bad := 0
	for _, a := range answers {
		if a.code != http.StatusAccepted {
			if bad++; bad <= 5 {
				t.Errorf("webhook %d (%s): %d %q %v, want 202", a.seq, a.guid, a.code, a.body, a.err)
			}
			continue
		}
		if strings.Contains(a.body, `"status":"published"`) {
			published++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d webhooks not answered 202", bad, len(answers))
	}
	return published
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

// streamThrough runs an ordered stream of 20 webhooks a second to d while
// the broker misbehaves (break, for hold, then mend), and holds it to
// every request answered 202 queued (committed to the outbox), the
// outbox showing what waits while it does, and every webhook stored once,
// in the order sent, once the broker takes them again.
func streamThrough(t *testing.T, d *testDaemon, db DatabaseConfig, hold time.Duration, breakIt, mend func()) []sent {
	t.Helper()
	// The stream starts once the daemon answers: webhooks that waited
	// for it together would be taken at once, in no order.
	eventually(t, 30*time.Second, "the daemon ready", func() bool { return answersOK(d.URL + "/readyz") })
	stop := orderedStream(t, d.URL, 50*time.Millisecond)
	eventually(t, 30*time.Second, "webhooks stored before", func() bool {
		return scrape(t, d.URL+"/metrics")[`switchyard_webhooks_received_total{outcome="accepted"}`] >= 20
	})
	breakIt()
	eventually(t, 30*time.Second, "webhooks waiting in the outbox", func() bool {
		return scrape(t, d.URL+"/metrics")["switchyard_outbox_messages"] >= 20
	})
	if code, ready := do(t, httpRequest(t, http.MethodGet, d.URL+"/readyz", "", "")); code != http.StatusOK {
		t.Errorf("/readyz while the outbox waits for the broker: %d %s, want 200", code, ready)
	}
	time.Sleep(hold) // the stream goes on
	mend()
	eventually(t, time.Minute, "the outbox forwarded", func() bool {
		return scrape(t, d.URL+"/metrics")["switchyard_outbox_messages"] == 0
	})
	answers := stop()
	if published := allAnswered202(t, answers); published > 0 {
		t.Errorf("%d webhooks published directly, want every one committed to the outbox", published)
	}
	storedInOrder(t, db, answers)
	return answers
}

// The broker's link cut for 45 s under a steady stream of 20 webhooks a
// second, each sent once the one before was answered: every request is
// answered 202 queued, /readyz stays 200, the outbox's gauges show what
// waits, and once the link is back every webhook is stored once, in the
// order sent; the consumers are back with the broker's connection, and a
// webhook's story tells when it was queued and published.
func TestOutboxBrokerLinkCut(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		vhost := newVhost(t)
		proxy := newTCPProxy(t, testBrokerAddr())
		cfg := testConfig(t, proxy.URL(vhost))
		cfg.Log.Level = "info"
		d := startDaemon(t, cfg)
		var back time.Time
		answers := streamThrough(t, d, cfg.Database, 45*time.Second, proxy.Close, func() {
			back = time.Now()
			proxy.Reopen()
		})
		consumersBackWithBroker(t, d.Daemon, back)
		st, err := d.store.Story(context.Background(), answers[len(answers)/2].guid)
		if err != nil || len(st.Queued) != 1 || st.Queued[0].PublishedAt == nil || st.Queued[0].Broker != 0 {
			t.Fatalf("the story of a webhook queued while the link was cut: %v %+v, want it queued and published once", err, st)
		}
		var text strings.Builder
		for _, l := range st.Lines() {
			text.WriteString(l.Label + ": " + l.Text + "\n")
		}
		if !strings.Contains(text.String(), "queued: ") || !strings.Contains(text.String(), "published") {
			t.Errorf("the story's text does not tell the outbox:\n%s", text.String())
		}
	})
}

// The broker refusing switchyard's user for 45 s under a stream (its
// permissions on the vhost cleared and its connections closed, as a
// rotated password or a changed plan does): every request is answered 202
// queued, and each webhook stored once, in the order sent, once the user
// may publish again.
func TestOutboxBrokerRefusesUser(t *testing.T) {
	t.Parallel()
	needRabbitmqctl(t)
	onBothStores(t, func(t *testing.T) {
		vhost := newVhost(t)
		user := "sy-" + randHex(6)
		rabbitmqctl(t, "add_user", user, "pw-"+user)
		t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "-q", "delete_user", user).Run() })
		grant := func() { rabbitmqctl(t, "set_permissions", "-p", vhost, user, ".*", ".*", ".*") }
		grant()
		u := *testBroker().url
		u.User = url.UserPassword(user, "pw-"+user)
		cfg := testConfig(t, u.String()+url.PathEscape(vhost))
		cfg.Log.Level = "info"
		d := startDaemon(t, cfg)
		streamThrough(t, d, cfg.Database, 45*time.Second, func() {
			rabbitmqctl(t, "clear_permissions", "-p", vhost, user)
			rabbitmqctl(t, "close_all_user_connections", user, "the test refuses the user")
		}, grant)
	})
}

// The fanout exchange deleted for 20 s under a stream, on a provisioned
// broker (declare_topology off: switchyard declares nothing): every
// request is answered 202 queued, and each webhook stored once, in the
// order sent, once the exchange and its bindings are back.
func TestOutboxExchangeDeleted(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		vhost := newVhost(t)
		// The daemon's link goes through a proxy, closed while the
		// exchange and its bindings are declared again: a webhook sent
		// between the two would reach one queue of the two.
		proxy := newTCPProxy(t, testBrokerAddr())
		cfg := testConfig(t, proxy.URL(vhost))
		declare := func() { declareTopologyOf(t, vhost, cfg.Queue) }
		declare()
		ch := amqpChannel(t, vhost)
		cfg.Queue.DeclareTopology = false
		cfg.Log.Level = "info"
		d := startDaemon(t, cfg)
		streamThrough(t, d, cfg.Database, 20*time.Second, func() {
			if err := ch.ExchangeDelete(exchangeName, false, false); err != nil {
				t.Fatal(err)
			}
		}, func() {
			proxy.Close()
			declare()
			proxy.Reopen()
		})
	})
}

// When the store cannot take a webhook, the broker's path: a webhook is
// published with a confirm and answered 202 published, every one of a
// stream, and stored once; when the broker cannot take it either, 503
// with Retry-After naming both. On SQLite the disk full (the database on a
// small tmpfs, filled) and the file locked by another process past
// busy_timeout; on PostgreSQL the outbox locked past the writer's time and
// the database away (a proxy closed).
func TestOutboxStoreRefuses(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		db := testStore(t)
		var dbProxy *tcpProxy
		if db.Driver == "postgres" {
			dbProxy = newTCPProxy(t, pgAddr(t, db.URL))
			u, _ := url.Parse(db.URL)
			u.Host = dbProxy.addr
			db.URL = u.String()
		} else {
			db.Path = filepath.Join(smallDisk(t, 4<<20), "switchyard.db")
		}
		vhost := newVhost(t)
		brokerProxy := newTCPProxy(t, testBrokerAddr())
		cfg := testConfig(t, brokerProxy.URL(vhost))
		cfg.Database = db
		cfg.Database.BusyTimeout = 500 * time.Millisecond
		cfg.Log.Level = "info"
		d := startDaemon(t, cfg)
		eventually(t, 30*time.Second, "the daemon ready", func() bool { return answersOK(d.URL + "/readyz") })
		body := loadFixture(t, "issues", "opened")
		post := func(n int) []sent {
			var out []sent
			for i := range n {
				s := sent{seq: i, guid: newGUID()}
				s.code, s.body, s.err = doQuiet(http.DefaultClient, webhookRequest(t, d.URL, "issues", s.guid, body))
				out = append(out, s)
			}
			return out
		}
		type fault struct {
			name         string
			cause, clear func()
		}
		var faults []fault
		if db.Driver == "postgres" {
			var unlock func()
			faults = []fault{
				{"outbox locked", func() { unlock = lockOutboxTable(t, db) }, func() { unlock() }},
				{"database away", dbProxy.Close, dbProxy.Reopen},
			}
		} else {
			var unlock, free func()
			faults = []fault{
				{"disk full", func() { free = fillDisk(t, filepath.Dir(db.Path)) }, func() { free() }},
				{"database locked", func() { unlock = lockDatabase(t, db.Path) }, func() { unlock() }},
			}
		}
		var stored []string
		for _, f := range faults {
			f.cause()
			answers := post(10)
			if published := allAnswered202(t, answers); published != len(answers) {
				t.Errorf("%s: %d of %d webhooks published directly, want each (the store takes none)", f.name, published, len(answers))
			}
			for _, a := range answers {
				stored = append(stored, a.guid)
			}
			// Neither path: 503 naming both.
			brokerProxy.Close()
			code, answer := do(t, webhookRequest(t, d.URL, "issues", newGUID(), body))
			if code != http.StatusServiceUnavailable || !strings.Contains(answer, "the store did not take it, and broker unreachable") {
				t.Errorf("%s, and the broker away: %d %s, want 503 naming both", f.name, code, answer)
			}
			brokerProxy.Reopen()
			f.clear()
		}
		// Once the store answers again (a lost database is probed until
		// it does), webhooks are committed to the outbox again.
		eventually(t, 30*time.Second, "the database writable again", func() bool {
			code, body := do(t, httpRequest(t, http.MethodGet, d.URL+"/readyz", "", ""))
			return code == http.StatusOK && !strings.Contains(body, `"database"`)
		})
		answers := post(5)
		if published := allAnswered202(t, answers); published != 0 {
			t.Errorf("once the store takes writes again: %d published directly, want every one queued", published)
		}
		for _, a := range answers {
			stored = append(stored, a.guid)
		}
		storedAll(t, cfg.Database, stored, time.Minute)
		var st Status
		eventually(t, 30*time.Second, "the refusals in the status", func() bool {
			_, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
			st = Status{}
			return json.Unmarshal([]byte(raw), &st) == nil && len(st.Refused) > 0
		})
		if st.Refused[0].Status != http.StatusServiceUnavailable {
			t.Errorf("the status's refusals: %+v, want the 503s", st.Refused)
		}
		// The page says what happened: the refusals, and nothing that
		// tells of webhooks published as they came.
		page := httpRequest(t, http.MethodGet, d.URL+"/status", "", "")
		page.SetBasicAuth("operator", "operator-token-for-tests")
		if code, html := do(t, page); code != http.StatusOK || !strings.Contains(html, `id="turned"`) ||
			strings.Contains(html, "published as they come") {
			t.Errorf("the status page with webhooks refused: %d, want the refusals and no word of webhooks published as they come:\n%s", code, html)
		}
		if m := scrape(t, d.URL+"/metrics"); m[`switchyard_webhooks_received_total{outcome="published"}`] != 20 ||
			m[`switchyard_webhooks_received_total{outcome="unavailable"}`] != 2 {
			t.Errorf("the counts: published %v, unavailable %v, want 20 and 2", m[`switchyard_webhooks_received_total{outcome="published"}`],
				m[`switchyard_webhooks_received_total{outcome="unavailable"}`])
		}
	})
}

// smallDisk is a tmpfs of size bytes of the test's own (the tests run as
// root, as CI does), unmounted when the test ends.
func smallDisk(t *testing.T, size int64) string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", fmt.Sprintf("size=%d", size), "tmpfs", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount a tmpfs of %d bytes at %s (the test needs root): %v %s", size, dir, err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", dir).Run() })
	return dir
}

// fillDisk fills the file system of dir to the last byte with a file of
// its own; free deletes it.
func fillDisk(t *testing.T, dir string) (free func()) {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	block := make([]byte, 64<<10)
	for {
		if _, err := f.Write(block); err != nil {
			break
		}
	}
	for {
		if _, err := f.Write(block[:512]); err != nil {
			break
		}
	}
	f.Close()
	return func() { os.Remove(path) }
}

// lockOutboxTable holds the outbox table locked on PostgreSQL from a
// connection of the test's own until unlock.
func lockOutboxTable(t *testing.T, db DatabaseConfig) (unlock func()) {
	t.Helper()
	conn := openStoreDB(t, db)
	tx, err := conn.Begin()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	unlock = func() { once.Do(func() { _ = tx.Rollback() }) }
	t.Cleanup(unlock)
	return unlock
}

// serve SIGKILLed with webhooks waiting in the outbox, the broker away:
// once the broker is back and serve runs again, every webhook answered
// 202 is stored once; so is a webhook an older version left in its spool
// (a row of spooled_webhooks), which the outbox takes over.
func TestOutboxSurvivesSIGKILL(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
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
		eventually(t, 30*time.Second, "webhooks waiting in the outbox", func() bool {
			return scrape(t, url+"/metrics")["switchyard_outbox_messages"] >= 50
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
		// Those queued were answered as the kill came, or not (an answer
		// the kill cut is no 202): the bound is loose.
		if len(accepted) < 25 {
			t.Fatalf("%d webhooks answered 202 before the kill:\n%s", len(accepted), out)
		}
		spooled := newGUID()
		insertSpooled(t, db, spooled, loadFixture(t, "issues", "opened"))
		// Restarted with the broker still away: its log says what
		// happens to webhooks meanwhile (committed, answered 202).
		_, restarted := startProcess(t, config, addr)
		eventually(t, 20*time.Second, "the restart's word on the broker", func() bool {
			return strings.Contains(restarted.String(), "the active broker is not reachable")
		})
		// A 503 as a word: the test's temporary directory, in the log's
		// database path, may hold the digits.
		if log := restarted.String(); !strings.Contains(log, "webhooks are committed to the outbox, answered 202") || regexp.MustCompile(`\b503\b`).MatchString(log) {
			t.Errorf("the restart's log with the broker away does not say webhooks are committed and answered 202:\n%s", log)
		}
		proxy.Reopen()
		storedAll(t, db, append(accepted, spooled), time.Minute)
		conn := openStoreDB(t, db)
		for _, g := range append(accepted, spooled) {
			if n := queryInt(t, conn, "SELECT count(*) FROM github WHERE delivery_id = $1", g); n != 1 {
				t.Errorf("delivery %s: %d rows, want 1", g, n)
			}
		}
		eventually(t, 30*time.Second, "nothing left waiting", func() bool {
			return queryInt(t, conn, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0 &&
				queryInt(t, conn, "SELECT count(*) FROM spooled_webhooks WHERE published_at IS NULL") == 0
		})
	})
}

// insertSpooled writes a webhook into spooled_webhooks as an older
// version's spool left it: its headers a JSON object of strings.
func insertSpooled(t *testing.T, db DatabaseConfig, guid string, body []byte) {
	t.Helper()
	conn := openWritableDB(t, db)
	now := formatTime(time.Now())
	headers := fmt.Sprintf(`{%q:"issues",%q:%q,%q:"127.0.0.1",%q:%q}`, hdrEvent, hdrDelivery, guid, hdrSourceIP, hdrReceivedAt, now)
	if _, err := conn.Exec(`INSERT INTO spooled_webhooks (delivery_id, hook_id, event, received_at, spooled_at, node, broker, reason,
			exchange, routing_key, headers, content_encoding, body, bytes)
		VALUES ($1, NULL, 'issues', $2, $2, 'older', 0, 'broker unreachable', $3, '', $4, '', $5, $6)`,
		guid, now, exchangeName, headers, body, len(body)+len(headers)); err != nil {
		t.Fatal(err)
	}
}

// Two nodes on PostgreSQL, one SIGKILLed with webhooks waiting in its
// outbox (its own link to the broker cut): the other adopts its rows once
// its outbox lease is gone and forwards them; every webhook the dead node
// answered 202 is stored once.
func TestOutboxOfDeadNodeForwarded(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	vhost := newVhost(t)
	dbURL := newPostgresDatabase(t)
	cut := newTCPProxy(t, testBrokerAddr())
	dying := startNode(t, "node-1", dbURL, cut.URL(vhost))
	live := startNode(t, "node-2", dbURL, amqpURL(vhost))
	cut.Close()
	stop := openLoop(t, func() string { return "http://" + dying.addr }, 20*time.Millisecond)
	eventually(t, 30*time.Second, "webhooks waiting in node 1's outbox", func() bool {
		return scrape(t, "http://"+live.addr+"/metrics")["switchyard_outbox_messages"] >= 30
	})
	if err := dying.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = dying.cmd.Wait()
	dying.dead.Store(true)
	var accepted []string
	for _, a := range stop() {
		if a.code == http.StatusAccepted {
			accepted = append(accepted, a.guid)
		}
	}
	if len(accepted) < 30 {
		t.Fatalf("%d webhooks answered 202 before the kill", len(accepted))
	}
	db := DatabaseConfig{Driver: "postgres", URL: dbURL}
	storedAll(t, db, accepted, time.Minute)
	conn := openStoreDB(t, db)
	if n := queryInt(t, conn, "SELECT count(*) - count(DISTINCT delivery_id) FROM github"); n != 0 {
		t.Errorf("%d webhooks stored more than once", n)
	}
	if n := queryInt(t, conn, "SELECT count(*) FROM outbox WHERE node = 'node-2' AND published_at IS NOT NULL"); n < len(accepted) {
		t.Errorf("node 2 published %d of node 1's %d webhooks", n, len(accepted))
	}
	if !strings.Contains(live.out.String(), "adopted") {
		t.Errorf("node 2 does not say it adopted node 1's rows:\n%s", live.out)
	}
}

// On the broker's path (the outbox full here), a publish whose connection
// closes before its confirm came back is sent again on a fresh one while
// publish_timeout lasts: the webhook is answered 202 published, not 503,
// and the copy that had landed is a duplicate, stored once.
func TestPublishSentAgainWhenConfirmLost(t *testing.T) {
	t.Parallel()
	_, proxy, frames, cfg := wireConfig(t)
	cfg.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full, each webhook published at the door
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
	if got := <-answered; !strings.HasPrefix(got, "Accepted") || !strings.Contains(got, `"published"`) {
		t.Errorf("a webhook whose confirm was lost with its connection: %s, want 202 published", got)
	}
	storedAll(t, cfg.Database, []string{guid}, 30*time.Second)
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// The outbox's rows as the writer and the forwarder leave them: the
// headers keep their AMQP types; the head is this node's waiting rows in
// commit order; published rows keep their times, not their messages, and
// PruneOutbox deletes them past outboxKeptFor; a row refused for good
// keeps its message until RetryRefused; a gone node's rows are adopted
// once its outbox lease is; an older version's spool rows are moved in.
func TestOutboxRows(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		db := testStore(t)
		store := migratedStoreOf(t, db)
		ctx := context.Background()
		headers := amqp.Table{hdrEvent: "issues", "x-attempts": int64(3), "x-flag": true, "x-when": time.Unix(1700000000, 0).UTC(),
			"x-raw": []byte{0, 1}, "x-nested": amqp.Table{"k": int32(7)}, "x-list": []any{"a", int64(2)}}
		encoded, err := encodeHeaders(headers)
		if err != nil {
			t.Fatal(err)
		}
		if back, err := decodeHeaders(encoded); err != nil || !reflect.DeepEqual(back, headers) {
			t.Fatalf("headers through the outbox: %v\n%#v\nwant\n%#v", err, back, headers)
		}
		old := time.Now().Add(-8 * 24 * time.Hour)
		rows := []OutboxRow{
			{Node: "n", GUID: "g-1", Hook: 7, Event: "issues", ReceivedAt: old, QueuedAt: old, Exchange: exchangeName, Headers: encoded, Body: []byte(`{"a":1}`)},
			{Node: "n", GUID: "g-2", Hook: -1, Event: "push", ReceivedAt: old, QueuedAt: old, Key: queueForbidden, Headers: `{}`, Body: []byte(`{"b":2}`)},
			{Node: "n", GUID: "g-3", Hook: -1, Event: "push", ReceivedAt: old, QueuedAt: old, Exchange: exchangeName, Headers: `{}`, Body: []byte(`{"c":3}`)},
			{Node: "gone", GUID: "g-4", Hook: -1, Event: "push", ReceivedAt: old, QueuedAt: old, Exchange: exchangeName, Headers: `{}`, Body: []byte(`{"d":4}`)},
		}
		if err := store.WriteTx(ctx, func(tx *Tx) error { tx.Pipeline(); return tx.Outbox(ctx, rows) }); err != nil {
			t.Fatal(err)
		}
		head, err := store.OutboxHead(ctx, "n", 0, 10, 0)
		if err != nil || len(head) != 3 || head[0].GUID != "g-1" || head[0].Hook != 7 || head[1].Hook != -1 || string(head[1].Body) != `{"b":2}` {
			t.Fatalf("the outbox's head: %v %+v", err, head)
		}
		// A byte bound ends the read with the row that reaches it.
		for bound, want := range map[int64]int{rows[0].Size(): 1, rows[0].Size() + 1: 2, rows[0].Size() + rows[1].Size(): 2} {
			if got, err := store.OutboxHead(ctx, "n", 0, 10, bound); err != nil || len(got) != want {
				t.Errorf("the head within %d bytes: %d rows (%v), want %d", bound, len(got), err, want)
			}
		}
		if m, err := head[0].publishing(); err != nil || !reflect.DeepEqual(m.Msg.Headers, headers) || m.Exchange != exchangeName {
			t.Errorf("the message of the first row: %v %+v", err, m)
		}
		st, err := store.OutboxState(ctx)
		if err != nil || st.Messages != 4 || st.Bytes != rows[0].Size()+rows[1].Size()+rows[2].Size()+rows[3].Size() || st.Oldest == nil ||
			!reflect.DeepEqual(st.Nodes, []string{"gone", "n"}) {
			t.Fatalf("the outbox's state: %v %+v", err, st)
		}
		publish := func(node string, ids ...int64) error {
			return store.WriteTx(ctx, func(tx *Tx) error { return tx.OutboxPublished(ctx, node, ids, 0, old) })
		}
		if err := publish("n", head[0].ID); err != nil {
			t.Fatal(err)
		}
		// Marked twice, or by another node: a stale forwarder's, refused.
		if err := publish("n", head[0].ID); !errors.Is(err, ErrStaleLease) {
			t.Errorf("a row marked published twice: %v, want ErrStaleLease", err)
		}
		if err := publish("other", head[1].ID); !errors.Is(err, ErrStaleLease) {
			t.Errorf("another node's row marked: %v, want ErrStaleLease", err)
		}
		if err := store.WriteTx(ctx, func(tx *Tx) error { return tx.OutboxRefused(ctx, "n", head[1].ID, "too large", time.Now()) }); err != nil {
			t.Fatal(err)
		}
		if head, _ := store.OutboxHead(ctx, "n", 0, 10, 0); len(head) != 1 || head[0].GUID != "g-3" {
			t.Errorf("the head after one published and one refused: %+v, want g-3 alone", head)
		}
		if st, _ := store.OutboxState(ctx); st.RefusedCount != 1 || st.Refused[0].GUID != "g-2" || st.Refused[0].Reason != "too large" {
			t.Errorf("the refused rows: %+v", st)
		}
		var retried int64
		if err := store.WriteTx(ctx, func(tx *Tx) (err error) { retried, err = tx.RetryRefused(ctx); return err }); err != nil || retried != 1 {
			t.Errorf("retried %d (%v), want the refused row", retried, err)
		}
		if head, _ := store.OutboxHead(ctx, "n", 0, 10, 0); len(head) != 2 || head[0].GUID != "g-2" {
			t.Errorf("the head after the retry: %+v, want g-2 first again", head)
		}
		conn := openStoreDB(t, db)
		var body []byte
		var published sql.NullString
		if err := conn.QueryRow("SELECT body, published_at FROM outbox WHERE delivery_id = 'g-1'").Scan(&body, &published); err != nil ||
			body != nil || !published.Valid {
			t.Errorf("a published row: body %q, published_at %v (%v), want the message gone, the time kept", body, published, err)
		}
		var n int64
		if err := store.WriteTx(ctx, func(tx *Tx) (err error) { n, err = tx.PruneOutbox(ctx, time.Now()); return err }); err != nil || n != 1 {
			t.Errorf("pruned %d (%v), want the one published row past its week", n, err)
		}
		// Node "gone" holds a live outbox lease: its rows stay its own;
		// once it expires they are adopted, and only once.
		ttl := 300 * time.Millisecond
		if err := store.WriteTx(ctx, func(tx *Tx) error { _, _, err := tx.TakeLease(ctx, outboxJob("gone"), "gone", ttl); return err }); err != nil {
			t.Fatal(err)
		}
		adopt := func() (rows, bytes int64) {
			t.Helper()
			if err := store.WriteTx(ctx, func(tx *Tx) (err error) { rows, bytes, err = tx.AdoptOutbox(ctx, "n", outboxJob, ttl); return err }); err != nil {
				t.Fatal(err)
			}
			return rows, bytes
		}
		if rows, _ := adopt(); rows != 0 {
			t.Errorf("adopted %d rows of a node whose lease lives", rows)
		}
		time.Sleep(2 * ttl) // the lease expires on the database's clock
		if rows, bytes := adopt(); rows != 1 || bytes != int64(len(`{"d":4}`)+2) {
			t.Errorf("adopted %d rows (%d bytes) of a gone node, want its one", rows, bytes)
		}
		if rows, _ := adopt(); rows != 0 {
			t.Errorf("adopted %d rows again", rows)
		}
		// An older version's spool row moves in, behind what waits.
		insertSpooled(t, db, "g-5", []byte(`{"e":5}`))
		var moved int64
		if err := store.WriteTx(ctx, func(tx *Tx) (err error) { moved, _, err = tx.MoveSpool(ctx, "n", time.Now()); return err }); err != nil || moved != 1 {
			t.Fatalf("moved %d (%v), want the spool's row", moved, err)
		}
		head, _ = store.OutboxHead(ctx, "n", 0, 10, 0)
		if len(head) != 4 || head[3].GUID != "g-5" {
			t.Fatalf("the head with the spool's row moved in: %+v", head)
		}
		if m, err := head[3].publishing(); err != nil || m.Msg.Headers[hdrDelivery] != "g-5" {
			t.Errorf("the spool's row as a message: %v %+v", err, m.Msg.Headers)
		}
		if err := store.WriteTx(ctx, func(tx *Tx) (err error) { moved, _, err = tx.MoveSpool(ctx, "n", time.Now()); return err }); err != nil || moved != 0 {
			t.Errorf("moved %d (%v) again, want none", moved, err)
		}
	})
}

// A broker that blocks the connection (RabbitMQ's memory alarm): a
// webhook is answered 202 queued at once, while the block still holds,
// and stored once the alarm clears. The alarm is a node's, so the node is
// the test's own.
func TestOutboxWhileBlocked(t *testing.T) {
	t.Parallel()
	node := ownRabbit(t)
	cfg := testConfig(t, node.url())
	cfg.Queue.PublishTimeout = time.Minute // a 202 before it is the outbox's doing
	cfg.Log.Level = "info"
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("before the alarm: %d", code)
	}
	node.ctl(t, "set_vm_memory_high_watermark", "0.0000001")
	var queued []string
	eventually(t, 30*time.Second, "the broker blocking", func() bool {
		return scrape(t, d.URL+"/metrics")[`switchyard_broker_blocked{broker="0"}`] == 1 || postAndQueue(t, d, body, &queued)
	})
	for range 2 {
		guid := newGUID()
		code, answer := do(t, webhookRequest(t, d.URL, "issues", guid, body))
		stillBlocked := scrape(t, d.URL+"/metrics")[`switchyard_broker_blocked{broker="0"}`] == 1
		if code != http.StatusAccepted || !strings.Contains(answer, `"queued"`) || !stillBlocked {
			t.Errorf("a webhook while the broker blocks: %d %s (block still on: %v), want 202 queued while it holds", code, answer, stillBlocked)
		}
		queued = append(queued, guid)
	}
	node.ctl(t, "set_vm_memory_high_watermark", "0.4")
	storedAll(t, cfg.Database, queued, time.Minute)
}

// postAndQueue posts a webhook to d, which the forwarder's publish lets
// the broker's block be seen, and adds it to queued; it reports false.
func postAndQueue(t *testing.T, d *testDaemon, body []byte, queued *[]string) bool {
	guid := newGUID()
	if code := postWebhook(t, d.URL, "issues", guid, body); code != http.StatusAccepted {
		t.Errorf("a webhook as the alarm comes: %d", code)
	}
	*queued = append(*queued, guid)
	return false
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
	published := allAnswered202(t, answers)
	db := openDB(t, dbPath)
	eventually(t, 2*time.Minute, "every webhook answered 202 stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") >= len(answers)
	})
	if n, distinct := queryInt(t, db, "SELECT count(*) FROM github"), queryInt(t, db, "SELECT count(DISTINCT delivery_id) FROM github"); n != len(answers) || distinct != n {
		t.Errorf("github holds %d rows of %d deliveries, want each of the %d once", n, distinct, len(answers))
	}
	t.Logf("%d webhooks, %d of them published directly", len(answers), published)
	stopProcess(t, cmd, out, 30*time.Second)
}

// The outbox's writer gathers its group once its commit has the writer's
// turn: a webhook handed to it while the commit waited for the turn (a
// consumer's batch under way) is in that commit, not in the next, which
// would wait behind the writes queued meanwhile. Here a consumer's write
// queued behind the outbox's finds the second webhook committed already.
func TestOutboxGroupGatheredInItsTurn(t *testing.T) {
	t.Parallel()
	store, _ := benchStore(t)
	defer store.Close()
	_, waiting := writesWaiting(store)
	o := &Outbox{store: store, node: "n", commitTimeout: 10 * time.Second, log: slog.New(slog.DiscardHandler),
		writes: make(chan *outboxWrite, outboxGroupRows), stopped: make(chan struct{}), kick: make(chan struct{}, 1),
		logStoreRefused: func(err error) { t.Log(err) }}
	ctx, stop := context.WithCancel(context.Background())
	wrote := make(chan error, 1)
	go func() { wrote <- o.Write(ctx) }()
	defer func() { stop(); <-wrote }()

	hold, release := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() { held <- store.WriteTx(ctx, func(*Tx) error { close(hold); <-release; return nil }) }()
	<-hold
	hand := func(guid string) chan error {
		done := make(chan error, 1)
		row := OutboxRow{Node: "n", GUID: guid, Hook: -1, Event: "issues", ReceivedAt: time.Now(), QueuedAt: time.Now(),
			Exchange: exchangeName, Headers: `{}`, Body: []byte(`{}`)}
		go func() { done <- o.write(ctx, row) }()
		return done
	}
	first := hand("gathered-1")
	eventually(t, 10*time.Second, "the writer's commit of the first webhook waiting for its turn", waiting(1, 0))
	second := hand("gathered-2")
	eventually(t, 10*time.Second, "the second webhook handed to the writer", func() bool { return len(o.writes) == 1 })
	seen := make(chan int, 1)
	consumer := make(chan error, 1)
	go func() {
		consumer <- store.WriteTx(ctx, func(tx *Tx) error {
			var n int
			err := tx.row(ctx, "SELECT count(*) FROM outbox WHERE delivery_id = 'gathered-2'").Scan(&n)
			seen <- n
			return err
		})
	}()
	eventually(t, 10*time.Second, "a consumer's write queued behind the outbox's", waiting(1, 1))
	close(release)
	for _, c := range []chan error{held, first, second, consumer} {
		if err := <-c; err != nil {
			t.Fatal(err)
		}
	}
	if n := <-seen; n != 1 {
		t.Fatal("the webhook handed while the outbox's commit waited for its turn was not in that commit: it waited behind the consumer's write")
	}
}

// The forwarder keeps a window of publishes in flight across its batches:
// with the broker's confirms held back, more rows than one batch holds are
// sent before any is confirmed (and none is marked published), so that
// over a WAN link the link carries the next batches while a batch's
// confirms come back. Once the confirms flow, every webhook is stored
// once, in the order sent.
func TestOutboxWindowAcrossBatches(t *testing.T) {
	t.Parallel()
	_, proxy, frames, cfg := wireConfig(t)
	cfg.Queue.PublishTimeout = time.Minute // no batch given up while the confirms are held
	cfg.Queue.CallTimeout = time.Minute    // nor the connection closed under them by a worker's call, its reply held too
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	first := newGUID()
	if code := postWebhook(t, d.URL, "issues", first, body); code != http.StatusAccepted {
		t.Fatalf("before the confirms are held: %d", code)
	}
	storedAll(t, cfg.Database, []string{first}, 30*time.Second)

	proxy.StallReplies(true)
	published := frames.publish.Load()
	var answers []sent
	for i := range 3 * forwardBatch {
		guid := newGUID()
		code, answer, err := doQuiet(http.DefaultClient, webhookRequest(t, d.URL, "issues", guid, body))
		answers = append(answers, sent{seq: i, guid: guid, code: code, body: answer, err: err})
	}
	// Past what one batch holds: a batch behind the first went out while
	// its confirms were held.
	eventually(t, 30*time.Second, "a batch behind the first sent before any confirm", func() bool {
		return frames.publish.Load()-published > forwardBatch
	})
	db := openStoreDB(t, cfg.Database)
	if n := queryInt(t, db, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND delivery_id <> $1", first); n != 0 {
		t.Errorf("%d rows marked published while every confirm was held", n)
	}
	proxy.StallReplies(false)
	allAnswered202(t, answers)
	storedInOrder(t, cfg.Database, answers)
}

// A batch of the forwarder ends with the row that brings it to
// forwardBatchBytes: webhooks of a few hundred KB compressed go a few to a
// batch (each batch one marking, its rows one published_at), not 60, which
// held in flight four times over would be tens of MB. Every one is stored
// once, in order.
func TestOutboxBatchBoundedByBytes(t *testing.T) {
	t.Parallel()
	_, proxy, _, cfg := wireConfig(t)
	cfg.Queue.PublishTimeout = time.Minute // no batch given up while the confirms are held
	cfg.Queue.CallTimeout = time.Minute    // nor the connection closed under them by a worker's call, its reply held too
	d := startDaemon(t, cfg)
	var event map[string]any
	if err := json.Unmarshal(loadFixture(t, "issues", "opened"), &event); err != nil {
		t.Fatal(err)
	}
	pad := make([]byte, 300<<10)
	_, _ = rand.Read(pad)
	event["padding"] = hex.EncodeToString(pad) // 600 KB of hex, some 300 KB compressed
	body, _ := json.Marshal(event)
	// The daemon's connection is up before the replies are held: held
	// from the start, its handshake would wait out the call_timeout.
	first := newGUID()
	if code := postWebhook(t, d.URL, "issues", first, loadFixture(t, "issues", "opened")); code != http.StatusAccepted {
		t.Fatalf("before the confirms are held: %d", code)
	}
	storedAll(t, cfg.Database, []string{first}, 30*time.Second)

	// The rows wait while the confirms are held, so that the batches
	// after the first are full ones.
	proxy.StallReplies(true)
	var answers []sent
	for i := range 24 {
		guid := newGUID()
		code, answer, err := doQuiet(http.DefaultClient, webhookRequest(t, d.URL, "issues", guid, body))
		answers = append(answers, sent{seq: i, guid: guid, code: code, body: answer, err: err})
	}
	proxy.StallReplies(false)
	allAnswered202(t, answers)
	storedInOrder(t, cfg.Database, answers)

	db := openStoreDB(t, cfg.Database)
	rows, err := db.Query("SELECT published_at, count(*), sum(bytes), max(bytes) FROM outbox WHERE delivery_id <> $1 GROUP BY published_at ORDER BY published_at", first)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	batches := 0
	for rows.Next() {
		var at string
		var n, sum, last int64
		if err := rows.Scan(&at, &n, &sum, &last); err != nil {
			t.Fatal(err)
		}
		batches++
		if sum-last >= forwardBatchBytes {
			t.Errorf("a batch marked at %s: %d rows, %d bytes, past %d before its last row", at, n, sum, forwardBatchBytes)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if batches < 24*300<<10/forwardBatchBytes {
		t.Errorf("24 webhooks of some 300 KB marked in %d batches", batches)
	}
}

// A forwarder's read is sized by the rows it read last: as many as a
// batch takes (forwardBatchBytes, the row that reaches it too), not 60 of
// which all but a few would be thrown away, on PostgreSQL after crossing
// the connection.
func TestOutboxBatchRows(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		rowBytes int64
		want     int
	}{
		{0, forwardBatch},       // nothing read yet
		{4 << 10, forwardBatch}, // typical webhooks, compressed
		{300 << 10, 4},          // 3 rows are 900 KB, the fourth reaches 1 MiB
		{170 << 10, 7},          // 1 MB webhooks
		{forwardBatchBytes, 1},  // the first reaches it
		{32 << 20, 1},           // larger than a batch
		{forwardBatchBytes / forwardBatch, forwardBatch},
	} {
		o := &Outbox{rowBytes: c.rowBytes}
		if got := o.batchRows(); got != c.want {
			t.Errorf("rows of %d bytes: a read of %d, want %d", c.rowBytes, got, c.want)
		}
	}
}
