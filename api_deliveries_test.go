package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// apiGet is GET path with the bearer token (none when token is ""), and
// its status and body.
func apiGet(t testing.TB, base, path, token string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

const operatorToken = "operator-token-for-tests"

// GET /api/v1/deliveries is the deliveries search as JSON, paged by
// cursor (every issue once, while webhooks keep coming); GET
// /api/v1/deliveries/GUID is the delivery's story as the store tells it;
// both want the operator's token.
func TestDeliveriesJSON(t *testing.T) {
	t.Parallel()
	onBothStores(t, testDeliveriesJSON)
}

func testDeliveriesJSON(t *testing.T) {
	d := startDaemon(t, testConfig(t, amqpURL(newVhost(t))))
	db := openStoreDB(t, d.cfg.Database)
	var issues []string
	for range 5 {
		g := newGUID()
		issues = append(issues, g)
		postWebhook(t, d.URL, "issues", g, loadFixture(t, "issues", "opened"))
	}
	postWebhook(t, d.URL, "pull_request", newGUID(), loadFixture(t, "pull_request", "opened"))
	eventually(t, 20*time.Second, "all stored", func() bool { return queryInt(t, db, "SELECT count(*) FROM github") == 6 })

	type page struct {
		Deliveries []DeliveryRow `json:"deliveries"`
		Next       string        `json:"next"`
	}
	seen := map[string]int{}
	next := "/api/v1/deliveries?event=issues&limit=2"
	pages := 0
	for ; next != "" && pages < 10; pages++ {
		code, body := apiGet(t, d.URL, next, operatorToken)
		var p page
		if err := json.Unmarshal(body, &p); code != http.StatusOK || err != nil {
			t.Fatalf("%s: %d %s", next, code, body)
		}
		for _, r := range p.Deliveries {
			if r.Event != "issues" || r.Action != "opened" || r.Outcome != "stored" || r.Hook != testHookID || r.ReceivedAt.IsZero() {
				t.Errorf("row %+v: want a stored issues.opened of hook %d", r, testHookID)
			}
			seen[r.GUID]++
		}
		postWebhook(t, d.URL, "issues", "late-"+newGUID(), loadFixture(t, "issues", "opened"))
		next = p.Next
	}
	if pages != 3 || len(seen) != 5 {
		t.Errorf("%d pages, %d issues: want 3 pages of 2, 2 and 1, every issue once: %v", pages, len(seen), seen)
	}
	for _, g := range issues {
		if seen[g] != 1 {
			t.Errorf("issue %s listed %d times, want once", g, seen[g])
		}
	}
	if code, body := apiGet(t, d.URL, "/api/v1/deliveries?guid="+issues[2][:12], operatorToken); code != http.StatusOK ||
		!strings.Contains(string(body), issues[2]) || strings.Contains(string(body), issues[1]) {
		t.Errorf("?guid=: %d %s", code, body)
	}
	if code, body := apiGet(t, d.URL, "/api/v1/deliveries?outcome=lost", operatorToken); code != http.StatusBadRequest ||
		!strings.Contains(string(body), "outcome:") {
		t.Errorf("?outcome=lost: %d %s, want 400 naming outcome", code, body)
	}

	// The story, as Store.Story tells it.
	code, body := apiGet(t, d.URL, "/api/v1/deliveries/"+issues[0], operatorToken)
	if code != http.StatusOK {
		t.Fatalf("story: %d %s", code, body)
	}
	st, err := d.store.Story(context.Background(), issues[0])
	if err != nil {
		t.Fatal(err)
	}
	want, _ := json.Marshal(st)
	var got, wantV any
	_ = json.Unmarshal(body, &got)
	_ = json.Unmarshal(want, &wantV)
	if fmt.Sprint(got) != fmt.Sprint(wantV) {
		t.Errorf("story JSON:\n got %s\nwant %s", body, want)
	}
	if !strings.Contains(string(body), `"event":"issues"`) || !strings.Contains(string(body), `"worker":"database-service"`) {
		t.Errorf("story JSON lacks the receipt or the worker's record: %s", body)
	}
	if code, _ := apiGet(t, d.URL, fmt.Sprintf("/api/v1/deliveries/%s?hook=%d", issues[0], testHookID), operatorToken); code != http.StatusOK {
		t.Errorf("?hook= its hook: %d, want 200", code)
	}
	if code, body := apiGet(t, d.URL, "/api/v1/deliveries/"+issues[0]+"?hook=99", operatorToken); code != http.StatusNotFound {
		t.Errorf("?hook= another hook: %d %s, want 404", code, body)
	}
	if code, body := apiGet(t, d.URL, "/api/v1/deliveries/no-such-delivery", operatorToken); code != http.StatusNotFound ||
		!strings.Contains(string(body), "no delivery with this GUID") {
		t.Errorf("unknown GUID: %d %s, want 404", code, body)
	}

	// The operator's token only.
	for _, path := range []string{"/api/v1/deliveries", "/api/v1/deliveries/" + issues[0]} {
		if code, _ := apiGet(t, d.URL, path, ""); code != http.StatusUnauthorized {
			t.Errorf("%s without a token: %d, want 401", path, code)
		}
		if code, _ := apiGet(t, d.URL, path, "producer-token-for-tests"); code != http.StatusForbidden {
			t.Errorf("%s with the producer's token: %d, want 403", path, code)
		}
	}
}

// A webhook refused with 401, 400 or 413 is kept: `deliveries show GUID`,
// the deliveries search with outcome=rejected (page and JSON) and the
// story name it, its status and reason, with no trace of its body or its
// signature anywhere in the table.
func TestRejectedWebhooksKept(t *testing.T) {
	t.Parallel()
	onBothStores(t, testRejectedWebhooksKept)
}

func testRejectedWebhooksKept(t *testing.T) {
	d := startDaemon(t, testConfig(t, amqpURL(newVhost(t))))
	db := openStoreDB(t, d.cfg.Database)
	const marker = "BODY-MARKER-never-stored"
	body := []byte(`{"action":"opened","zen":"` + marker + `"}`)

	unsigned := newGUID()
	r := webhookRequest(t, d.URL, "issues", unsigned, body)
	forged := sign("a-guessed-secret", body)
	r.Header.Set("X-Hub-Signature-256", forged)
	if code, _ := do(t, r); code != http.StatusUnauthorized {
		t.Fatalf("forged signature: %d, want 401", code)
	}
	badHeader := newGUID()
	r = webhookRequest(t, d.URL, "Issues!", badHeader, body)
	if code, _ := do(t, r); code != http.StatusBadRequest {
		t.Fatalf("bad event header: %d, want 400", code)
	}
	tooLarge := newGUID()
	r = webhookRequest(t, d.URL, "issues", tooLarge, body)
	r.ContentLength = maxWebhookBody + 1
	r.Body = io.NopCloser(io.MultiReader(bytes.NewReader(body), strings.NewReader(strings.Repeat(" ", maxWebhookBody+1-len(body)))))
	if code, _ := do(t, r); code != http.StatusRequestEntityTooLarge {
		t.Fatalf("too large: %d, want 413", code)
	}
	eventually(t, 20*time.Second, "the refusals recorded", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM rejected_webhooks") == 3
	})

	// deliveries show: a story of refusals only.
	cfgPath := writeConfigFor(t, d.cfg)
	var out bytes.Buffer
	if err := run(context.Background(), []string{"deliveries", "-config", cfgPath, "show", unsigned}, &out, &out); err != nil {
		t.Fatalf("deliveries show: %v\n%s", err, out.String())
	}
	said := strings.Join(strings.Fields(out.String()), " ")
	if !strings.Contains(said, "rejected") || !strings.Contains(said, " 401 from 127.0.0.1, hook 123456, issues: ") ||
		!strings.Contains(said, "stored not in github") {
		t.Errorf("deliveries show of a 401:\n%s", out.String())
	}

	// The search: the page and the JSON.
	req, _ := http.NewRequest(http.MethodGet, d.URL+"/status/deliveries?outcome=rejected", nil)
	req.SetBasicAuth("operator", operatorToken)
	code, page := do(t, req)
	for _, g := range []string{unsigned, badHeader, tooLarge} {
		if code != http.StatusOK || !strings.Contains(page, g) {
			t.Errorf("outcome=rejected page lacks %s: %d", g, code)
		}
	}
	if !strings.Contains(page, "rejected 401 from 127.0.0.1") || !strings.Contains(page, "rejected 413") {
		t.Errorf("outcome=rejected page does not tell the statuses:\n%.3000s", page)
	}
	code, js := apiGet(t, d.URL, "/api/v1/deliveries?outcome=rejected&guid="+unsigned, operatorToken)
	var p struct{ Deliveries []DeliveryRow }
	if err := json.Unmarshal(js, &p); code != http.StatusOK || err != nil || len(p.Deliveries) != 1 ||
		p.Deliveries[0].Status != http.StatusUnauthorized || p.Deliveries[0].Outcome != "rejected" || p.Deliveries[0].Event != "issues" {
		t.Errorf("JSON search of the 401: %d %s", code, js)
	}
	code, js = apiGet(t, d.URL, "/api/v1/deliveries?outcome=rejected&guid="+badHeader, operatorToken)
	if code != http.StatusOK || !strings.Contains(string(js), `"status":400`) || !strings.Contains(string(js), "X-GitHub-Event") ||
		strings.Contains(string(js), `"event":"Issues!"`) {
		t.Errorf("JSON search of the 400: %d %s (the bad event name not kept as an event)", code, js)
	}
	if code, js := apiGet(t, d.URL, "/api/v1/deliveries?outcome=rejected&sender=mona", operatorToken); code != http.StatusBadRequest {
		t.Errorf("outcome=rejected&sender=: %d %s, want 400", code, js)
	}
	code, js = apiGet(t, d.URL, "/api/v1/deliveries/"+tooLarge, operatorToken)
	if code != http.StatusOK || !strings.Contains(string(js), `"status":413`) {
		t.Errorf("story of the 413: %d %s", code, js)
	}

	// No trace of a body or a signature.
	rows, err := db.Query("SELECT * FROM rejected_webhooks")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	cols, _ := rows.Columns()
	for rows.Next() {
		vals := scanAny(t, rows, len(cols))
		text := fmt.Sprint(vals...)
		if strings.Contains(text, marker) || strings.Contains(text, strings.TrimPrefix(forged, "sha256=")[:16]) || strings.Contains(text, "zen") {
			t.Errorf("a refused webhook's row holds its body or signature: %v", vals)
		}
	}
}

// writeConfigFor writes cfg's database and brokers into a config file
// the commands read.
func writeConfigFor(t *testing.T, cfg *Config) string {
	t.Helper()
	database := fmt.Sprintf("path = %q", cfg.Database.Path)
	if cfg.Database.Driver == "postgres" {
		database = fmt.Sprintf("driver = \"postgres\"\nurl = %q", cfg.Database.URL)
	}
	var urls []string
	for _, b := range cfg.Brokers {
		urls = append(urls, b.URL)
	}
	return writeConfigWith(t, t.TempDir(), "127.0.0.1:1", database, "", urls...)
}

// A flood of 10,000 refused requests costs at most 100 rows and one
// transaction a second: every refusal counted, those over the rate not
// written, and said so.
func TestRejectionFloodBounded(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, amqpURL(newVhost(t)))
	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	before := scrape(t, d.URL+"/metrics")
	body := []byte(`{"zen":"flood"}`)
	const n, clients = 10000, 32
	var sent atomic.Int64
	var wg sync.WaitGroup
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	start := time.Now()
	for range clients {
		wg.Go(func() {
			for sent.Add(1) <= n {
				req, _ := http.NewRequest(http.MethodPost, d.URL+"/webhooks/github", bytes.NewReader(body))
				req.Header.Set("X-GitHub-Event", "issues")
				req.Header.Set("X-GitHub-Delivery", "flood")
				req.Header.Set("X-Hub-Signature-256", "sha256=00")
				resp, err := client.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	seconds := time.Since(start).Seconds()
	// Every refusal is counted, and either written or counted as not.
	unrecorded := func() float64 {
		return scrape(t, d.URL+"/metrics")["switchyard_webhook_rejections_unrecorded_total"]
	}
	eventually(t, 20*time.Second, "every refusal written or counted as not", func() bool {
		return float64(queryInt(t, db, "SELECT count(*) FROM rejected_webhooks"))+unrecorded() == n
	})
	after := scrape(t, d.URL+"/metrics")
	if got := after[`switchyard_webhooks_received_total{outcome="unauthorized"}`] - before[`switchyard_webhooks_received_total{outcome="unauthorized"}`]; got != n {
		t.Errorf("unauthorized counted %v, want %d", got, n)
	}
	rows := queryInt(t, db, "SELECT count(*) FROM rejected_webhooks")
	// One flush a second, and one at the start and the end of the flood.
	if bound := rejectsPerFlush * (int(math.Ceil(seconds)) + 2); rows > bound {
		t.Errorf("%d refusals in %.1f s wrote %d rows, over %d", n, seconds, rows, bound)
	}
	t.Logf("%d refusals in %.1f s: %d rows written, %v counted only", n, seconds, rows, unrecorded())
	if !strings.Contains(d.logs.String(), "refused webhooks over the recorded rate: counted, not recorded") {
		t.Error("the refusals counted but not recorded are not logged")
	}

	// RejectLog alone: 10,000 noted at once are one transaction of 100 rows.
	m := NewMetrics(MetricLabels{})
	store, err := OpenStore(context.Background(), cfg.Database, m)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	l := NewRejectLog(store, m, slog.New(slog.DiscardHandler))
	for range n {
		l.Note(Rejection{At: time.Now(), Hook: -1, Status: 401, Reason: "flood"})
	}
	rowsBefore := queryInt(t, db, "SELECT count(*) FROM rejected_webhooks")
	l.flush(context.Background(), false)
	if got := queryInt(t, db, "SELECT count(*) FROM rejected_webhooks") - rowsBefore; got != rejectsPerFlush {
		t.Errorf("a flush of 10,000 noted wrote %d rows, want %d", got, rejectsPerFlush)
	}
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if !strings.Contains(rec.Body.String(), "switchyard_database_write_seconds_count 1\n") ||
		!strings.Contains(rec.Body.String(), "switchyard_webhook_rejections_unrecorded_total 9900\n") {
		t.Errorf("a flush of 10,000 noted: want one transaction and 9,900 counted only:\n%s", rec.Body.String())
	}
}

// The refused webhooks kept are the newest 10,000 of the last 7 days.
func TestRejectionsPruned(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		cfg := testConfig(t, amqpURL("unused"))
		p := newParts(t, cfg)
		ctx := context.Background()
		now := time.Now()
		var rs []Rejection
		for i := range 3 {
			rs = append(rs, Rejection{At: now.Add(-8*24*time.Hour + time.Duration(i)*time.Second), Hook: -1, Status: 401, Reason: "old"})
		}
		for i := range rejectionsKept + 50 {
			rs = append(rs, Rejection{At: now.Add(time.Duration(i) * time.Millisecond), GUID: fmt.Sprint("r-", i), Hook: -1, Status: 401, Reason: "new"})
		}
		err := p.store.WriteTx(ctx, func(tx *Tx) error { return tx.RecordRejections(ctx, rs) })
		if err != nil {
			t.Fatal(err)
		}
		if err := p.store.WriteTx(ctx, func(tx *Tx) error { return tx.PruneRejections(ctx, now) }); err != nil {
			t.Fatal(err)
		}
		db := openStoreDB(t, cfg.Database)
		if n := queryInt(t, db, "SELECT count(*) FROM rejected_webhooks"); n != rejectionsKept {
			t.Errorf("%d kept, want %d", n, rejectionsKept)
		}
		if n := queryInt(t, db, "SELECT count(*) FROM rejected_webhooks WHERE reason = 'old' OR delivery_id IN ('r-0', 'r-49')"); n != 0 {
			t.Errorf("%d of the old and the oldest kept, want none", n)
		}
		if n := queryInt(t, db, "SELECT count(*) FROM rejected_webhooks WHERE delivery_id IN ('r-50', 'r-10049')"); n != 2 {
			t.Errorf("%d of the newest 10,000's first and last kept, want 2", n)
		}
	})
}

// A refusal noted just before shutdown is recorded: a flush that begins as
// the daemon's context ends (a tick ready beside it) still writes.
func TestRejectionsFlushedAtShutdown(t *testing.T) {
	t.Parallel()
	onBothStores(t, testRejectionsFlushedAtShutdown)
}

func testRejectionsFlushedAtShutdown(t *testing.T) {
	cfg := testConfig(t, amqpURL("unused"))
	p := newParts(t, cfg)
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	const n = 20
	for i := range n {
		l := NewRejectLog(p.store, nil, p.log)
		l.every = time.Nanosecond // a tick ready beside the context's end
		l.Note(Rejection{At: time.Now(), GUID: fmt.Sprint("shutdown-", i), Hook: -1, Status: 401, Reason: "signature"})
		if err := l.Run(ended); err != nil {
			t.Fatal(err)
		}
	}
	if got := queryInt(t, openStoreDB(t, cfg.Database), "SELECT count(*) FROM rejected_webhooks"); got != n {
		t.Errorf("%d of %d refusals recorded", got, n)
	}
}
