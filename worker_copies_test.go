package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// One event, many hooks: GitHub sends one event to every hook that
// subscribes to it under one X-GitHub-Delivery GUID, told apart by
// X-GitHub-Hook-ID. Each hook's copy is a delivery of its own.

const (
	testRepoHook = 111 // a repository webhook's X-GitHub-Hook-ID
	testAppHook  = 222 // the bot App's
)

// postCopy sends a signed copy of an event as GitHub sends it to a
// repository webhook (bot false) or to the bot App's hook, and returns the
// status code.
func postCopy(t testing.TB, url, event, guid string, body []byte, bot bool) int {
	t.Helper()
	r := webhookRequest(t, url, event, guid, body)
	if bot {
		r.Header.Set("X-GitHub-Hook-ID", fmt.Sprint(testAppHook))
		r.Header.Set("X-GitHub-Hook-Installation-Target-Type", "integration")
		r.Header.Set("X-GitHub-Hook-Installation-Target-ID", fmt.Sprint(testBotAppID))
	} else {
		r.Header.Set("X-GitHub-Hook-ID", fmt.Sprint(testRepoHook))
		r.Header.Set("X-GitHub-Hook-Installation-Target-Type", "repository")
		r.Header.Set("X-GitHub-Hook-Installation-Target-ID", "35129377")
	}
	code, _ := do(t, r)
	return code
}

// Both arrival orders, the repository hook's copy first and the bot App's
// first, keep two raw rows and fill the typed row from the App's copy; a
// redelivery to the same hook stays a duplicate; the statistics count the
// event once and its alert goes out once.
func TestManyHooksOneEvent(t *testing.T) {
	t.Parallel()
	onBothStores(t, testManyHooksOneEvent)
}

func testManyHooksOneEvent(t *testing.T) {
	for _, c := range []struct {
		name  string
		first bool // the first copy is the bot App's
	}{{"repository hook first", false}, {"bot App first", true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var pushes atomic.Int32
			push := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				pushes.Add(1)
			}))
			t.Cleanup(push.Close)
			vhost := newVhost(t)
			cfg := testConfig(t, amqpURL(vhost))
			cfg.GitHub.BotAppID = testBotAppID
			cfg.Alerts = AlertsConfig{Rules: []AlertRule{{Events: []string{"pull_request.*"}, Channels: []string{"push"}}},
				Push: PushConfig{URL: push.URL}}
			d := startDaemon(t, cfg)
			db := openStoreDB(t, cfg.Database)

			body := loadFixture(t, "pull_request", "opened")
			guid := newGUID()
			for _, bot := range []bool{c.first, !c.first} {
				if code := postCopy(t, d.URL, "pull_request", guid, body, bot); code != http.StatusAccepted {
					t.Fatalf("copy (bot %v): %d, want 202", bot, code)
				}
				// The second copy is sent once the first is stored, so
				// that the order is the one this case names.
				eventually(t, 30*time.Second, "the copy stored by both workers", func() bool {
					hook := map[bool]int{true: testAppHook, false: testRepoHook}[bot]
					return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND hook_id = $2", guid, hook) == 1 &&
						queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = $1 AND hook_id = $2", guid, hook) == 1
				})
			}
			if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid); n != 2 {
				t.Errorf("raw rows of the event: %d, want 2 (one per hook)", n)
			}
			if n := queryInt(t, db, "SELECT count(*) FROM github_pull_requests WHERE delivery_id = $1 AND hook_id = $2", guid, testAppHook); n != 1 {
				t.Errorf("typed rows from the App's copy: %d, want 1", n)
			}
			if n := queryInt(t, db, "SELECT coalesce(sum(count), 0) FROM github_statistics_6h WHERE event = 'pull_request'"); n != 1 {
				t.Errorf("statistics count %d, want the event once", n)
			}

			// GitHub redelivers the repository hook's copy: a duplicate.
			if code := postCopy(t, d.URL, "pull_request", guid, body, false); code != http.StatusAccepted {
				t.Fatalf("redelivery: %d", code)
			}
			eventually(t, 30*time.Second, "the redelivery counted as a duplicate", func() bool {
				return queryInt(t, db, "SELECT duplicates FROM github WHERE delivery_id = $1 AND hook_id = $2", guid, testRepoHook) == 1
			})
			eventually(t, 30*time.Second, "the event's alert sent", func() bool { return pushes.Load() >= 1 })
			if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid); n != 2 {
				t.Errorf("raw rows after the redelivery: %d, want still 2", n)
			}
			if n := queryInt(t, db, "SELECT coalesce(sum(count), 0) FROM github_statistics_6h WHERE event = 'pull_request'"); n != 1 {
				t.Errorf("statistics count after the redelivery %d, want 1", n)
			}
			// The story names both hooks, and -hook narrows to one.
			st, err := d.store.Story(context.Background(), guid)
			if err != nil {
				t.Fatalf("story: %v", err)
			}
			if len(st.Copies) != 2 {
				t.Fatalf("story: %d copies, want 2", len(st.Copies))
			}
			text := storyText(st)
			for _, want := range []string{fmt.Sprintf("hook %d, sent to repository 35129377", testRepoHook),
				fmt.Sprintf("hook %d, sent to integration %d", testAppHook, testBotAppID), "github_pull_requests"} {
				if !strings.Contains(text, want) {
					t.Errorf("the story lacks %q:\n%s", want, text)
				}
			}
			if err := st.Narrow(testRepoHook); err != nil || len(st.Copies) != 1 || len(st.Copies[0].Rows) != 0 {
				t.Errorf("narrowed to the repository hook: %v %+v, want its copy alone, with no typed row", err, st.Copies)
			}
			// The search lists each copy, ?hook= one; the page shows one
			// hook's copy with ?hook=.
			page := func(path string) string {
				req, _ := http.NewRequest(http.MethodGet, d.URL+path, nil)
				req.SetBasicAuth("operator", "operator-token-for-tests")
				code, body := do(t, req)
				if code != http.StatusOK {
					t.Fatalf("%s: %d", path, code)
				}
				return body
			}
			link := func(hook int) string { return fmt.Sprintf(`href="/status/deliveries/%s?hook=%d"`, guid, hook) }
			if all := page("/status/deliveries?guid=" + guid); !strings.Contains(all, link(testRepoHook)) || !strings.Contains(all, link(testAppHook)) {
				t.Errorf("the search does not list both copies")
			}
			if one := page(fmt.Sprintf("/status/deliveries?guid=%s&hook=%d", guid, testAppHook)); strings.Contains(one, link(testRepoHook)) ||
				!strings.Contains(one, link(testAppHook)) {
				t.Errorf("the search with ?hook=%d does not list the App's copy alone", testAppHook)
			}
			if p := page(fmt.Sprintf("/status/deliveries/%s?hook=%d", guid, testRepoHook)); strings.Contains(p, fmt.Sprintf("hook %d,", testAppHook)) ||
				!strings.Contains(p, fmt.Sprintf("hook %d,", testRepoHook)) {
				t.Errorf("the page with ?hook=%d does not show that copy alone", testRepoHook)
			}
			d.stop(t) // the sender sends what is due before it stops
			if n := pushes.Load(); n != 1 {
				t.Errorf("alerts pushed: %d, want one for the event", n)
			}
			if n := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id = $1", guid); n != 1 {
				t.Errorf("alert_outbox rows: %d, want 1", n)
			}
			if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND alerted_at IS NOT NULL", guid); n != 1 {
				t.Errorf("copies marked alerted: %d, want the first one", n)
			}

		})
	}
}

// storyText is the story as `deliveries show` prints it.
func storyText(st *DeliveryStory) string {
	var b strings.Builder
	for _, l := range st.Lines() {
		fmt.Fprintf(&b, "%s\t%s\n", l.Label, l.Text)
	}
	return b.String()
}

// The ledger reads the App's deliveries: a repository hook's copy of the
// event does not make the App's delivery stored, nor resolve its gap; the
// App's copy does.
func TestLedgerCountsTheAppsCopy(t *testing.T) {
	t.Parallel()
	onBothStores(t, testLedgerCountsTheAppsCopy)
}

func testLedgerCountsTheAppsCopy(t *testing.T) {
	ctx := context.Background()
	store, err := OpenStore(ctx, testStore(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	const app = 4242
	guid := newGUID()
	handle := eventFunc(serviceHandler(nil, app, false))
	store1 := func(ev *Event) {
		t.Helper()
		if err := store.WriteTx(ctx, func(tx *Tx) error { return handle(ctx, tx, ev) }); err != nil {
			t.Fatal(err)
		}
	}
	err = store.WriteTx(ctx, func(tx *Tx) error {
		_, err := tx.RecordGap(ctx, deliveryGap{GUID: guid, DeliveryID: 7, Event: "issues", DeliveredAt: time.Now(), FoundAt: time.Now()}, nil)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	repoCopy := &Event{DeliveryID: guid, Name: "issues", HookID: testRepoHook, TargetType: "repository", TargetID: 1,
		Payload: []byte("{}"), ReceivedAt: time.Now()}
	store1(repoCopy)
	stored, _, err := store.LedgerLookup(ctx, 0, app, []string{guid})
	if err != nil || stored[guid] {
		t.Errorf("after the repository hook's copy: stored %v (%v), want the App's delivery not stored", stored[guid], err)
	}
	if err := store.WriteTx(ctx, func(tx *Tx) error { _, err := tx.ResolveStoredGaps(ctx, 0, app); return err }); err != nil {
		t.Fatal(err)
	}
	if gaps, _, _ := store.OpenGaps(ctx, 10); len(gaps) != 1 {
		t.Errorf("open gaps after the repository hook's copy: %d, want the App's still open", len(gaps))
	}
	appCopy := &Event{DeliveryID: guid, Name: "issues", HookID: testAppHook, TargetType: "integration", TargetID: app,
		Payload: []byte("{}"), ReceivedAt: time.Now()}
	store1(appCopy)
	stored, _, err = store.LedgerLookup(ctx, 0, app, []string{guid})
	if err != nil || !stored[guid] {
		t.Errorf("after the App's copy: stored %v (%v), want stored", stored[guid], err)
	}
	if gaps, _, _ := store.OpenGaps(ctx, 10); len(gaps) != 0 {
		t.Errorf("open gaps after the App's copy: %d, want it resolved", len(gaps))
	}
}

// X-GitHub-Hook-ID is part of a delivery's identity and is bounded like the
// other headers: up to 20 decimal digits, else 400, and nothing published.
func TestHookIDBounded(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	for _, c := range []struct {
		hook string
		want int
	}{
		{"12345678901234567890", http.StatusBadRequest}, // 20 digits, past an int64
		{"123456789012345678901", http.StatusBadRequest},
		{"12a", http.StatusBadRequest},
		{"-5", http.StatusBadRequest},
		{"9223372036854775807", http.StatusAccepted},
		{"", http.StatusAccepted},
	} {
		r := webhookRequest(t, d.URL, "issues", newGUID(), body)
		if c.hook != "" {
			r.Header.Set("X-GitHub-Hook-ID", c.hook)
		}
		code, answer := do(t, r)
		if code != c.want || (c.want == http.StatusBadRequest && !strings.Contains(answer, "X-GitHub-Hook-ID")) {
			t.Errorf("X-GitHub-Hook-ID %q: %d %s, want %d naming the header", c.hook, code, answer, c.want)
		}
	}
	// A message from elsewhere with a hook ID no delivery has goes to
	// -error: a guessed hook would make it another delivery's duplicate.
	msg := eventMessage("issues", newGUID(), body)
	msg.Headers[hdrHookID] = "not-a-hook"
	publishRaw(t, vhost, exchangeName, "", msg)
	eventually(t, 30*time.Second, "the message in github-error", func() bool { return ready(t, vhost, errorQueue(queueGitHub)) == 1 })
	if d := getOne(t, vhost, errorQueue(queueGitHub)); !strings.Contains(tableString(d.Headers, hdrErrorReason), "X-GitHub-Hook-ID") {
		t.Errorf("x-error-reason %q, want it to name X-GitHub-Hook-ID", tableString(d.Headers, hdrErrorReason))
	}
}

// A database written by the schema before hooks were told apart (version
// 12) is upgraded keeping every row, and its duplicates stay duplicates:
// a row stored with a hook ID, and one stored without.
func TestUpgradeKeepsDuplicates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	cfg := DefaultConfig().Database
	cfg.Path = filepath.Join(dir, "v12.db")
	store, err := OpenStore(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	ms, err := parseMigrations(schemaSQL)
	if err != nil || len(ms) < 13 {
		t.Fatalf("migrations: %d %v", len(ms), err)
	}
	var v12 bytes.Buffer
	for _, m := range ms[:12] {
		v12.WriteString(m.sql)
	}
	if _, err := store.w.Exec(v12.String() + "; PRAGMA user_version = 12"); err != nil {
		t.Fatal(err)
	}
	now := formatTime(time.Now())
	// As version 12 stored them: hook_id NULL when the message had none,
	// worker_deliveries keyed by worker and GUID.
	for _, r := range []struct {
		guid string
		hook any
	}{{"with-hook", 555}, {"without-hook", nil}} {
		if _, err := store.w.Exec(`INSERT INTO github (delivery_id, event, action, hook_id, target_type, target_id, payload, received_at, processed_at, broker)
			VALUES ($1, 'issues', 'opened', $2, 'repository', 9, '{}', $3, $4, 'h/v')`, r.guid, r.hook, now, now); err != nil {
			t.Fatal(err)
		}
		if _, err := store.w.Exec(`INSERT INTO worker_deliveries (worker, delivery_id, processed_at) VALUES ('database-service', $1, $2)`, r.guid, now); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := store.w.Exec(`INSERT INTO github_statistics_6h (bucket, event, action, count) VALUES ($1, 'issues', 'opened', 2)`,
		statisticsBucket(time.Now())); err != nil {
		t.Fatal(err)
	}
	if from, to, err := store.Migrate(ctx); err != nil || from != 12 || to != len(ms) {
		t.Fatalf("Migrate: %d -> %d, %v", from, to, err)
	}
	db := openDB(t, cfg.Path)
	if n := queryInt(t, db, "SELECT count(*) FROM github WHERE broker = 'h/v'"); n != 2 {
		t.Errorf("rows kept: %d, want 2", n)
	}
	handle := eventFunc(serviceHandler(nil, 0, false))
	dbHandle := eventFunc(databaseHandler(0))
	for _, c := range []struct {
		guid string
		hook int64
	}{{"with-hook", 555}, {"without-hook", 0}} {
		ev := &Event{DeliveryID: c.guid, Name: "issues", Action: "opened", HookID: c.hook, TargetType: "repository", TargetID: 9,
			Payload: []byte(`{"action":"opened"}`), ReceivedAt: time.Now()}
		for name, h := range map[string]func(context.Context, *Tx, *Event) error{"service": handle, "database-service": dbHandle} {
			var verdict error
			err := store.WriteTx(ctx, func(tx *Tx) error { verdict = h(ctx, tx, ev); return nil })
			if err != nil || verdict != ErrDuplicate {
				t.Errorf("%s after the upgrade, %s (hook %d): %v %v, want a duplicate", name, c.guid, c.hook, err, verdict)
			}
		}
	}
	if n := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h"); n != 2 {
		t.Errorf("statistics: %d, want the 2 from before", n)
	}
	var dups sql.NullInt64
	if err := db.QueryRow("SELECT sum(duplicates) FROM github").Scan(&dups); err != nil || dups.Int64 != 2 {
		t.Errorf("duplicates counted: %v %v, want 2", dups, err)
	}
	var plan bytes.Buffer
	rows, _ := db.Query("SELECT json_group_array(name) FROM pragma_index_list('github')")
	for rows.Next() {
		var s string
		_ = rows.Scan(&s)
		plan.WriteString(s)
	}
	rows.Close()
	var names []string
	_ = json.Unmarshal(plan.Bytes(), &names)
	if len(names) < 7 {
		t.Errorf("github's indexes after the upgrade: %v, want every search index back", names)
	}
}
