package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Every real fixture, POSTed signed, becomes one github row with the right
// columns, and the 6-hour statistics add up to the deliveries.
func TestWebhookFixturesEndToEnd(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)

	type want struct{ event, action, repo, sender string }
	wants := map[string]want{}
	for _, f := range loadFixtures(t) {
		var p struct {
			Action     string `json:"action"`
			Repository *struct {
				FullName string `json:"full_name"`
			} `json:"repository"`
			Sender *struct {
				Login string `json:"login"`
			} `json:"sender"`
		}
		if err := json.Unmarshal(f.Body, &p); err != nil {
			t.Fatalf("%s/%s: %v", f.Event, f.Name, err)
		}
		w := want{event: f.Event, action: p.Action}
		if p.Repository != nil {
			w.repo = p.Repository.FullName
		}
		if p.Sender != nil {
			w.sender = p.Sender.Login
		}
		guid := newGUID()
		wants[guid] = w
		if code := postWebhook(t, d.URL, f.Event, guid, f.Body); code != http.StatusAccepted {
			t.Fatalf("%s/%s: got status %d, want 202", f.Event, f.Name, code)
		}
	}

	db := openStoreDB(t, cfg.Database)
	eventually(t, 60*time.Second, "every fixture stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") == len(wants)
	})
	rows, err := db.Query("SELECT delivery_id, event, action, repository, sender, forbidden, hook_id, target_type, target_id FROM github")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var guid, event, action, repo, sender, targetType string
		var forbidden, hookID, targetID int
		if err := rows.Scan(&guid, &event, &action, &repo, &sender, &forbidden, &hookID, &targetType, &targetID); err != nil {
			t.Fatal(err)
		}
		w, ok := wants[guid]
		if !ok {
			t.Errorf("row with unknown delivery %s", guid)
			continue
		}
		got := want{event, action, repo, sender}
		if got != w {
			t.Errorf("delivery %s: got %+v, want %+v", guid, got, w)
		}
		if forbidden != 0 || hookID != 123456 || targetType != "repository" || targetID != 35129377 {
			t.Errorf("delivery %s: got forbidden=%d hook_id=%d target=%s/%d", guid, forbidden, hookID, targetType, targetID)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	// The statistics count every delivery once, in its bucket.
	if got := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h"); got != len(wants) {
		t.Errorf("statistics sum: got %d, want %d", got, len(wants))
	}
	perBucket, err := db.Query(`SELECT s.bucket, s.event, s.action, s.count,
		(SELECT count(*) FROM github g WHERE g.event = s.event AND g.action = s.action) FROM github_statistics_6h s`)
	if err != nil {
		t.Fatal(err)
	}
	defer perBucket.Close()
	for perBucket.Next() {
		var bucket, event, action string
		var count, rowsFor int
		if err := perBucket.Scan(&bucket, &event, &action, &count, &rowsFor); err != nil {
			t.Fatal(err)
		}
		if bucket != statisticsBucket(time.Now()) && bucket != statisticsBucket(time.Now().Add(-time.Hour)) {
			t.Errorf("bucket %s is not the current 6-hour bucket", bucket)
		}
		if count != rowsFor {
			t.Errorf("bucket %s %s.%s: got count %d, want %d rows", bucket, event, action, count, rowsFor)
		}
	}

	// The same publish reached github-database through the fanout exchange.
	eventually(t, 30*time.Second, "database-service saw every delivery", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE worker = 'database-service'") == len(wants)
	})
}

// The same delivery GUID twice: one row, one count.
func TestWebhookDuplicateDelivery(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	guid := newGUID()
	for i := 0; i < 2; i++ {
		if code := postWebhook(t, d.URL, "issues", guid, body); code != http.StatusAccepted {
			t.Fatalf("post %d: got %d, want 202", i, code)
		}
	}
	other := newGUID()
	if code := postWebhook(t, d.URL, "issues", other, body); code != http.StatusAccepted {
		t.Fatalf("got %d, want 202", code)
	}
	db := openStoreDB(t, cfg.Database)
	// The third, distinct delivery is stored after both copies were handled.
	eventually(t, 20*time.Second, "the distinct delivery stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", other) == 1
	})
	eventually(t, 20*time.Second, "github queue empty", func() bool { return ready(t, vhost, queueGitHub) == 0 })
	if got := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid); got != 1 {
		t.Errorf("rows for the repeated delivery: got %d, want 1", got)
	}
	if got := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h WHERE event = 'issues' AND action = 'opened'"); got != 2 {
		t.Errorf("issues.opened count: got %d, want 2 (one per distinct delivery)", got)
	}
}

// Bad requests get a clear 4xx and publish nothing.
func TestWebhookRejectsBadRequests(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	// Keep the workers off the queues for a long window so that anything
	// published would still be there to count.
	d := startDaemon(t, cfg)
	body := loadFixture(t, "push", "branch")
	huge := append(append([]byte(`{"padding":"`), bytes.Repeat([]byte("a"), maxWebhookBody)...), []byte(`"}`)...)

	tests := []struct {
		name   string
		req    func() *http.Request
		status int
		want   string // in the error, where it says more than the status
	}{
		{"wrong signature", func() *http.Request {
			r := webhookRequest(t, d.URL, "push", newGUID(), body)
			r.Header.Set("X-Hub-Signature-256", sign("another-secret", body))
			return r
		}, 401, "invalid X-Hub-Signature-256"},
		{"missing signature", func() *http.Request {
			r := webhookRequest(t, d.URL, "push", newGUID(), body)
			r.Header.Del("X-Hub-Signature-256")
			return r
		}, 401, "missing X-Hub-Signature-256"},
		{"sha1 signature only", func() *http.Request {
			r := webhookRequest(t, d.URL, "push", newGUID(), body)
			r.Header.Set("X-Hub-Signature-256", strings.Replace(sign(testSecret, body), "sha256=", "sha1=", 1))
			return r
		}, 401, "invalid X-Hub-Signature-256"},
		{"missing event header", func() *http.Request {
			r := webhookRequest(t, d.URL, "push", newGUID(), body)
			r.Header.Del("X-GitHub-Event")
			return r
		}, 400, ""},
		{"missing delivery header", func() *http.Request {
			r := webhookRequest(t, d.URL, "push", newGUID(), body)
			r.Header.Del("X-GitHub-Delivery")
			return r
		}, 400, ""},
		{"over 25 MiB", func() *http.Request { return webhookRequest(t, d.URL, "push", newGUID(), huge) }, 413, ""},
		{"not JSON", func() *http.Request {
			return webhookRequest(t, d.URL, "push", newGUID(), []byte("this is not json"))
		}, 400, ""},
		{"JSON but not an object", func() *http.Request { return webhookRequest(t, d.URL, "push", newGUID(), []byte(`[1,2]`)) }, 400, ""},
		{"form without payload", func() *http.Request {
			b := []byte("other=1")
			r := webhookRequest(t, d.URL, "push", newGUID(), b)
			r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			return r
		}, 400, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, body := do(t, tt.req())
			if code != tt.status {
				t.Fatalf("got %d %s, want %d", code, body, tt.status)
			}
			var e struct{ Error string }
			if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error == "" {
				t.Errorf("body %q: want {\"error\": ...}", body)
			}
			if !strings.Contains(e.Error, tt.want) {
				t.Errorf("error %q, want it to say %q", e.Error, tt.want)
			}
		})
	}

	// Each kind of rejection is logged at warn with its reason and source, at
	// most once per 10 s: three 401s above make one line.
	logs := d.logs.String()
	for _, outcome := range []string{"unauthorized", "bad_request", "too_large"} {
		var lines []string
		for _, l := range strings.Split(logs, "\n") {
			if strings.Contains(l, `msg="webhook rejected"`) && strings.Contains(l, "outcome="+outcome+" ") {
				lines = append(lines, l)
			}
		}
		if len(lines) != 1 {
			t.Errorf("%s: %d log lines, want 1:\n%s", outcome, len(lines), strings.Join(lines, "\n"))
			continue
		}
		if !strings.Contains(lines[0], "level=WARN") || !strings.Contains(lines[0], "source_ip=127.0.0.1") || !strings.Contains(lines[0], "error=") {
			t.Errorf("%s line lacks level, source or reason: %s", outcome, lines[0])
		}
	}

	// A good form-encoded delivery goes through, so the endpoint is not just
	// refusing everything; it is then the only message anywhere.
	form := []byte("payload=" + url.QueryEscape(string(body)))
	r := webhookRequest(t, d.URL, "push", "good-form-delivery", form)
	r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if code, b := do(t, r); code != http.StatusAccepted {
		t.Fatalf("form delivery: got %d %s, want 202", code, b)
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "form delivery stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") >= 1
	})
	if got := queryInt(t, db, "SELECT count(*) FROM github"); got != 1 {
		t.Errorf("github rows: got %d, want only the good delivery", got)
	}
	if payload := storedPayload(t, d.store, "good-form-delivery"); payload != string(body) {
		t.Errorf("form payload not stored byte for byte: %q", payload)
	}
	d.stop(t)
	for _, q := range allQueues() {
		if n := ready(t, vhost, q); n != 0 {
			t.Errorf("queue %s: %d messages, want 0", q, n)
		}
	}
}

// A request from outside the allow list, through a trusted proxy, ends in
// github-forbidden: stored by cleanup with forbidden = 1, never seen by
// database-service.
func TestWebhookForbiddenSource(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Server.TrustedProxies = []string{"127.0.0.1"}
	cfg.GitHub.AllowedCIDRs = []string{"140.82.112.0/20"}
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")

	allowed, forbidden := newGUID(), newGUID()
	r := webhookRequest(t, d.URL, "issues", allowed, body)
	r.Header.Set("X-Forwarded-For", "203.0.113.9, 140.82.115.4")
	if code, b := do(t, r); code != http.StatusAccepted || strings.Contains(b, `"queue"`) {
		t.Fatalf("allowed: got %d %s, want 202 without a queue", code, b)
	}
	r = webhookRequest(t, d.URL, "issues", forbidden, body)
	r.Header.Set("X-Forwarded-For", "140.82.115.4, 203.0.113.9")
	code, b := do(t, r)
	if code != http.StatusAccepted {
		t.Fatalf("forbidden: got %d %s", code, b)
	}
	// The answer says where it went, so a webhook sent by hand does not
	// seem to vanish until the cleanup worker's next window.
	var q struct{ Status, Queue string }
	if err := json.Unmarshal([]byte(b), &q); err != nil || q.Status != "queued" || q.Queue != queueForbidden {
		t.Errorf("forbidden: got %s, want status queued and queue %s", b, queueForbidden)
	}

	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "both stored", func() bool { return queryInt(t, db, "SELECT count(*) FROM github") == 2 })
	eventually(t, 20*time.Second, "database-service saw the allowed one", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = $1", allowed) == 1
	})
	var ip string
	var flag int
	if err := db.QueryRow("SELECT source_ip, forbidden FROM github WHERE delivery_id = $1", forbidden).Scan(&ip, &flag); err != nil {
		t.Fatal(err)
	}
	if ip != "203.0.113.9" || flag != 1 {
		t.Errorf("forbidden row: got source_ip=%s forbidden=%d, want 203.0.113.9 and 1", ip, flag)
	}
	if err := db.QueryRow("SELECT source_ip, forbidden FROM github WHERE delivery_id = $1", allowed).Scan(&ip, &flag); err != nil {
		t.Fatal(err)
	}
	if ip != "140.82.115.4" || flag != 0 {
		t.Errorf("allowed row: got source_ip=%s forbidden=%d, want 140.82.115.4 and 0", ip, flag)
	}
	d.stop(t)
	if got := queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = $1", forbidden); got != 0 {
		t.Errorf("database-service processed the forbidden delivery")
	}
}

// No reachable broker, or a broker that stops confirming: 503 with
// Retry-After within publish_timeout, and nothing stored.
func TestWebhookBrokerUnavailable(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full, each webhook published at the door (outbox_test.go has the outbox)
	cfg.Queue.PublishTimeout = time.Second
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")

	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("with the broker up: got %d, want 202", code)
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "first delivery stored", func() bool { return queryInt(t, db, "SELECT count(*) FROM github") == 1 })

	for _, tt := range []struct {
		name  string
		cause func()
	}{
		{"not confirming", func() { proxy.Stall(true) }},
		{"unreachable", func() { proxy.Close() }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tt.cause()
			resp := answerWhileStalled(t, d.URL, body)
			if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
				t.Errorf("got %d Retry-After=%q, want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
			}
		})
	}
	if got := queryInt(t, db, "SELECT count(*) FROM github"); got != 1 {
		t.Errorf("rows: got %d, want only the first delivery", got)
	}

	// /readyz names what is wrong; /healthz still answers.
	code, answer := do(t, mustRequest(t, http.MethodGet, d.URL+"/readyz"))
	if code != http.StatusServiceUnavailable || !strings.Contains(answer, `"broker"`) || strings.Contains(answer, `"database"`) {
		t.Errorf("/readyz with the broker down: got %d %s", code, answer)
	}
	if code, body := do(t, mustRequest(t, http.MethodGet, d.URL+"/healthz")); code != http.StatusOK {
		t.Errorf("/healthz: got %d %s", code, body)
	}
	// As curl -sI asks: HEAD answers as GET does, without a body.
	for path, want := range map[string]int{"/healthz": http.StatusOK, "/readyz": http.StatusServiceUnavailable} {
		if code, body := do(t, mustRequest(t, http.MethodHead, d.URL+path)); code != want || body != "" {
			t.Errorf("HEAD %s: got %d %q, want %d without a body", path, code, body, want)
		}
	}
	proxy.Reopen()
	eventually(t, 20*time.Second, "/readyz back to 200", func() bool {
		code, _ := do(t, mustRequest(t, http.MethodGet, d.URL+"/readyz"))
		return code == http.StatusOK
	})
	// And the webhook with it, on a fresh connection after the backoff.
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Errorf("after the broker came back: got %d, want 202", code)
	}
}

func mustRequest(t testing.TB, method, url string) *http.Request {
	t.Helper()
	r, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestVerifySignature(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, amqpURL("x"))
	cfg.GitHub.PreviousWebhookSecrets = []string{"old-secret"}
	wh, err := NewWebhook(cfg, nil, nil, nil, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	body := []byte(`{"zen":"Keep it logically awesome."}`)
	tests := []struct {
		name, header string
		want         bool
	}{
		{"current secret", sign(testSecret, body), true},
		{"previous secret", sign("old-secret", body), true},
		{"unknown secret", sign("nope", body), false},
		{"empty", "", false},
		{"no prefix", strings.TrimPrefix(sign(testSecret, body), "sha256="), false},
		{"not hex", "sha256=zz", false},
		{"truncated", sign(testSecret, body)[:20], false},
		{"other body", sign(testSecret, []byte(`{}`)), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := validSignature(wh.auth.Load().secrets, body, tt.header); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

// A hook listed in [[github.hooks]] is verified with its own secrets
// only (current and previous); every other hook, none, or a malformed ID,
// with github.webhook_secret and its previous ones.
func TestHookSecrets(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, amqpURL("x"))
	cfg.GitHub.PreviousWebhookSecrets = []string{"old-secret"}
	cfg.GitHub.Hooks = []HookConfig{{ID: 111, Secret: "hook-111-secret", PreviousSecrets: []string{"hook-111-old"}},
		{ID: 222, Secret: "hook-222-secret"}}
	wh, err := NewWebhook(cfg, nil, nil, nil, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	body := []byte(`{"zen":"Practicality beats purity."}`)
	tests := []struct {
		hook, secret string
		want         bool
	}{
		{"111", "hook-111-secret", true},
		{"111", "hook-111-old", true},
		{"111", testSecret, false},
		{"111", "old-secret", false},
		{"111", "hook-222-secret", false},
		{"222", "hook-222-secret", true},
		{"222", "hook-111-secret", false},
		{"333", testSecret, true},
		{"333", "old-secret", true},
		{"333", "hook-111-secret", false},
		{"", testSecret, true},
		{"", "hook-111-secret", false},
		{"0111", "hook-111-secret", true}, // the same number
		{"11x", testSecret, true},         // malformed: refused later for the header
	}
	for _, tt := range tests {
		secrets, _ := wh.auth.Load().secretsOf(tt.hook)
		got := validSignature(secrets, body, sign(tt.secret, body))
		if got != tt.want {
			t.Errorf("hook %q signed with %q: got %v, want %v", tt.hook, tt.secret, got, tt.want)
		}
	}
}

func TestSourceIP(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, amqpURL("x"))
	cfg.Server.TrustedProxies = []string{"10.0.0.0/8", "127.0.0.1"}
	wh, err := NewWebhook(cfg, nil, nil, nil, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, peer string
		xff        []string
		want       string
	}{
		{"direct peer", "140.82.115.4:5555", nil, "140.82.115.4"},
		{"untrusted peer's XFF is ignored", "203.0.113.9:5555", []string{"140.82.115.4"}, "203.0.113.9"},
		{"trusted proxy", "127.0.0.1:5555", []string{"140.82.115.4"}, "140.82.115.4"},
		{"right-most untrusted hop", "127.0.0.1:5555", []string{"1.2.3.4, 140.82.115.4, 10.1.2.3"}, "140.82.115.4"},
		{"several headers", "127.0.0.1:5555", []string{"1.2.3.4", "140.82.115.5"}, "140.82.115.5"},
		{"garbled hop stops the walk", "127.0.0.1:5555", []string{"140.82.115.4, garbage, 10.0.0.1"}, "10.0.0.1"},
		{"IPv6 peer", "[2606:50c0::1]:443", nil, "2606:50c0::1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, _ := http.NewRequest(http.MethodPost, "/", nil)
			r.RemoteAddr = tt.peer
			for _, v := range tt.xff {
				r.Header.Add("X-Forwarded-For", v)
			}
			if got := wh.sourceIP(r).String(); got != tt.want {
				t.Errorf("got %s, want %s", got, tt.want)
			}
		})
	}
}

// On the broker's path (the outbox full), a message that would reach no
// queue (the queues were deleted on the broker, as CloudAMQP does with idle
// ones) is not answered 202.
func TestWebhookUnroutableIsNotAccepted(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	declareTestTopology(t, vhost, 200*time.Millisecond)
	ch := amqpChannel(t, vhost)
	for _, q := range []string{queueGitHub, queueDatabase} {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			t.Fatal(err)
		}
	}
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.DeclareTopology = false
	cfg.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full, each webhook published at the door
	d := startDaemon(t, cfg)
	if code := postWebhook(t, d.URL, "issues", newGUID(), loadFixture(t, "issues", "opened")); code != http.StatusServiceUnavailable {
		t.Errorf("got %d, want 503 for a message no queue takes", code)
	}
	if !strings.Contains(d.logs.String(), "routed to no queue") {
		t.Errorf("no log line says why")
	}
}

// One AMQP connection per broker, shared by the webhook endpoint and every
// worker (CloudAMQP's free plan allows 20).
func TestOneConnectionPerBroker(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	d := startDaemon(t, cfg)
	for i := 0; i < 5; i++ {
		if code := postWebhook(t, d.URL, "issues", newGUID(), loadFixture(t, "issues", "opened")); code != http.StatusAccepted {
			t.Fatalf("got %d", code)
		}
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "deliveries stored", func() bool { return queryInt(t, db, "SELECT count(*) FROM github") == 5 })
	// A few cycles run their leftover drains on b too.
	logged(t, d.logs, "leftover drain found nothing", 9)
	for _, v := range []string{a, b} {
		if n := len(brokerConnections(t, v)); n != 1 {
			t.Errorf("connections to %s: got %d, want 1", v, n)
		}
	}
}

// brokerConnections lists the AMQP connections open to vhost, by their
// broker-side process id: a connection closed and dialed again has a new one.
func brokerConnections(t testing.TB, vhost string) []string {
	t.Helper()
	var conns []struct{ Name, Vhost string }
	if managementGet(t, "/api/connections", &conns) {
		var names []string
		for _, c := range conns {
			if c.Vhost == vhost {
				names = append(names, c.Name)
			}
		}
		sort.Strings(names)
		return names
	}
	needRabbitmqctl(t)
	out, err := exec.Command("rabbitmqctl", "-q", "--no-table-headers", "list_connections", "vhost", "pid").CombinedOutput()
	if err != nil {
		t.Fatalf("list_connections: %v: %s", err, out)
	}
	var pids []string
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == vhost {
			pids = append(pids, f[1])
		}
	}
	sort.Strings(pids)
	return pids
}

// Headers copied into the message are checked before anything is
// published: each violation is a 400 naming the header, and none of them
// reaches (and closes) the AMQP connection every worker shares.
func TestWebhookHeaderLimits(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("first webhook: got %d, want 202", code)
	}
	before := brokerConnections(t, vhost)
	if len(before) != 1 {
		t.Fatalf("connections before: %v, want one", before)
	}

	long := strings.Repeat("a", 300)
	tests := []struct {
		name, header, value string
	}{
		{"delivery of 300 bytes", "X-GitHub-Delivery", long},
		{"delivery with a space", "X-GitHub-Delivery", "abc def"},
		{"delivery not ASCII", "X-GitHub-Delivery", "d\u00e9livery"},
		{"event of 300 bytes", "X-GitHub-Event", long},
		{"event of 65 bytes", "X-GitHub-Event", strings.Repeat("e", 65)},
		{"event with capitals", "X-GitHub-Event", "Issues"},
		{"hook id of 200 KiB", "X-GitHub-Hook-ID", strings.Repeat("1", 200<<10)},
		{"target type of 256 bytes", "X-GitHub-Hook-Installation-Target-Type", strings.Repeat("r", 256)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := webhookRequest(t, d.URL, "issues", newGUID(), body)
			r.Header.Set(tt.header, tt.value)
			code, answer := do(t, r)
			if code != http.StatusBadRequest {
				t.Fatalf("got %d %s, want 400", code, answer)
			}
			if !strings.Contains(answer, tt.header) {
				t.Errorf("answer %s does not name %s", answer, tt.header)
			}
		})
	}
	// The limits are inclusive: 255 and 64 bytes still pass.
	r := webhookRequest(t, d.URL, "issues", strings.Repeat("g", 255), body)
	r.Header.Set("X-GitHub-Event", strings.Repeat("e", 64))
	if code, answer := do(t, r); code != http.StatusAccepted {
		t.Fatalf("headers at their limits: got %d %s, want 202", code, answer)
	}
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("webhook after the bad ones: got %d, want 202", code)
	}
	if after := brokerConnections(t, vhost); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Errorf("AMQP connections: before %v, after %v; a request closed the shared connection", before, after)
	}
}

// rss reads a process's resident set size and its peak (VmRSS, VmHWM) in
// bytes from /proc.
func rss(t testing.TB, pid int) (now, peak int64) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || f[2] != "kB" {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "VmRSS:":
			now = n << 10
		case "VmHWM:":
			peak = n << 10
		}
	}
	return now, peak
}

// zeros is an endless body that costs the sender no memory.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// Hostile bodies cannot make the daemon hold more than max_inflight_bytes:
// 16 requests that claim 25 MiB and send one byte, and 8 that send 25 MiB
// with a bad signature, at once. Meanwhile every ordinary signed webhook
// gets 202, and the daemon's peak RSS grows by at most the budget + 32 MiB.
func TestWebhookHostileBodiesBounded(t *testing.T) {
	t.Parallel()
	config, addr, _ := processSetup(t)
	cmd, _ := startProcess(t, config, addr)
	base := "http://" + addr
	body := loadFixture(t, "issues", "opened")
	for i := 0; i < 20; i++ { // warm up: pools, lanes, connections
		if code := postWebhook(t, base, "issues", newGUID(), body); code != http.StatusAccepted {
			t.Fatalf("warm-up webhook: got %d", code)
		}
	}
	startRSS, _ := rss(t, cmd.Process.Pid)

	// 16 slow clients: a 25 MiB Content-Length and one byte, held open.
	var slow []net.Conn
	for i := 0; i < 16; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprintf(c, "POST /webhooks/github HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"+
			"X-GitHub-Event: push\r\nX-GitHub-Delivery: %s\r\nX-Hub-Signature-256: sha256=%064d\r\n"+
			"Content-Length: %d\r\n\r\n{", addr, newGUID(), 0, maxWebhookBody)
		slow = append(slow, c)
	}

	// 8 full 25 MiB bodies with a bad signature, at once.
	var wg sync.WaitGroup
	codes := make(chan int, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest(http.MethodPost, base+"/webhooks/github", io.LimitReader(zeros{}, maxWebhookBody))
			req.ContentLength = maxWebhookBody
			req.Header.Set("X-GitHub-Event", "push")
			req.Header.Set("X-GitHub-Delivery", newGUID())
			req.Header.Set("X-Hub-Signature-256", sign("not-the-secret", []byte("x")))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				codes <- 0 // the server answered early and closed: refused
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		}()
	}

	// Ordinary webhooks while all of that holds.
	for i := 0; i < 50; i++ {
		if code := postWebhook(t, base, "issues", newGUID(), body); code != http.StatusAccepted {
			t.Fatalf("ordinary webhook %d during the attack: got %d, want 202", i, code)
		}
	}
	wg.Wait()
	close(codes)
	for code := range codes {
		if code != 0 && code != http.StatusUnauthorized && code != http.StatusServiceUnavailable {
			t.Errorf("hostile 25 MiB body: got %d, want 401, 503 or a closed connection", code)
		}
	}
	_, peak := rss(t, cmd.Process.Pid)
	limit := int64(64<<20) + 32<<20
	t.Logf("RSS before %d MiB, peak %d MiB", startRSS>>20, peak>>20)
	if grew := peak - startRSS; grew > limit {
		t.Errorf("peak RSS grew by %d MiB, want at most max_inflight_bytes + 32 MiB = %d MiB", grew>>20, limit>>20)
	}
	for _, c := range slow {
		c.Close()
	}
}

// One line per key per period; the next one says how many were held back.
func TestLogLimiter(t *testing.T) {
	t.Parallel()
	l := newLogLimiter(10 * time.Second)
	t0 := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	steps := []struct {
		key        string
		at         time.Duration
		ok         bool
		suppressed int
	}{
		{"unauthorized", 0, true, 0},
		{"unauthorized", time.Second, false, 0},
		{"bad_request", 2 * time.Second, true, 0},
		{"unauthorized", 9 * time.Second, false, 0},
		{"unauthorized", 10 * time.Second, true, 2},
		{"unauthorized", 11 * time.Second, false, 0},
		{"unauthorized", time.Minute, true, 1},
	}
	for i, s := range steps {
		ok, n := l.allow(s.key, t0.Add(s.at))
		if ok != s.ok || n != s.suppressed {
			t.Errorf("step %d (%s at %s): got %t %d, want %t %d", i, s.key, s.at, ok, n, s.ok, s.suppressed)
		}
	}
}

// A webhook's 503 says what failed and names no host, port or vhost: on a
// hosted plan those are the account's user name (the log keeps them).
func TestUnavailableNamesNoBroker(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full, each webhook published at the door (outbox_test.go has the outbox)
	cfg.Queue.PublishTimeout = time.Second
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("before the cut: %d", code)
	}
	proxy.Close()
	var code int
	var answer string
	eventually(t, 30*time.Second, "a 503 once the broker is gone", func() bool {
		code, answer = do(t, webhookRequest(t, d.URL, "issues", newGUID(), body))
		return code == http.StatusServiceUnavailable
	})
	_, port, _ := net.SplitHostPort(proxy.addr)
	if !strings.Contains(answer, "broker unreachable") && !strings.Contains(answer, "no confirm") {
		t.Errorf("503 body %s, want it to say what failed", answer)
	}
	for _, where := range []string{vhost, port, "127.0.0.1"} {
		if strings.Contains(answer, where) {
			t.Errorf("503 body %s names %q", answer, where)
		}
	}
	if !strings.Contains(d.logs.String(), vhost) {
		t.Errorf("the log does not name the broker")
	}
}

// A wrong signature's 401 names the secret the hook should have: a
// listed hook's own, else github.webhook_secret. A refused webhook that
// named no hook reads "hook_id": null in the deliveries' JSON.
func TestWrongSignatureNamesTheSecret(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, amqpURL(newVhost(t)))
	cfg.GitHub.Hooks = []HookConfig{{ID: 111, Secret: "hook-111-secret"}}
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	listed := webhookRequest(t, d.URL, "issues", newGUID(), body)
	listed.Header.Set("X-GitHub-Hook-ID", "111")
	if code, answer := do(t, listed); code != http.StatusUnauthorized || !strings.Contains(answer, "hook 111") ||
		!strings.Contains(answer, "[[github.hooks]]") || strings.Contains(answer, "webhook_secret") {
		t.Errorf("a listed hook's wrong signature: %d %s, want 401 naming its secret in [[github.hooks]]", code, answer)
	}
	other := webhookRequest(t, d.URL, "issues", newGUID(), body)
	other.Header.Set("X-Hub-Signature-256", sign("not-the-secret", body))
	if code, answer := do(t, other); code != http.StatusUnauthorized || !strings.Contains(answer, "github.webhook_secret") {
		t.Errorf("another hook's wrong signature: %d %s, want 401 naming github.webhook_secret", code, answer)
	}
	guid := newGUID()
	none := webhookRequest(t, d.URL, "issues", guid, body)
	none.Header.Del("X-GitHub-Hook-ID")
	none.Header.Set("X-Hub-Signature-256", sign("not-the-secret", body))
	if code, _ := do(t, none); code != http.StatusUnauthorized {
		t.Fatalf("a webhook without a hook, wrongly signed: %d", code)
	}
	var story string
	eventually(t, 20*time.Second, "the refusal recorded", func() bool {
		_, story = do(t, mustRequestAuth(t, d.URL+"/api/v1/deliveries/"+guid))
		return strings.Contains(story, `"status":401`)
	})
	if !strings.Contains(story, `"hook_id":null`) || strings.Contains(story, `"hook_id":-1`) {
		t.Errorf("a refused webhook without a hook in its story: %s, want hook_id null", story)
	}
	_, list := do(t, mustRequestAuth(t, d.URL+"/api/v1/deliveries?outcome=rejected&guid="+guid))
	if !strings.Contains(list, guid) || !strings.Contains(list, `"hook_id":null`) || strings.Contains(list, `"hook_id":-1`) {
		t.Errorf("a refused webhook without a hook in the search: %s, want hook_id null", list)
	}
}
