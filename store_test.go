package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func TestStatisticsBucket(t *testing.T) {
	t.Parallel()
	tests := []struct{ in, want string }{
		{"2026-11-29T00:00:00Z", "2026-11-29T00:00:00Z"},
		{"2026-11-29T05:59:59Z", "2026-11-29T00:00:00Z"},
		{"2026-11-29T06:00:00Z", "2026-11-29T06:00:00Z"},
		{"2026-11-29T13:30:00+02:00", "2026-11-29T06:00:00Z"},
		{"2026-11-29T23:59:59Z", "2026-11-29T18:00:00Z"},
	}
	for _, tt := range tests {
		in, _ := time.Parse(time.RFC3339, tt.in)
		if got := statisticsBucket(in); got != tt.want {
			t.Errorf("statisticsBucket(%s): got %s, want %s", tt.in, got, tt.want)
		}
	}
}

// A backup taken while 1,000 webhooks are being processed opens, passes
// integrity_check, and holds every row committed before it started; a second
// backup to the same file is refused.
func TestBackupWhileServing(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	dir := t.TempDir()
	config := writeConfigWith(t, dir, "127.0.0.1:1", databaseKeys(cfg.Database), "", amqpURL(vhost))
	body := loadFixture(t, "push", "branch")

	var sent atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for sent.Add(1) <= 1000 {
				postWebhook(t, d.URL, "push", newGUID(), body)
			}
		}()
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, 60*time.Second, "300 rows stored", func() bool { return queryInt(t, db, "SELECT count(*) FROM github") >= 300 })

	committed := map[string]bool{}
	rows, err := db.Query("SELECT delivery_id FROM github")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		rows.Scan(&id)
		committed[id] = true
	}
	rows.Close()
	dest := filepath.Join(dir, "backup.db")
	var out bytes.Buffer
	if err := run(context.Background(), []string{"backup", "-config", config, dest}, &out, &out); err != nil {
		t.Fatalf("backup: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "integrity_check ok") || !regexp.MustCompile(`\d+ bytes in \d`).MatchString(out.String()) {
		t.Errorf("backup output lacks the check, the size or the duration: %s", out.String())
	}
	if fi, err := os.Stat(dest); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("backup file mode: %v %v, want 0600", fi.Mode().Perm(), err)
	}
	wg.Wait()

	bk, err := sql.Open("sqlite", "file:"+dest+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer bk.Close()
	var check string
	if err := bk.QueryRow("PRAGMA integrity_check").Scan(&check); err != nil || check != "ok" {
		t.Fatalf("integrity_check of the backup: %q %v", check, err)
	}
	missing := 0
	for id := range committed {
		var n int
		bk.QueryRow("SELECT count(*) FROM github WHERE delivery_id = $1", id).Scan(&n)
		if n != 1 {
			missing++
		}
	}
	if missing > 0 {
		t.Errorf("%d of %d rows committed before the backup are missing from it", missing, len(committed))
	}
	var total int
	bk.QueryRow("SELECT count(*) FROM github").Scan(&total)
	t.Logf("backup holds %d rows (%d committed before it started)", total, len(committed))

	if err := run(context.Background(), []string{"backup", "-config", config, dest}, &out, &out); err == nil || !strings.Contains(err.Error(), "refusing to overwrite") {
		t.Errorf("second backup to the same file: %v", err)
	}
	eventually(t, 60*time.Second, "all 1,000 stored", func() bool { return queryInt(t, db, "SELECT count(*) FROM github") == 1000 })
}

// No secret of the config shows in a log line, an API answer or check-config.
func TestNoSecretLeaks(t *testing.T) {
	t.Parallel()
	onBothStores(t, testNoSecretLeaks)
}

func testNoSecretLeaks(t *testing.T) {
	vhost := newVhost(t)
	user, password := newBrokerUser(t, vhost, ".*", ".*", ".*")
	proxy := newTCPProxy(t, testBrokerAddr())
	brokerURL := "amqp://" + user + ":" + password + "@" + proxy.addr + "/" + vhost

	smtp, push := newSMTPSink(t), newPushSink(t)
	cfg := alertConfig(t, smtp.addr, push.srv.URL+"/topic-"+randHex(6), "*")
	cfg.Brokers = []BrokerConfig{{URL: brokerURL}}
	cfg.Queue.OutboxMaxBytes = 1 // the broker's path: its failure answered and logged at the door
	cfg.API.OperatorToken = "optoken-" + randHex(8)
	cfg.API.ProducerToken = "prtoken-" + randHex(8)
	cfg.GitHub.WebhookSecret = "whsecret-" + randHex(8)
	cfg.GitHub.PreviousWebhookSecrets = []string{"oldsecret-" + randHex(8)}
	cfg.Alerts.Email.Username, cfg.Alerts.Email.Password = "mailer", "mailpw-"+randHex(8)
	cfg.Alerts.Push.Token = "pushtoken-" + randHex(8)
	cfg.HealthChecks.Service = "http://" + reserveAddr(t) + "/hc-" + randHex(8)
	cfg.Log.Level = "debug"
	secrets := []string{password, cfg.API.OperatorToken, cfg.API.ProducerToken, cfg.GitHub.WebhookSecret,
		cfg.GitHub.PreviousWebhookSecrets[0], cfg.Alerts.Email.Password, cfg.Alerts.Push.Token,
		strings.TrimPrefix(cfg.Alerts.Push.URL, push.srv.URL+"/"), cfg.HealthChecks.Service[strings.LastIndex(cfg.HealthChecks.Service, "/")+1:]}

	d := startDaemon(t, cfg)
	var answers strings.Builder
	collect := func(code int, body string) { answers.WriteString(body + "\n") }
	body := loadFixture(t, "issues", "opened")
	r := webhookRequest(t, d.URL, "issues", newGUID(), body)
	r.Header.Set("X-Hub-Signature-256", sign(cfg.GitHub.WebhookSecret, body))
	collect(do(t, r))
	collect(do(t, webhookRequest(t, d.URL, "issues", newGUID(), body))) // wrong secret
	for _, tok := range []string{cfg.API.OperatorToken, cfg.API.ProducerToken, "wrong"} {
		req, _ := http.NewRequest(http.MethodGet, d.URL+"/api/v1/broker", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		collect(do(t, req))
	}
	collect(do(t, mustRequest(t, http.MethodGet, d.URL+"/readyz")))
	consuming(t, vhost, queueGitHub, queueDatabase)
	// The broker goes away: errors are logged and answered.
	proxy.Close()
	r = webhookRequest(t, d.URL, "issues", newGUID(), body)
	r.Header.Set("X-Hub-Signature-256", sign(cfg.GitHub.WebhookSecret, body))
	collect(do(t, r))
	collect(do(t, mustRequest(t, http.MethodGet, d.URL+"/readyz")))
	logged(t, d.logs, "cycle failed", 2)
	d.stop(t)

	// check-config on the same settings.
	dir := t.TempDir()
	p := filepath.Join(dir, "c.toml")
	os.WriteFile(p, []byte(`[server]
listen = "127.0.0.1:1"
[api]
operator_token = "`+cfg.API.OperatorToken+`"
producer_token = "`+cfg.API.ProducerToken+`"
[github]
webhook_secret = "`+cfg.GitHub.WebhookSecret+`"
previous_webhook_secrets = ["`+cfg.GitHub.PreviousWebhookSecrets[0]+`"]
[alerts.email]
host = "127.0.0.1"
password = "`+cfg.Alerts.Email.Password+`"
[alerts.push]
url = "`+cfg.Alerts.Push.URL+`"
token = "`+cfg.Alerts.Push.Token+`"
[healthchecks]
service = "`+cfg.HealthChecks.Service+`"
[[brokers]]
url = "`+brokerURL+`"
`), 0o600)
	var out bytes.Buffer
	if err := run(context.Background(), []string{"check-config", "-config", p}, &out, &out); err != nil {
		t.Fatalf("check-config: %v", err)
	}
	for name, text := range map[string]string{"logs": d.logs.String(), "API answers": answers.String(), "check-config": out.String()} {
		for _, s := range secrets {
			if strings.Contains(text, s) {
				t.Errorf("%s show the secret %q", name, s)
			}
		}
	}
	if !strings.Contains(d.logs.String(), "outcome=unavailable") {
		t.Errorf("the broker failure was not logged, so the test saw no error path")
	}
}

// Payloads older than database.raw_retention are emptied and identities
// older than database.delivery_retention deleted, in transactions of at
// most 1,000 rows, by the cleanup worker; statistics stay. A delivery whose
// payload was pruned is still known: GitHub's redelivery of it is a
// duplicate, counted once, and the ledger counts it stored.
func TestRawRetention(t *testing.T) {
	t.Parallel()
	onBothStores(t, testRawRetention)
}

func testRawRetention(t *testing.T) {
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Database.RawRetention = Duration(githubRedeliveryWindow)
	cfg.Database.DeliveryRetention = Duration(30 * 24 * time.Hour)
	ctx := context.Background()
	p := newParts(t, cfg)
	forgotten, pruned := time.Now().Add(-40*24*time.Hour), time.Now().Add(-4*24*time.Hour)
	body := loadFixture(t, "issues", "opened")
	err := p.store.WriteTx(ctx, func(tx *Tx) error {
		for i := 0; i < 2500; i++ {
			if _, err := tx.InsertEvent(ctx, &Event{DeliveryID: fmt.Sprintf("old-%d", i), Name: "issues", Action: "opened",
				Payload: body, ReceivedAt: forgotten}, false); err != nil {
				return err
			}
		}
		for i := 0; i < 3; i++ {
			// Copies of the hook webhookRequest names, which the
			// redelivery below is a duplicate of.
			if _, err := tx.InsertEvent(ctx, &Event{DeliveryID: fmt.Sprintf("pruned-%d", i), Name: "issues", Action: "opened",
				HookID: testHookID, TargetType: "integration", TargetID: 4242, Payload: body, ReceivedAt: pruned}, false); err != nil {
				return err
			}
		}
		_, err := tx.InsertEvent(ctx, &Event{DeliveryID: "recent", Name: "issues", Action: "opened", Payload: body, ReceivedAt: time.Now()}, false)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.store.WriteTx(ctx, func(tx *Tx) error {
		_, err := tx.MarkDelivery(ctx, "database-service", DeliveryKey{Hook: testHookID, GUID: "pruned-1"}, nil)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// One call does one batch.
	var n int64
	if err := p.store.WriteTx(ctx, func(tx *Tx) (err error) {
		n, err = tx.PrunePayloadsBefore(ctx, time.Now().Add(-time.Duration(cfg.Database.RawRetention)))
		return err
	}); err != nil || n != retentionBatch {
		t.Fatalf("one batch: pruned %d, %v; want %d", n, err, retentionBatch)
	}
	p.store.Close()

	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "old deliveries forgotten by cleanup", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id LIKE 'old-%'") == 0
	})
	eventually(t, 20*time.Second, "payloads past raw_retention emptied", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id LIKE 'pruned-%' AND payload = '' AND payload_zstd IS NULL AND payload_pruned_at IS NOT NULL") == 3
	})
	if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = 'recent' AND payload_zstd IS NOT NULL AND payload_pruned_at IS NULL"); n != 1 {
		t.Errorf("the recent row: %d, want kept with its payload", n)
	}
	if n := queryInt(t, db, "SELECT coalesce(sum(count), 0) FROM github_statistics_6h"); n != 2504 {
		t.Errorf("statistics: %d, want all 2,504 kept", n)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = 'pruned-1'"); n != 1 {
		t.Errorf("the worker record of a pruned delivery: %d, want kept", n)
	}

	// GitHub redelivers a pruned delivery: both workers take it as a
	// duplicate, and nothing is counted twice.
	if code := postWebhook(t, d.URL, "issues", "pruned-2", body); code != http.StatusAccepted {
		t.Fatalf("redelivery: %d", code)
	}
	eventually(t, 20*time.Second, "the redelivery taken as a duplicate by the service worker", func() bool {
		return scrape(t, d.URL+"/metrics")[`switchyard_messages_consumed_total{outcome="duplicate",queue="github"}`] == 1
	})
	if n := queryInt(t, db, "SELECT coalesce(sum(count), 0) FROM github_statistics_6h"); n != 2504 {
		t.Errorf("statistics after the redelivery of a pruned delivery: %d, want 2,504", n)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = 'pruned-2' AND payload = '' AND payload_zstd IS NULL"); n != 1 {
		t.Errorf("the pruned delivery's row: %d, want it as it was", n)
	}
	// The ledger counts a pruned delivery stored.
	s, err := OpenStore(ctx, cfg.Database, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	stored, _, err := s.LedgerLookup(ctx, 0, 4242, []string{"pruned-0", "old-0", "recent"})
	if err != nil || !stored["pruned-0"] || !stored["recent"] || stored["old-0"] {
		t.Errorf("ledger: stored %v (%v), want pruned-0 and recent", stored, err)
	}
}

// Migration 5 fills github_updated_at of rows written before it from the
// payload of the delivery that wrote them, in the stored time format; a row
// whose raw payload is gone keeps NULL, which reads as older than anything.
func TestMigrationFillsGitHubUpdatedAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := DefaultConfig().Database
	cfg.Path = filepath.Join(t.TempDir(), "v4.db")
	store, err := OpenStore(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	ms, err := parseMigrations(schemaSQL)
	if err != nil || len(ms) < 5 {
		t.Fatalf("migrations: %d, %v", len(ms), err)
	}
	for _, m := range ms[:4] {
		if _, err := store.w.Exec(m.sql); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := store.w.Exec("PRAGMA user_version = 4"); err != nil {
		t.Fatal(err)
	}
	body := loadFixture(t, "pull_request", "closed")
	ev := &Event{DeliveryID: "pr-closed", Name: "pull_request", Action: "closed", Payload: body, ReceivedAt: time.Now()}
	if err := insertOldRow(store, ev); err != nil {
		t.Fatal(err)
	}
	for i, delivery := range []string{"pr-closed", "raw-row-gone"} {
		if _, err := store.w.Exec(`INSERT INTO github_pull_requests (node_id, delivery_id, repository_owner, repository_name,
			number, state, last_action, processing_state, processing_date, created_at, updated_at)
			VALUES ($1, $2, 'o', 'r', $3, 'CLOSED', 'closed', 'NEW', 'x', 'x', 'x')`, fmt.Sprint("node-", i), delivery, i+1); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var p struct {
		PullRequest struct {
			UpdatedAt string `json:"updated_at"`
		} `json:"pull_request"`
	}
	if err := json.Unmarshal(body, &p); err != nil {
		t.Fatal(err)
	}
	want, _ := normalizeTime(p.PullRequest.UpdatedAt)
	var got sql.NullString
	if err := store.r.QueryRow("SELECT github_updated_at FROM github_pull_requests WHERE delivery_id = 'pr-closed'").Scan(&got); err != nil || got.String != want {
		t.Errorf("filled github_updated_at: %q (%v), want %q", got.String, err, want)
	}
	if err := store.r.QueryRow("SELECT github_updated_at FROM github_pull_requests WHERE delivery_id = 'raw-row-gone'").Scan(&got); err != nil || got.Valid {
		t.Errorf("github_updated_at without a raw row: %v (%v), want NULL", got, err)
	}
}

// A batch's statements are not watched one by one for their context (the
// driver would start a goroutine per statement), yet a batch whose context
// ends mid-way fails at its next statement and commits nothing.
func TestBatchContextEndsMidway(t *testing.T) {
	t.Parallel()
	onBothStores(t, testBatchContextEndsMidway)
}

func testBatchContextEndsMidway(t *testing.T) {
	store, _ := benchStore(t)
	defer store.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	insert := "INSERT INTO worker_deliveries (worker, delivery_id, processed_at) VALUES ('t', $1, 'x')"
	var afterCancel error
	err := store.WriteTx(ctx, func(tx *Tx) error {
		if _, err := tx.write(ctx, atOnce, insert, "before"); err != nil {
			return err
		}
		cancel()
		_, afterCancel = tx.write(ctx, atOnce, insert, "after")
		return afterCancel
	})
	if afterCancel == nil || err == nil {
		t.Fatalf("statement after the context ended: %v, batch: %v; want both to fail", afterCancel, err)
	}
	if n := queryInt(t, store.r, "SELECT count(*) FROM worker_deliveries WHERE worker = 't'"); n != 0 {
		t.Fatalf("%d rows committed from a batch whose context ended", n)
	}
}

// On PostgreSQL a batch whose context ends before its queued statements
// are sent (Tx.Pipeline) fails with the context's error and commits
// nothing, and it is not run again as if a statement had been answered
// otherwise.
func TestPipelineContextEndsBeforeSend(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	store, err := OpenStore(context.Background(), postgresConfig(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	if _, _, err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runs := 0
	err = store.WriteTx(ctx, func(tx *Tx) error {
		runs++
		tx.Pipeline()
		if _, err := tx.write(ctx, ahead(1), "INSERT INTO worker_deliveries (worker, delivery_id, processed_at) VALUES ('t', 'queued', 'x')"); err != nil {
			return err
		}
		cancel()
		return nil
	})
	if !errors.Is(err, context.Canceled) || runs != 1 {
		t.Errorf("a batch cut short before its statements went: %v after %d runs, want context.Canceled after 1", err, runs)
	}
	if n := queryInt(t, store.r, "SELECT count(*) FROM worker_deliveries WHERE worker = 't'"); n != 0 {
		t.Fatalf("%d rows committed from a batch whose context ended", n)
	}
}

// Each filter of the deliveries search reads an index that hands rows over
// in the page's order, or narrows to a few: never the whole github table,
// and never a sort of everything that matches. (The forbidden outcome once
// looked through every row for the few that are: two seconds with a
// million rows, where the others took a millisecond.)
func TestSearchReadsIndexes(t *testing.T) {
	t.Parallel()
	p := newParts(t, testConfig(t, amqpURL("unused")))
	day := time.Now().Add(-24 * time.Hour)
	for _, c := range []struct {
		f     DeliveryFilter
		uses  string // the index the plan must name
		sorts bool   // the index narrows to a set, which is sorted
	}{
		{DeliveryFilter{}, "github_received_at", false},
		{DeliveryFilter{Event: "issues"}, "github_event_received", false},
		{DeliveryFilter{Repository: "octo/repo"}, "github_repository_received", false},
		{DeliveryFilter{Sender: "nobody"}, "github_sender_received", false},
		{DeliveryFilter{GUIDPrefix: "abc"}, "sqlite_autoindex_github_1 (delivery_id>? AND delivery_id<?)", true},
		{DeliveryFilter{Outcome: "stale"}, "worker_deliveries_stale", true},
		{DeliveryFilter{Outcome: "forbidden"}, "github_forbidden_received", false},
		{DeliveryFilter{Outcome: "stored"}, "github_received_at", false},
		{DeliveryFilter{From: day, To: day.Add(time.Hour)}, "github_received_at", false},
		{DeliveryFilter{Event: "issues", AfterTime: day, AfterID: 7}, "github_event_received", false},
		{DeliveryFilter{Outcome: "rejected"}, "rejected_webhooks_received", false},
		{DeliveryFilter{Outcome: "rejected", GUIDPrefix: "abc"}, "rejected_webhooks_delivery (delivery_id>? AND delivery_id<?)", true},
		{DeliveryFilter{Outcome: "rejected", Event: "issues", AfterTime: day, AfterID: 7}, "rejected_webhooks_received", false},
	} {
		q, args := searchQuery(c.f, deliveriesPageSize)
		if c.f.Outcome == "rejected" {
			q, args = rejectedQuery(c.f, deliveriesPageSize)
		}
		rows, err := p.store.r.Query("EXPLAIN QUERY PLAN "+q, args...)
		if err != nil {
			t.Fatal(err)
		}
		var plan []string
		for rows.Next() {
			var id, parent, notused int
			var detail string
			if err := rows.Scan(&id, &parent, &notused, &detail); err != nil {
				t.Fatal(err)
			}
			plan = append(plan, detail)
		}
		rows.Close()
		text := strings.Join(plan, "; ")
		if !strings.Contains(text, c.uses) || strings.Contains(text, "SCAN g;") || strings.HasSuffix(text, "SCAN g") ||
			strings.Contains(text, "SCAN r;") || strings.HasSuffix(text, "SCAN r") ||
			strings.Contains(text, "TEMP B-TREE FOR ORDER BY") != c.sorts {
			t.Errorf("filter %+v: plan %q, want it to read %s in order", c.f, text, c.uses)
		}
	}
}

// insertOldRow writes ev's github row as the first schema has it, the way
// an old release stored it, for the tests that upgrade an old database.
func insertOldRow(store *Store, ev *Event) error {
	_, err := store.w.Exec(`INSERT INTO github (delivery_id, event, action, payload, received_at, processed_at)
		VALUES ($1, $2, $3, $4, $5, $6)`, ev.DeliveryID, ev.Name, ev.Action, string(ev.Payload), formatTime(ev.ReceivedAt), formatTime(time.Now()))
	return err
}

// Every table is STRICT: SQLite then refuses a value of the wrong type
// instead of storing it.
func TestEveryTableStrict(t *testing.T) {
	t.Parallel()
	p := newParts(t, testConfig(t, amqpURL("unused")))
	rows, err := p.store.r.Query("SELECT name, strict FROM pragma_table_list WHERE schema = 'main' AND type = 'table' AND name NOT LIKE 'sqlite_%'")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var name string
		var strict bool
		if err := rows.Scan(&name, &strict); err != nil {
			t.Fatal(err)
		}
		n++
		if !strict {
			t.Errorf("table %s is not STRICT", name)
		}
	}
	if err := rows.Err(); err != nil || n < 20 {
		t.Errorf("tables read: %d (%v)", n, err)
	}
}

// copy-db moves a whole SQLite database, a duplicate and an event two
// hooks received among it, up to PostgreSQL and back: every table's rows
// as they were, duplicates still duplicates, new rows with new ids; a
// target that holds rows is refused, and nothing is changed.
func TestCopyDB(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := postgresConfig(t)
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.GitHub.BotAppID = testBotAppID
	store, err := OpenStore(ctx, cfg.Database, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	service := eventFunc(serviceHandler(nil, testBotAppID, false))
	database := eventFunc(databaseHandler(testBotAppID))
	guid := newGUID()
	body := loadFixture(t, "pull_request", "opened")
	copyOf := func(hook int64, bot bool) *Event {
		ev := &Event{DeliveryID: guid, Name: "pull_request", Action: "opened", HookID: hook, Payload: body,
			ReceivedAt: time.Now(), TargetType: "repository", TargetID: 35129377}
		if bot {
			ev.TargetType, ev.TargetID = "integration", testBotAppID
		}
		return ev
	}
	err = store.WriteTx(ctx, func(tx *Tx) error {
		for _, ev := range []*Event{copyOf(testRepoHook, false), copyOf(testAppHook, true), copyOf(testRepoHook, false)} {
			if err := service(ctx, tx, ev); err != nil && !errors.Is(err, ErrDuplicate) {
				return err
			}
			if err := database(ctx, tx, ev); err != nil && !errors.Is(err, ErrDuplicate) {
				return err
			}
		}
		_, err := tx.RecordGap(ctx, deliveryGap{GUID: "gap-guid", DeliveryID: 7, Event: "issues",
			DeliveredAt: time.Now().Add(-5 * time.Hour), FoundAt: time.Now()}, []string{"push"})
		return err
	})
	store.Close()
	if err != nil {
		t.Fatal(err)
	}
	config := writeConfigWith(t, t.TempDir(), "127.0.0.1:1", databaseKeys(cfg.Database), "", amqpURL(vhost))
	var out bytes.Buffer
	if err := run(ctx, []string{"copy-db", "-config", config, "-to", pg.URL}, &out, &out); err != nil {
		t.Fatalf("copy-db to PostgreSQL: %v\n%s", err, out.String())
	}
	if !regexp.MustCompile(`(?m)^github +[1-9]`).MatchString(out.String()) || !strings.Contains(out.String(), "copied ") {
		t.Errorf("copy-db's report does not list the tables with their rows:\n%s", out.String())
	}
	sameTables(t, openDB(t, cfg.Database.Path), openStoreDB(t, pg))

	// A second copy into the same database is refused, and changes nothing.
	before := queryInt(t, openStoreDB(t, pg), "SELECT count(*) FROM github")
	out.Reset()
	err = run(ctx, []string{"copy-db", "-config", config, "-to", pg.URL}, &out, &out)
	if exitCode(err, io.Discard) != 1 || !errors.Is(err, ErrTargetNotEmpty) {
		t.Errorf("copy-db into a database with rows: %v, want exit 1 refusing it", err)
	}
	if n := queryInt(t, openStoreDB(t, pg), "SELECT count(*) FROM github"); n != before {
		t.Errorf("the refused copy changed the target: %d rows, want %d", n, before)
	}

	// And back, to a new SQLite file: the same rows again.
	back := filepath.Join(t.TempDir(), "back.db")
	pgConfig := writeConfigWith(t, t.TempDir(), "127.0.0.1:1", databaseKeys(pg), "", amqpURL(vhost))
	out.Reset()
	if err := run(ctx, []string{"copy-db", "-config", pgConfig, "-to", back}, &out, &out); err != nil {
		t.Fatalf("copy-db back to SQLite: %v\n%s", err, out.String())
	}
	sameTables(t, openDB(t, cfg.Database.Path), openDB(t, back))

	// On PostgreSQL the duplicate is still one, and a new row takes a new id.
	moved, err := OpenStore(ctx, pg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer moved.Close()
	var verdicts [2]error
	err = moved.WriteTx(ctx, func(tx *Tx) error {
		verdicts[0] = service(ctx, tx, copyOf(testRepoHook, false))
		other := copyOf(testRepoHook, false)
		other.DeliveryID = newGUID()
		verdicts[1] = service(ctx, tx, other)
		return nil
	})
	if err != nil || !errors.Is(verdicts[0], ErrDuplicate) || verdicts[1] != nil {
		t.Errorf("after the move: %v, the redelivery %v (want a duplicate), a new delivery %v (want stored)", err, verdicts[0], verdicts[1])
	}
	db := openStoreDB(t, pg)
	if n := queryInt(t, db, "SELECT duplicates FROM github WHERE delivery_id = $1 AND hook_id = $2", guid, testRepoHook); n != 2 {
		t.Errorf("duplicates of the repository hook's copy: %d, want 2", n)
	}
	if n := queryInt(t, db, "SELECT CAST(sum(count) AS BIGINT) FROM github_statistics_6h"); n != 2 {
		t.Errorf("statistics: %d, want the event and the new delivery, once each", n)
	}
}

// sameTables fails the test unless every table the two databases share,
// but those copy-db leaves out, holds the same rows.
func sameTables(t *testing.T, a, b *sql.DB) {
	t.Helper()
	rowsOf := func(db *sql.DB, table string) []string {
		rows, err := db.Query("SELECT * FROM " + table)
		if err != nil {
			t.Fatalf("%s: %v", table, err)
		}
		defer rows.Close()
		cols, _ := rows.Columns()
		var out []string
		for rows.Next() {
			vals := scanAny(t, rows, len(cols))
			var line []string
			for i, v := range vals {
				if b, ok := v.([]byte); ok {
					v = string(b)
				}
				line = append(line, fmt.Sprintf("%s=%v", cols[i], v))
			}
			sort.Strings(line)
			out = append(out, strings.Join(line, " "))
		}
		sort.Strings(out)
		return out
	}
	compared := 0
	for _, table := range append(statusTables, "settings", "github_statistics_6h", "hook_redeliveries", "github_attempts", "broker_usage") {
		ra, rb := rowsOf(a, table), rowsOf(b, table)
		if strings.Join(ra, "\n") != strings.Join(rb, "\n") {
			t.Errorf("%s differs:\n%s\nwant\n%s", table, strings.Join(rb, "\n"), strings.Join(ra, "\n"))
		}
		compared += len(ra)
	}
	if compared < 8 {
		t.Errorf("compared %d rows in all: the test copied too little to show anything", compared)
	}
}

// The two dialects keep one schema: the same tables, with the same
// columns (name, order, NOT NULL), primary and unique keys, checks and
// indexes, migrated from nothing on each.
func TestSchemaSameOnBothDialects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	type shape struct {
		columns []string // name and NOT NULL, in order
		uniques []string // the column lists of the primary key and each unique key
		checks  int
		indexes []string // the other indexes, by name
	}
	read := func(cfg DatabaseConfig) map[string]*shape {
		store, err := OpenStore(ctx, cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer store.Close()
		if _, _, err := store.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		tables, err := store.tables(ctx, store.pool())
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]*shape{}
		list := func(query string, args ...any) [][]string {
			rows, err := store.r.Query(query, args...)
			if err != nil {
				t.Fatalf("%s: %v", query, err)
			}
			defer rows.Close()
			cols, _ := rows.Columns()
			var res [][]string
			for rows.Next() {
				vals := make([]sql.NullString, len(cols))
				ptrs := make([]any, len(cols))
				for i := range vals {
					ptrs[i] = &vals[i]
				}
				if err := rows.Scan(ptrs...); err != nil {
					t.Fatal(err)
				}
				var r []string
				for _, v := range vals {
					r = append(r, v.String)
				}
				res = append(res, r)
			}
			return res
		}
		for _, table := range tables {
			sh := &shape{}
			out[table] = sh
			if store.Driver() == "sqlite" {
				for _, c := range list("SELECT name, \"notnull\" OR pk FROM pragma_table_info($1) ORDER BY cid", table) {
					sh.columns = append(sh.columns, c[0]+" "+c[1])
				}
				for _, ix := range list("SELECT name, \"unique\", origin FROM pragma_index_list($1)", table) {
					var cols []string
					for _, c := range list("SELECT name FROM pragma_index_info($1) ORDER BY seqno", ix[0]) {
						cols = append(cols, c[0])
					}
					if ix[1] == "1" {
						sh.uniques = append(sh.uniques, strings.Join(cols, ","))
					} else {
						sh.indexes = append(sh.indexes, ix[0])
					}
				}
				// A rowid or INTEGER PRIMARY KEY has no index of its own.
				for _, c := range list("SELECT name FROM pragma_table_info($1) WHERE pk = 1 AND (SELECT count(*) FROM pragma_table_info($1) WHERE pk > 0) = 1", table) {
					if !slices.Contains(sh.uniques, c[0]) {
						sh.uniques = append(sh.uniques, c[0])
					}
				}
				sql := list("SELECT sql FROM sqlite_master WHERE name = $1", table)[0][0]
				sh.checks = strings.Count(sql, "CHECK (")
			} else {
				for _, c := range list(`SELECT column_name, CASE is_nullable WHEN 'NO' THEN '1' ELSE '0' END FROM information_schema.columns
					WHERE table_schema = current_schema() AND table_name = $1 ORDER BY ordinal_position`, table) {
					sh.columns = append(sh.columns, c[0]+" "+c[1])
				}
				for _, ix := range list(`SELECT i.indexrelid::regclass::text, i.indisunique::text,
						(SELECT string_agg(a.attname, ',' ORDER BY k.n) FROM unnest(i.indkey) WITH ORDINALITY k(attnum, n)
							JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum)
					FROM pg_index i WHERE i.indrelid = $1::regclass`, table) {
					if ix[1] == "true" {
						sh.uniques = append(sh.uniques, ix[2])
					} else {
						sh.indexes = append(sh.indexes, ix[0])
					}
				}
				sh.checks = len(list("SELECT conname FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'c'", table))
			}
			sort.Strings(sh.uniques)
			sort.Strings(sh.indexes)
		}
		return out
	}
	lite := DefaultConfig().Database
	lite.Path = filepath.Join(t.TempDir(), "schema.db")
	a, b := read(lite), read(postgresConfig(t))
	for table, sa := range a {
		sb, ok := b[table]
		if !ok {
			t.Errorf("table %s is SQLite's only", table)
			continue
		}
		if fmt.Sprint(*sa) != fmt.Sprint(*sb) {
			t.Errorf("table %s differs:\n sqlite   %+v\n postgres %+v", table, *sa, *sb)
		}
	}
	for table := range b {
		if _, ok := a[table]; !ok {
			t.Errorf("table %s is PostgreSQL's only", table)
		}
	}
	if len(a) < 20 {
		t.Errorf("%d tables compared, want every table of the schema", len(a))
	}
}

// Every reader of the raw log gives back the exact bytes of each payload
// (the story, which the deliveries page, its download and `deliveries
// show` print; the alerts; reprocess), stored compressed or, as rows from
// before, as text, and again once the retention job compressed those: the
// recorded shapes, empty, one byte, and GitHub's largest. A payload that
// does not decompress is told as such; the story, the page and
// reprocess's reader go on.
func TestPayloadsGivenBackExactly(t *testing.T) {
	t.Parallel()
	onBothStores(t, testPayloadsGivenBackExactly)
}

func testPayloadsGivenBackExactly(t *testing.T) {
	ctx := context.Background()
	cfg := testConfig(t, amqpURL(newVhost(t)))
	cfg.Alerts = AlertsConfig{Rules: []AlertRule{{Events: []string{"*"}, Channels: []string{"push"}}}, Push: PushConfig{URL: "http://127.0.0.1:1/never"}}
	store, err := OpenStore(ctx, cfg.Database, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	payloads := map[string][]byte{"empty": {}, "one byte": []byte("x"),
		"25 MB": append(append([]byte(`{"action":"opened","issue":{"body":"`), bytes.Repeat([]byte(randHex(512)), 25<<20/1024)...), `"}}`...)}
	for _, f := range loadFixtures(t) {
		payloads[f.Event+"/"+f.Name] = f.Body
	}
	old := map[string]bool{} // stored as text, as a version before compression did
	names := slices.Sorted(maps.Keys(payloads))
	byName := payloads
	payloads = map[string][]byte{} // by GUID
	for i, name := range names {
		guid, p := fmt.Sprintf("exact-%03d", i), byName[name]
		err := store.WriteTx(ctx, func(tx *Tx) error {
			if i%2 == 1 {
				old[guid] = true
				_, err := tx.write(ctx, atOnce, `INSERT INTO github (delivery_id, event, payload, received_at, processed_at, first_copy)
					VALUES ($1, 'issues', $2, $3, $3, 1)`, guid, string(p), formatTime(time.Now()))
				return err
			}
			_, err := tx.InsertEvent(ctx, &Event{DeliveryID: guid, Name: "issues", Payload: p, ReceivedAt: time.Now()}, false, "push")
			return err
		})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		payloads[guid] = p
	}
	check := func(when string) {
		t.Helper()
		for guid, want := range payloads {
			st, err := store.Story(ctx, guid)
			if err != nil {
				t.Fatalf("%s, %s: %v", when, guid, err)
			}
			if got := st.Payload(); got != string(want) || st.Copies[0].Received.PayloadBytes != len(want) {
				t.Errorf("%s, %s (old %t): the story gives back %d bytes, want the %d stored", when, guid, old[guid], len(got), len(want))
			}
		}
		due, err := store.DueAlerts(ctx, "push", time.Now().Add(time.Hour), 1000)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range due {
			if want := payloads[a.Event.DeliveryID]; string(a.Event.Payload) != string(want) {
				t.Errorf("%s, %s: the alert's payload %d bytes, want %d", when, a.Event.DeliveryID, len(a.Event.Payload), len(want))
			}
		}
		// reprocess's reader, through the whole log.
		read := rawLog(t, store)
		for guid, want := range payloads {
			if c, ok := read[guid]; !ok || c.Unreadable != nil || string(c.Payload) != string(want) {
				t.Errorf("%s, %s (old %t): reprocess reads %d bytes (%v), want the %d stored", when, guid, old[guid], len(c.Payload), c.Unreadable, len(want))
			}
		}
	}
	check("stored")
	for after := int64(0); ; {
		last, _, err := store.CompressOlderPayloads(ctx, after, store.WriteTx)
		if err != nil {
			t.Fatal(err)
		}
		if last == after {
			break
		}
		after = last
	}
	if n, err := store.UncompressedPayloads(ctx); err != nil || n != 0 {
		t.Fatalf("payloads left as text after compressing: %d (%v)", n, err)
	}
	check("compressed by the retention job")

	// A payload that does not decompress is told, not a crash.
	if _, err := store.w.Exec("UPDATE github SET payload_zstd = $1 WHERE delivery_id = 'exact-002'", []byte("not zstd at all")); err != nil {
		t.Fatal(err)
	}
	st, err := store.Story(ctx, "exact-002")
	if err != nil || st.Copies[0].Received.Unreadable == "" || !strings.Contains(storyText(st), "payload\tunreadable: stored payload does not decompress") {
		t.Errorf("the story of a broken payload: %v\n%s", err, storyText(st))
	}
	if _, err := store.DueAlerts(ctx, "push", time.Now().Add(time.Hour), 1000); err != nil {
		t.Errorf("due alerts beside a broken payload: %v", err)
	}
	if c := rawLog(t, store)["exact-002"]; !errors.Is(c.Unreadable, ErrPayloadUnreadable) {
		t.Errorf("reprocess reads a broken payload as %v, want it told unreadable", c.Unreadable)
	}
}

// rawLog is every row of the raw log as reprocess reads it, by GUID.
func rawLog(t *testing.T, store *Store) map[string]RawCopy {
	t.Helper()
	out := map[string]RawCopy{}
	var after *RawCopy
	for {
		batch, err := store.RawCopies(context.Background(), RawFilter{}, after, 100, 64<<20)
		if err != nil {
			t.Fatalf("read the raw log: %v", err)
		}
		if len(batch) == 0 {
			return out
		}
		for _, c := range batch {
			out[c.GUID] = c
		}
		after = &batch[len(batch)-1]
	}
}

// Once the rows stored as text are compressed, the retention job looks
// only at rows stored since, never through the whole table again: a row
// below its mark made text again stays so, one stored after it is
// compressed.
func TestCompressionLooksOnlyAtNewRows(t *testing.T) {
	t.Parallel()
	onBothStores(t, testCompressionLooksOnlyAtNewRows)
}

func testCompressionLooksOnlyAtNewRows(t *testing.T) {
	ctx := context.Background()
	cfg := testConfig(t, amqpURL("unused"))
	p := newParts(t, cfg)
	insertText := func(id int) {
		t.Helper()
		err := p.store.WriteTx(ctx, func(tx *Tx) error {
			_, err := tx.write(ctx, atOnce, `INSERT INTO github (id, delivery_id, event, payload, received_at, processed_at, first_copy)
				VALUES ($1, $2, 'issues', '{"old":true}', $3, $3, 1)`, id, fmt.Sprint("old-", id), formatTime(time.Now()))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for id := 1; id <= 3; id++ {
		insertText(id)
	}
	r := NewRetention(p.store, cfg, p.log)
	r.every, r.compressPause = 20*time.Millisecond, time.Millisecond
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = r.Run(ctx, Holding{}); close(done) }()
	defer func() { cancel(); <-done }()
	db := openStoreDB(t, cfg.Database)
	text := func(id int) bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE id = $1 AND payload_zstd IS NULL", id) == 1
	}
	eventually(t, 10*time.Second, "the three rows compressed", func() bool { return !text(1) && !text(2) && !text(3) })

	if _, err := openWritableDB(t, cfg.Database).Exec(`UPDATE github SET payload = '{"old":true}', payload_zstd = NULL WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	insertText(1000)
	eventually(t, 10*time.Second, "the row stored after the pass compressed", func() bool { return !text(1000) })
	if !text(1) {
		t.Error("a row below the mark was looked at again: the job read through the whole table")
	}
}

// A database from before compression, its raw log as text, is compressed
// by serve in the background, a batch at a time; killed midway (SIGKILL)
// and started again, it goes on, and no row is lost or left unreadable.
func TestCompressionResumesAfterKill(t *testing.T) {
	t.Parallel()
	config, addr, dbPath := processSetup(t)
	ctx := context.Background()
	cfg := DefaultConfig().Database
	cfg.Path = dbPath
	store, err := OpenStore(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	const n = 10000
	fixtures := loadFixtures(t)
	want := map[string][]byte{}
	for i := range n {
		want[fmt.Sprintf("old-%05d", i)] = fixtures[i%len(fixtures)].Body
	}
	// The fixtures' rows, then the rest as copies of them made by SQLite
	// itself: one statement, not ten thousand under the race detector.
	err = store.WriteTx(ctx, func(tx *Tx) error {
		for i, f := range fixtures {
			if _, err := tx.write(ctx, atOnce, `INSERT INTO github (delivery_id, event, payload, received_at, processed_at, first_copy)
				VALUES ($1, 'issues', $2, $3, $3, 1)`, fmt.Sprintf("old-%05d", i), string(f.Body), formatTime(time.Now())); err != nil {
				return err
			}
		}
		_, err := tx.write(ctx, atOnce, `WITH RECURSIVE n(i) AS (SELECT $1 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < $2)
			INSERT INTO github (delivery_id, event, payload, received_at, processed_at, first_copy)
			SELECT printf('old-%05d', n.i), 'issues', f.payload, f.received_at, f.received_at, 1
			FROM n JOIN github f ON f.delivery_id = printf('old-%05d', n.i % $1)`, len(fixtures), n)
		return err
	})
	store.Close()
	if err != nil {
		t.Fatal(err)
	}
	db := openDB(t, dbPath)
	compressed := func() int { return queryInt(t, db, "SELECT count(*) FROM github WHERE payload_zstd IS NOT NULL") }
	// Rows are compressed in id order: the first and the last row tell
	// where it is, without reading every payload in each look.
	isCompressed := func(order string) bool {
		return queryInt(t, db, "SELECT payload_zstd IS NOT NULL FROM github ORDER BY id "+order+" LIMIT 1") == 1
	}

	cmd, out := startProcess(t, config, addr)
	eventually(t, 30*time.Second, "compression under way", func() bool { return isCompressed("ASC") })
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	midway := compressed()
	if midway == 0 || midway >= n {
		t.Fatalf("%d of %d compressed when killed: the kill did not fall midway\n%s", midway, n, out)
	}
	cmd, out = startProcess(t, config, addr)
	eventually(t, 60*time.Second, "every payload compressed", func() bool { return isCompressed("DESC") })
	stopProcess(t, cmd, out, 30*time.Second)

	store, err = OpenStore(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	rows, err := store.r.Query("SELECT delivery_id, payload, payload_zstd FROM github")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	seen := 0
	for rows.Next() {
		var guid, text string
		var z []byte
		if err := rows.Scan(&guid, &text, &z); err != nil {
			t.Fatal(err)
		}
		p, err := rowPayload(text, z)
		if err != nil || string(p) != string(want[guid]) || text != "" {
			t.Errorf("%s after the kill and the restart: %d bytes (%v), want its %d", guid, len(p), err, len(want[guid]))
		}
		seen++
	}
	if seen != n {
		t.Errorf("%d rows after the kill and the restart, want %d", seen, n)
	}
	t.Logf("killed with %d of %d compressed", midway, n)
}

// writesWaiting is store's (SQLite's) writer turns, and a condition that
// holds once first writes a client waits on and rest others wait for a
// turn.
func writesWaiting(store *Store) (*writerTurns, func(first, rest int) func() bool) {
	turns := &store.engine.(*sqliteEngine).turns
	return turns, func(first, rest int) func() bool {
		return func() bool {
			turns.mu.Lock()
			defer turns.mu.Unlock()
			return len(turns.first) == first && len(turns.rest) == rest
		}
	}
}

// On SQLite the outbox's commit, which a 202 waits on, takes the one
// writer connection before the writes that were waiting for it first
// (WriteTxFirst): while one transaction is under way, a consumer's write
// and then the outbox's queue up; the outbox's goes next. A write whose
// context ends while it waits leaves its place, and the others go on.
func TestOutboxWriteGoesFirst(t *testing.T) {
	t.Parallel()
	store, _ := benchStore(t)
	defer store.Close()
	turns, waiting := writesWaiting(store)
	ctx := context.Background()
	var order []string
	var mu sync.Mutex
	write := func(name string, first bool) chan error {
		done := make(chan error, 1)
		fn := func(tx *Tx) error {
			mu.Lock()
			order = append(order, name)
			mu.Unlock()
			_, err := tx.write(ctx, atOnce, "INSERT INTO worker_deliveries (worker, delivery_id, processed_at) VALUES ('t', $1, 'x')", name)
			return err
		}
		go func() {
			if first {
				done <- store.WriteTxFirst(ctx, fn)
			} else {
				done <- store.WriteTx(ctx, fn)
			}
		}()
		return done
	}
	hold, release := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		held <- store.WriteTx(ctx, func(*Tx) error { close(hold); <-release; return nil })
	}()
	<-hold
	consumer := write("consumer", false)
	eventually(t, 10*time.Second, "the consumer's write waiting", waiting(0, 1))
	gone, leave := context.WithCancel(ctx)
	left := make(chan error, 1)
	go func() { left <- store.WriteTxFirst(gone, func(*Tx) error { return errors.New("ran after it left") }) }()
	eventually(t, 10*time.Second, "a write that will leave waiting", waiting(1, 1))
	leave()
	if err := <-left; !errors.Is(err, context.Canceled) {
		t.Fatalf("the write that left: %v, want context.Canceled", err)
	}
	outbox := write("outbox", true)
	eventually(t, 10*time.Second, "the outbox's write waiting behind the consumer's", waiting(1, 1))
	close(release)
	for _, c := range []chan error{held, outbox, consumer} {
		if err := <-c; err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Equal(order, []string{"outbox", "consumer"}) {
		t.Fatalf("writes ran in the order %v, want the outbox's first", order)
	}
	eventually(t, 10*time.Second, "no write waiting", waiting(0, 0))
	if turns.busy {
		t.Fatal("the writer's turn is held after every write ended")
	}
}
