package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"go.opentelemetry.io/otel/trace/noop"
)

const testAppID = 31337

// fakeGitHub serves the App's hook-delivery endpoints in the shapes of
// GitHub's REST API, and checks the App JWT on every request.
type fakeGitHub struct {
	t   testing.TB
	key *rsa.PrivateKey
	srv *httptest.Server

	mu         sync.Mutex
	deliveries []hookDelivery // newest first, as GitHub lists them
	payloads   map[int64][]byte
	listCalls  int
	pageCalls  int
	fetches    map[int64]int
	failNext   []int // statuses to answer the next detail fetches with
	always401  bool
	limitNext  []func(w http.ResponseWriter) // answers for the next list requests
	listTimes  []time.Time                   // when each list request came
	// redeliveries are the attempt ids POSTed to .../attempts, in order;
	// onRedeliver, when set, runs (in a goroutine of its own) for each, as
	// GitHub delivering the webhook again.
	redeliveries []int64
	onRedeliver  func(d hookDelivery)
	// hooks are repositories' and organizations' webhooks, by their
	// path (fakeHook); installationAsks and installationTokens count the
	// App's installation looked up and its tokens made.
	hooks                                map[string]*fakeHook
	installationAsks, installationTokens int
}

func newFakeGitHub(t testing.TB) *fakeGitHub {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	g := &fakeGitHub{t: t, key: key, payloads: map[int64][]byte{}, fetches: map[int64]int{}}
	g.srv = httptest.NewServer(http.HandlerFunc(g.serve))
	t.Cleanup(g.srv.Close)
	return g
}

// keyFile writes the App's private key as PEM, as GitHub hands it out.
func (g *fakeGitHub) keyFile(t testing.TB) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "app.pem")
	b := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(g.key)})
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// add records one delivery attempt; payload, when set, is what a detail
// fetch returns as the original request's body.
func (g *fakeGitHub) add(d hookDelivery, payload []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.deliveries = append([]hookDelivery{d}, g.deliveries...)
	if payload != nil {
		g.payloads[d.ID] = payload
	}
}

func (g *fakeGitHub) checkJWT(r *http.Request) bool {
	tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	claims := &jwt.RegisteredClaims{}
	parsed, err := jwt.ParseWithClaims(tok, claims, func(*jwt.Token) (any, error) { return &g.key.PublicKey, nil },
		jwt.WithValidMethods([]string{"RS256"}))
	if err != nil || !parsed.Valid || claims.Issuer != strconv.Itoa(testAppID) {
		return false
	}
	iat, exp := claims.IssuedAt.Time, claims.ExpiresAt.Time
	// GitHub: iat may be in the past against drift, exp at most 10 minutes after.
	return time.Since(iat) >= 50*time.Second && exp.Sub(iat) <= 10*time.Minute+time.Second
}

func (g *fakeGitHub) serve(w http.ResponseWriter, r *http.Request) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.serveHook(w, r) {
		return
	}
	if g.always401 || !g.checkJWT(r) {
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprint(w, `{"message":"A JSON web token could not be decoded","documentation_url":"https://docs.github.com/rest"}`)
		return
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	if g.serveInstallation(w, r) {
		return
	}
	if r.URL.Path == "/app/hook/deliveries" {
		g.listTimes = append(g.listTimes, time.Now())
		if len(g.limitNext) > 0 {
			answer := g.limitNext[0]
			g.limitNext = g.limitNext[1:]
			answer(w)
			return
		}
		g.pageCalls++
		if r.URL.Query().Get("cursor") == "" {
			g.listCalls++
		}
		start, _ := strconv.Atoi(strings.TrimPrefix(r.URL.Query().Get("cursor"), "v1_"))
		per, _ := strconv.Atoi(r.URL.Query().Get("per_page"))
		if per <= 0 || per > 100 {
			per = 30
		}
		end := min(start+per, len(g.deliveries))
		if end < len(g.deliveries) {
			w.Header().Set("Link", fmt.Sprintf(`<%s/app/hook/deliveries?per_page=%d&cursor=v1_%d>; rel="next"`, g.srv.URL, per, end))
		}
		_ = json.NewEncoder(w).Encode(g.deliveries[start:end])
		return
	}
	idText, ok := strings.CutPrefix(r.URL.Path, "/app/hook/deliveries/")
	if attempt, isAttempt := strings.CutSuffix(idText, "/attempts"); isAttempt && r.Method == http.MethodPost {
		if len(g.failNext) > 0 {
			status := g.failNext[0]
			g.failNext = g.failNext[1:]
			w.WriteHeader(status)
			fmt.Fprint(w, `{"message":"Server Error"}`)
			return
		}
		id, _ := strconv.ParseInt(attempt, 10, 64)
		for _, d := range g.deliveries {
			if d.ID == id {
				g.redeliveries = append(g.redeliveries, id)
				if g.onRedeliver != nil {
					go g.onRedeliver(d)
				}
				w.WriteHeader(http.StatusAccepted)
				fmt.Fprint(w, `{}`)
				return
			}
		}
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"message":"Not Found"}`)
		return
	}
	id, err := strconv.ParseInt(idText, 10, 64)
	if !ok || err != nil {
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"message":"Not Found"}`)
		return
	}
	g.fetches[id]++
	if len(g.failNext) > 0 {
		status := g.failNext[0]
		g.failNext = g.failNext[1:]
		if status == http.StatusForbidden {
			w.Header().Set("X-RateLimit-Remaining", "0")
			w.WriteHeader(status)
			fmt.Fprint(w, `{"message":"API rate limit exceeded for installation."}`)
			return
		}
		w.WriteHeader(status)
		fmt.Fprint(w, `{"message":"Server Error"}`)
		return
	}
	for _, d := range g.deliveries {
		if d.ID != id {
			continue
		}
		payload := g.payloads[id]
		detail := map[string]any{
			"id": d.ID, "guid": d.GUID, "delivered_at": d.DeliveredAt, "redelivery": d.Redelivery,
			"duration": 0.27, "status": d.Status, "status_code": d.StatusCode, "event": d.Event, "action": d.Action,
			"installation_id": 123, "repository_id": 456, "url": "https://example.com/webhooks/github",
			"request": map[string]any{
				"headers": map[string]string{
					"Accept": "*/*", "Content-Type": "application/json", "User-Agent": "GitHub-Hookshot/5c6ad3b",
					"X-GitHub-Delivery": d.GUID, "X-GitHub-Event": d.Event, "X-GitHub-Hook-ID": "42",
					"X-GitHub-Hook-Installation-Target-ID":   strconv.Itoa(testAppID),
					"X-GitHub-Hook-Installation-Target-Type": "integration",
					"X-Hub-Signature-256":                    "sha256=ignored-here",
				},
				"payload": json.RawMessage(payload),
			},
			"response": map[string]any{"headers": map[string]string{}, "payload": "service unavailable"},
		}
		_ = json.NewEncoder(w).Encode(detail)
		return
	}
	w.WriteHeader(http.StatusNotFound)
	fmt.Fprint(w, `{"message":"Not Found"}`)
}

func (g *fakeGitHub) counts(id int64) (list, pages, fetches int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.listCalls, g.pageCalls, g.fetches[id]
}

func ptr[T any](v T) *T { return &v }

// storedBefore stores evs in cfg's database before the daemon starts.
func storedBefore(t *testing.T, cfg *Config, evs ...*Event) {
	t.Helper()
	ctx := context.Background()
	store, err := OpenStore(ctx, cfg.Database, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs {
		if err := store.WriteTx(ctx, func(tx *Tx) error { _, err := tx.InsertEvent(ctx, ev, false); return err }); err != nil {
			t.Fatal(err)
		}
	}
}

func (g *fakeGitHub) redelivered() []int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]int64(nil), g.redeliveries...)
}

// Failed, failed-then-redelivered-OK, OK, and already stored deliveries:
// exactly the first is queued, once, across two polls; the consumer puts its
// Event in github and through github-database.
func TestHooksRedeliversFailedDeliveries(t *testing.T) {
	t.Parallel()
	onBothStores(t, testHooksRedeliversFailedDeliveries)
}

func testHooksRedeliversFailedDeliveries(t *testing.T) {
	gh := newFakeGitHub(t)
	cfg, _ := hooksConfig(t, gh)
	cfg.GitHub.BotAppID = testAppID

	payload := loadFixture(t, "pull_request", "opened")
	now := time.Now().UTC().Add(-10 * time.Minute)
	failed, retriedOK, ok, stored := newGUID(), newGUID(), newGUID(), newGUID()
	gh.add(hookDelivery{ID: 1, GUID: failed, DeliveredAt: now, Status: "Service Unavailable", StatusCode: 503, Event: "pull_request", Action: ptr("opened")}, payload)
	gh.add(hookDelivery{ID: 2, GUID: retriedOK, DeliveredAt: now, Status: "Service Unavailable", StatusCode: 503, Event: "issues"}, nil)
	gh.add(hookDelivery{ID: 3, GUID: retriedOK, DeliveredAt: now.Add(time.Minute), Redelivery: true, Status: "OK", StatusCode: 202, Event: "issues"}, nil)
	gh.add(hookDelivery{ID: 4, GUID: ok, DeliveredAt: now, Status: "OK", StatusCode: 202, Event: "issues"}, nil)
	gh.add(hookDelivery{ID: 5, GUID: stored, DeliveredAt: now, Status: "Timeout", StatusCode: 0, Event: "issues"}, nil)

	// The "stored" one reached us after all (GitHub timed out on the answer).
	storedBefore(t, cfg, &Event{DeliveryID: stored, Name: "issues", Payload: loadFixture(t, "issues", "opened"), ReceivedAt: time.Now()})

	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)

	eventually(t, 30*time.Second, "the failed delivery stored and through database-service", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", failed) == 1 &&
			queryInt(t, db, "SELECT count(*) FROM github_pull_requests WHERE delivery_id = $1", failed) == 1
	})
	eventually(t, 10*time.Second, "two more polls", func() bool { l, _, _ := gh.counts(1); return l >= 3 })
	// The API gives the payload as a JSON value in its answer, which the
	// fake GitHub's encoder compacts: those bytes, byte for byte.
	var gave bytes.Buffer
	if err := json.Compact(&gave, payload); err != nil {
		t.Fatal(err)
	}
	if got := storedPayload(t, d.store, failed); got != gave.String() {
		t.Errorf("the republished payload stored as %d bytes, want the %d GitHub gave, byte for byte", len(got), gave.Len())
	}
	d.stop(t)
	if n := queryInt(t, db, "SELECT count(*) FROM hook_redeliveries"); n != 1 {
		t.Errorf("hook_redeliveries: %d rows, want only the failed delivery", n)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM hook_redeliveries WHERE guid = $1 AND republished_at IS NOT NULL", failed); n != 1 {
		t.Errorf("the failed delivery is not recorded as republished")
	}
	if _, _, f := gh.counts(1); f != 1 {
		t.Errorf("the failed delivery was fetched %d times, want 1", f)
	}
	for _, id := range []int64{2, 3, 4, 5} {
		if _, _, f := gh.counts(id); f != 0 {
			t.Errorf("delivery %d was fetched, want it left alone", id)
		}
	}
	var source, target string
	if err := db.QueryRow("SELECT source_ip, target_type FROM github WHERE delivery_id = $1", failed).Scan(&source, &target); err != nil {
		t.Fatal(err)
	}
	if target != "integration" {
		t.Errorf("republished Event lost its headers: target_type %q", target)
	}
}

// hooks_poll_every holds whatever the window: with a 5-minute window the
// hooks worker still polls every 300 ms.
func TestHooksPollEveryHoldsOverWindow(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	cfg, _ := hooksConfig(t, gh)
	cfg.Workers.Window = 5 * time.Minute
	startDaemon(t, cfg)
	eventually(t, 30*time.Second, "four polls", func() bool { l, _, _ := gh.counts(0); return l >= 4 })
}

// hooksConfig is a test config on a vhost of its own with the hooks worker
// on, its App served by gh, polling every 300 ms in windows as short.
func hooksConfig(t *testing.T, gh *fakeGitHub) (*Config, string) {
	t.Helper()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.GitHub.AppID = testAppID
	cfg.GitHub.PrivateKeyFile = gh.keyFile(t)
	cfg.GitHub.APIURL = gh.srv.URL
	cfg.Workers.HooksPollEvery = 300 * time.Millisecond
	cfg.Workers.Window = 300 * time.Millisecond
	return cfg, vhost
}

// hooksForTest builds the hooks worker's parts over a real store and broker.
func hooksForTest(t *testing.T, gh *fakeGitHub) (*Hooks, string, *Store, *logSink) {
	t.Helper()
	return hooksForTestAt(t, gh, gh.srv.URL)
}

// hooksForTestAt is hooksForTest with the App's API at apiURL, signing with
// gh's key. Gap alerts go to a push channel that is never sent to (no
// alert sender runs), so that alert_outbox shows what was queued.
func hooksForTestAt(t *testing.T, gh *fakeGitHub, apiURL string) (*Hooks, string, *Store, *logSink) {
	t.Helper()
	cfg, vhost := hooksConfig(t, gh)
	cfg.GitHub.APIURL = apiURL
	p := newParts(t, cfg)
	app, err := NewGitHubApp(cfg.GitHub, p.log)
	if err != nil {
		t.Fatal(err)
	}
	alerter := NewAlerter(AlertsConfig{Rules: []AlertRule{{Events: []string{"gap"}, Channels: []string{"push"}}},
		Push: PushConfig{URL: "http://127.0.0.1:1/never"}}, p.log)
	return NewHooks(cfg, []*HookLedger{AppLedger(app)}, p.store, p.brokers, p.queues, alerter, noop.NewTracerProvider(), p.log), vhost, p.store, p.logs
}

// 250 deliveries over three pages are all seen; the checkpoint stops the next
// poll from reading them again.
func TestHooksPollPagingAndCheckpoint(t *testing.T) {
	t.Parallel()
	onBothStores(t, testHooksPollPagingAndCheckpoint)
}

func testHooksPollPagingAndCheckpoint(t *testing.T) {
	gh := newFakeGitHub(t)
	start := time.Now().UTC().Add(-2 * time.Hour)
	for i := 0; i < 250; i++ {
		gh.add(hookDelivery{ID: int64(1000 + i), GUID: newGUID(), DeliveredAt: start.Add(time.Duration(i) * time.Second),
			Status: "Invalid HTTP Response: 503", StatusCode: 503, Event: "issues"}, nil)
	}
	// One older than GitHub keeps: never asked for.
	gh.deliveries = append(gh.deliveries, hookDelivery{ID: 1, GUID: newGUID(), DeliveredAt: time.Now().Add(-80 * time.Hour), StatusCode: 503, Event: "issues"})
	hooks, vhost, store, _ := hooksForTest(t, gh)

	n, err := hooks.Poll(context.Background(), Holding{})
	if err != nil {
		t.Fatal(err)
	}
	if n != 250 {
		t.Errorf("queued %d, want 250", n)
	}
	if _, pages, _ := gh.counts(0); pages != 3 {
		t.Errorf("pages read: %d, want 3", pages)
	}
	if got := ready(t, vhost, queueHooks); got != 250 {
		t.Errorf("github-hooks holds %d, want 250", got)
	}
	var rows int
	_ = store.r.QueryRow("SELECT count(*) FROM hook_redeliveries").Scan(&rows)
	if rows != 250 {
		t.Errorf("hook_redeliveries: %d, want 250", rows)
	}

	n, err = hooks.Poll(context.Background(), Holding{})
	if err != nil {
		t.Fatal(err)
	}
	if _, pages, _ := gh.counts(0); n != 0 || pages != 4 {
		t.Errorf("second poll: queued %d reading %d pages in all, want 0 queued and only its first page read", n, pages)
	}
	if got := ready(t, vhost, queueHooks); got != 250 {
		t.Errorf("github-hooks holds %d after the second poll, want still 250", got)
	}
}

// GitHub answering 500 or 403 rate-limited: the message retries and then
// succeeds; 401: a clear log line, and the message waits.
func TestHooksGitHubErrors(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	guid := newGUID()
	gh.add(hookDelivery{ID: 7, GUID: guid, DeliveredAt: time.Now().UTC().Add(-time.Minute), StatusCode: 503, Event: "issues"},
		loadFixture(t, "issues", "opened"))
	gh.failNext = []int{500, 403}
	hooks, vhost, store, appLog := hooksForTest(t, gh)
	sink := &logSink{t: t}
	log := slog.New(slog.NewTextHandler(sink, nil))
	b := hooks.brokers.List()[0]

	if _, err := hooks.Poll(context.Background(), Holding{}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		consumeUntil(ctx, hooks.queues, b, ConsumeOptions{Queue: queueHooks, Handle: func(ctx context.Context, msgs []Message) ([]error, error) {
			return hooks.HandleMessages(ctx, Holding{}, msgs)
		}, Log: log})
		close(done)
	}()
	defer func() { cancel(); <-done }()

	eventually(t, 20*time.Second, "the Event republished to github", func() bool { return ready(t, vhost, queueGitHub) == 1 })
	if _, _, f := gh.counts(7); f != 3 {
		t.Errorf("fetches: %d, want 3 (500, 403, then OK)", f)
	}
	if c := strings.Count(sink.String(), "transient failure, message will retry"); c != 2 {
		t.Errorf("retries logged: %d, want 2", c)
	}
	// The republish comes before the worker records the delivery (its own
	// transaction, after the network): wait for that too.
	eventually(t, 10*time.Second, "the hooks worker recording the delivery", func() bool {
		var n int
		_ = store.r.QueryRow("SELECT count(*) FROM worker_deliveries WHERE worker = 'hooks' AND delivery_id = $1", guid).Scan(&n)
		return n == 1
	})

	// A wrong key: every call is a 401, said plainly, and nothing is lost.
	gh.mu.Lock()
	gh.always401 = true
	gh.mu.Unlock()
	if _, err := hooks.Poll(context.Background(), Holding{}); err == nil || !strings.Contains(err.Error(), "401") {
		t.Errorf("poll with a rejected JWT: got %v", err)
	}
	if !strings.Contains(appLog.String(), "level=ERROR") || !strings.Contains(appLog.String(), "check github.app_id and github.private_key_file") {
		t.Errorf("no clear error line for the 401:\n%s", appLog.String())
	}
	// The consumer, handed a message while GitHub says 401, nacks it: it waits
	// in the retry cycle instead of being dropped.
	other := newGUID()
	publishRaw(t, vhost, "", queueHooks, eventMessage("issues", other, []byte(`{"delivery_id": 7, "guid": "`+other+`"}`)))
	eventually(t, 10*time.Second, "a retry after the 401", func() bool {
		return strings.Count(sink.String(), "transient failure, message will retry") >= 3
	})
}

// GitHub's rate limits are honoured: after a spent primary limit
// (X-RateLimit-Reset), a secondary limit (Retry-After) or a 429 (Retry-After),
// no request reaches GitHub before the time it named, and polls resume after.
func TestHooksRateLimits(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	hooks, _, _, _ := hooksForTest(t, gh)
	limits := []struct {
		name   string
		answer func(until time.Time) func(w http.ResponseWriter)
	}{
		{"primary", func(until time.Time) func(w http.ResponseWriter) {
			return func(w http.ResponseWriter) {
				w.Header().Set("X-RateLimit-Limit", "5000")
				w.Header().Set("X-RateLimit-Remaining", "0")
				w.Header().Set("X-RateLimit-Reset", strconv.FormatInt(until.Unix(), 10))
				w.WriteHeader(http.StatusForbidden)
				fmt.Fprint(w, `{"message":"API rate limit exceeded","documentation_url":"https://docs.github.com/rest/overview/resources-in-the-rest-api#rate-limiting"}`)
			}
		}},
		{"secondary", func(until time.Time) func(w http.ResponseWriter) {
			return func(w http.ResponseWriter) {
				w.Header().Set("Retry-After", strconv.Itoa(int(time.Until(until).Seconds()+0.999)))
				w.WriteHeader(http.StatusForbidden)
				fmt.Fprint(w, `{"message":"You have exceeded a secondary rate limit.","documentation_url":"https://docs.github.com/rest/overview/rate-limits-for-the-rest-api#about-secondary-rate-limits"}`)
			}
		}},
		{"429", func(until time.Time) func(w http.ResponseWriter) {
			return func(w http.ResponseWriter) {
				w.Header().Set("Retry-After", strconv.Itoa(int(time.Until(until).Seconds()+0.999)))
				w.WriteHeader(http.StatusTooManyRequests)
				fmt.Fprint(w, `{"message":"Too many requests"}`)
			}
		}},
	}
	for _, l := range limits {
		t.Run(l.name, func(t *testing.T) {
			until := time.Now().Add(2 * time.Second).Truncate(time.Second).Add(time.Second)
			gh.mu.Lock()
			gh.limitNext = []func(http.ResponseWriter){l.answer(until)}
			before := len(gh.listTimes)
			gh.mu.Unlock()
			if _, err := hooks.Poll(context.Background(), Holding{}); !errors.Is(err, ErrGitHubRateLimited) {
				t.Fatalf("poll on a rate limit: got %v, want ErrGitHubRateLimited", err)
			}
			if _, err := hooks.Poll(context.Background(), Holding{}); !errors.Is(err, ErrGitHubRateLimited) {
				t.Errorf("poll again at once: got %v, want ErrGitHubRateLimited", err)
			}
			eventually(t, 15*time.Second, "a poll that succeeds after the limit", func() bool {
				_, err := hooks.Poll(context.Background(), Holding{})
				return err == nil
			})
			gh.mu.Lock()
			defer gh.mu.Unlock()
			times := gh.listTimes[before:]
			if len(times) < 2 {
				t.Fatalf("list requests: %d, want the limited one and the one after", len(times))
			}
			for _, at := range times[1:] {
				if at.Before(until) {
					t.Errorf("a request reached GitHub at %s, before the limit's end %s", at.Format(time.RFC3339Nano), until.Format(time.RFC3339Nano))
				}
			}
		})
	}
}

// The delivery ledger against GitHub's record, with the daemon
// running: a 2xx delivery that is not stored becomes a gap after the grace,
// is alerted once, is redelivered through the attempts endpoint and is
// resolved once the redelivered webhook is stored; a 2xx delivery still
// inside the grace (its message on the retry cycle) is no gap, and holds the
// checkpoint back; a stored one is left alone.
func TestDeliveryLedgerGaps(t *testing.T) {
	t.Parallel()
	onBothStores(t, testDeliveryLedgerGaps)
}

func testDeliveryLedgerGaps(t *testing.T) {
	gh := newFakeGitHub(t)
	push := newPushSink(t)
	cfg, vhost := hooksConfig(t, gh)
	cfg.Alerts = AlertsConfig{Rules: []AlertRule{{Events: []string{"gap"}, Channels: []string{"push"}}},
		Push: PushConfig{URL: push.srv.URL + "/gaps", Token: "push-secret-token"}}
	cfg.Queue.RetryTTL = time.Hour // a message on the retry cycle stays there for the test

	body := loadFixture(t, "issues", "opened")
	now := time.Now().UTC()
	lost, onRetry, stored := newGUID(), newGUID(), newGUID()
	// GitHub's record: several attempts per GUID, as GitHub shapes them.
	gh.add(hookDelivery{ID: 11, GUID: lost, DeliveredAt: now.Add(-3 * time.Hour), Status: "Invalid HTTP Response: 503", StatusCode: 503, Event: "issues", Action: ptr("opened")}, body)
	gh.add(hookDelivery{ID: 12, GUID: lost, DeliveredAt: now.Add(-170 * time.Minute), Redelivery: true, Status: "Accepted", StatusCode: 202, Event: "issues", Action: ptr("opened")}, body)
	gh.add(hookDelivery{ID: 21, GUID: stored, DeliveredAt: now.Add(-3 * time.Hour), Status: "Accepted", StatusCode: 202, Event: "issues"}, body)
	gh.add(hookDelivery{ID: 31, GUID: onRetry, DeliveredAt: now.Add(-10 * time.Minute), Status: "Accepted", StatusCode: 202, Event: "issues"}, body)

	// stored reached the tables; onRetry waits in github-retry.
	storedBefore(t, cfg, &Event{DeliveryID: stored, Name: "issues", Payload: body, ReceivedAt: now})
	declareTestTopology(t, vhost, cfg.Queue.RetryTTL)
	publishRaw(t, vhost, "", retryQueue(queueGitHub), eventMessage("issues", onRetry, body))

	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	// GitHub answers a redelivery by delivering the webhook again.
	gh.mu.Lock()
	// (In its own goroutine: it must not fail the test with t.Fatal; a lost
	// redelivery shows as the gap never resolved.)
	gh.onRedeliver = func(hd hookDelivery) {
		gh.mu.Lock()
		payload := gh.payloads[hd.ID]
		gh.mu.Unlock()
		req := webhookRequest(t, d.URL, hd.Event, hd.GUID, payload)
		// The App's hook's copy: the one its deliveries speak of.
		req.Header.Set("X-GitHub-Hook-Installation-Target-Type", "integration")
		req.Header.Set("X-GitHub-Hook-Installation-Target-ID", strconv.Itoa(testAppID))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}
	gh.mu.Unlock()

	eventually(t, 30*time.Second, "the gap resolved by its redelivery", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM delivery_gaps WHERE guid = $1 AND redelivered_at IS NOT NULL AND resolved_at IS NOT NULL", lost) == 1
	})
	if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", lost); n != 1 {
		t.Errorf("the lost delivery is stored %d times, want 1", n)
	}
	l, _, _ := gh.counts(0)
	eventually(t, 10*time.Second, "two more polls", func() bool { n, _, _ := gh.counts(0); return n >= l+2 })
	if got := gh.redelivered(); len(got) != 1 || got[0] != 12 {
		t.Errorf("redeliveries asked: %v, want once, of the latest attempt (12)", got)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM delivery_gaps"); n != 1 {
		t.Errorf("delivery_gaps holds %d rows, want only the lost delivery (neither the stored one nor the one inside the grace)", n)
	}
	eventually(t, 10*time.Second, "the gap's alert", func() bool { return len(push.requests()) >= 1 })
	if reqs := push.requests(); len(reqs) != 1 || !strings.Contains(reqs[0].title+reqs[0].body, lost) {
		t.Errorf("gap alerts: %d, want one naming %s: %+v", len(reqs), lost, reqs)
	}
	var cp string
	if err := db.QueryRow("SELECT value FROM settings WHERE key = $1", keyHooksCheckpoint).Scan(&cp); err != nil {
		t.Fatal(err)
	}
	if cpTime, err := time.Parse(time.RFC3339Nano, cp); err != nil || cpTime.After(now.Add(-10*time.Minute)) {
		t.Errorf("checkpoint %s moved past the delivery still in flight (%s)", cp, now.Add(-10*time.Minute).Format(time.RFC3339))
	}
	if v := scrape(t, d.URL+"/metrics")["switchyard_delivery_gaps"]; v != 0 {
		t.Errorf("switchyard_delivery_gaps = %v once resolved, want 0", v)
	}
}

// A gap whose message sits in github-error: with redelivery off it stays
// open, is counted and listed by `switchyard deliveries -gaps`; replayed, it
// is stored and the gap resolved.
func TestDeliveryGapReplayedFromErrorQueue(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	cfg, vhost := hooksConfig(t, gh)
	cfg.GitHub.RedeliverGaps = false
	body := loadFixture(t, "issues", "opened")
	now := time.Now().UTC()
	inError, other := newGUID(), newGUID()
	gh.add(hookDelivery{ID: 41, GUID: inError, DeliveredAt: now.Add(-5 * time.Hour), Status: "Accepted", StatusCode: 202, Event: "issues"}, body)
	gh.add(hookDelivery{ID: 42, GUID: other, DeliveredAt: now.Add(-4 * time.Hour), Status: "Accepted", StatusCode: 202, Event: "push"}, nil)
	declareTestTopology(t, vhost, cfg.Queue.RetryTTL)
	msg := eventMessage("issues", inError, body)
	msg.Headers[hdrErrorReason] = "database is locked"
	publishRaw(t, vhost, "", errorQueue(queueGitHub), msg)

	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	eventually(t, 30*time.Second, "two gaps recorded", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM delivery_gaps WHERE resolved_at IS NULL") == 2
	})
	eventually(t, 10*time.Second, "switchyard_delivery_gaps at 2", func() bool {
		return scrape(t, d.URL+"/metrics")["switchyard_delivery_gaps"] == 2
	})
	if got := gh.redelivered(); len(got) != 0 {
		t.Errorf("redelivery asked with redeliver_gaps off: %v", got)
	}

	gaps := func() []string {
		var out bytes.Buffer
		if err := listDeliveries(context.Background(), cfg, slog.New(slog.DiscardHandler), DeliveriesOptions{Gaps: true}, &out); err != nil {
			t.Fatal(err)
		}
		var guids []string
		for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n")[1:] {
			guids = append(guids, strings.Fields(line)[0])
		}
		slices.Sort(guids)
		return guids
	}
	want := []string{inError, other}
	slices.Sort(want)
	if got := gaps(); !slices.Equal(got, want) {
		t.Errorf("deliveries -gaps: %v, want %v", got, want)
	}

	if err := replay(context.Background(), cfg, slog.New(slog.DiscardHandler), queueGitHub, ReplayOptions{From: -1}, io.Discard); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the replayed gap resolved", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM delivery_gaps WHERE guid = $1 AND resolved_at IS NOT NULL", inError) == 1
	})
	if got := gaps(); !slices.Equal(got, []string{other}) {
		t.Errorf("deliveries -gaps after the replay: %v, want only %s", got, other)
	}
}

// A poll over 3 days of deliveries, 4,000 across 40 pages, finishes and
// moves the checkpoint to the oldest delivery still in flight.
func TestDeliveryLedgerThreeDays(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	hooks, _, store, _ := hooksForTest(t, gh)
	ctx := context.Background()
	now := time.Now().UTC()
	body := []byte(`{"action":"opened"}`)
	var inFlight time.Time
	err := store.WriteTx(ctx, func(tx *Tx) error {
		for i := 0; i < 4000; i++ {
			at := now.Add(-time.Duration(i) * 62 * time.Second) // 4,000 over 69 hours, newest first
			d := hookDelivery{ID: int64(100000 + i), GUID: newGUID(), DeliveredAt: at, Status: "Accepted", StatusCode: 202, Event: "issues"}
			gh.deliveries = append(gh.deliveries, d)
			if i < 50 {
				inFlight = at // the newest 50 are not stored yet: in flight
				continue
			}
			if _, err := tx.InsertEvent(ctx, &Event{DeliveryID: d.GUID, Name: "issues", Payload: body, ReceivedAt: at}, false); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hooks.Poll(ctx, Holding{}); err != nil {
		t.Fatal(err)
	}
	if _, pages, _ := gh.counts(0); pages != 40 {
		t.Errorf("pages read: %d, want 40", pages)
	}
	cp, err := store.Setting(ctx, keyHooksCheckpoint)
	if err != nil {
		t.Fatal(err)
	}
	if cp != formatTime(inFlight) {
		t.Errorf("checkpoint %s, want the oldest delivery in flight, %s", cp, formatTime(inFlight))
	}
	if n, _ := store.OpenGapCount(ctx); n != 0 {
		t.Errorf("%d gaps among stored and in-flight deliveries", n)
	}
}

// GitHub refusing a gap's redelivery: the gap stays recorded, not marked
// redelivered, and the next poll asks again.
func TestGapRedeliveryRetried(t *testing.T) {
	t.Parallel()
	onBothStores(t, testGapRedeliveryRetried)
}

func testGapRedeliveryRetried(t *testing.T) {
	gh := newFakeGitHub(t)
	guid := newGUID()
	gh.add(hookDelivery{ID: 51, GUID: guid, DeliveredAt: time.Now().UTC().Add(-5 * time.Hour), Status: "Accepted", StatusCode: 202, Event: "issues"}, nil)
	gh.failNext = []int{http.StatusInternalServerError}
	hooks, _, store, logs := hooksForTest(t, gh)
	ctx := context.Background()
	if _, err := hooks.Poll(ctx, Holding{}); err != nil {
		t.Fatal(err)
	}
	gaps, _, err := store.OpenGaps(ctx, 100)
	if err != nil || len(gaps) != 1 || gaps[0].GUID != guid || gaps[0].RedeliveredAt != nil {
		t.Fatalf("after a refused redelivery: %+v %v, want the gap open and not marked redelivered", gaps, err)
	}
	if !strings.Contains(logs.String(), "GitHub did not take the redelivery of a gap") {
		t.Errorf("the refusal is not logged")
	}
	if _, err := hooks.Poll(ctx, Holding{}); err != nil {
		t.Fatal(err)
	}
	if got := gh.redelivered(); len(got) != 1 || got[0] != 51 {
		t.Errorf("redeliveries taken: %v, want 51 once, at the second poll", got)
	}
	if gaps, _, _ := store.OpenGaps(ctx, 100); len(gaps) != 1 || gaps[0].RedeliveredAt == nil {
		t.Errorf("after the second poll: %+v, want the gap marked redelivered", gaps)
	}
}

// A poll keeps GitHub's attempts at each delivery, and `deliveries show`
// tells them with their status codes, oldest first: a delivery GitHub
// failed to deliver and then redelivered shows both answers. A status text
// from the API is kept bounded; attempts older than GitHub's 72 hours are
// forgotten.
func TestHooksPollKeepsGitHubAttempts(t *testing.T) {
	t.Parallel()
	onBothStores(t, testHooksPollKeepsGitHubAttempts)
}

func testHooksPollKeepsGitHubAttempts(t *testing.T) {
	gh := newFakeGitHub(t)
	guid := newGUID()
	first := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	gh.add(hookDelivery{ID: 501, GUID: guid, DeliveredAt: first, Status: "Invalid HTTP Response: 502", StatusCode: 502, Event: "issues"}, nil)
	gh.add(hookDelivery{ID: 502, GUID: guid, DeliveredAt: first.Add(10 * time.Minute), Redelivery: true,
		Status: "OK" + strings.Repeat(" and on", 2000), StatusCode: 202, Event: "issues"}, nil)
	hooks, vhost, store, _ := hooksForTest(t, gh)
	ctx := context.Background()
	if _, err := store.w.Exec(`INSERT INTO github_attempts (attempt_id, guid, delivered_at, status_code, status, redelivery)
		VALUES (9, 'long-gone', $1, 202, 'OK', 0)`, formatTime(time.Now().Add(-80*time.Hour))); err != nil {
		t.Fatal(err)
	}
	if _, err := hooks.Poll(ctx, Holding{}); err != nil {
		t.Fatal(err)
	}

	st, err := store.Story(ctx, guid)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.GitHub) != 2 || st.GitHub[0].StatusCode != 502 || st.GitHub[1].StatusCode != 202 || !st.GitHub[1].Redelivery {
		t.Fatalf("the story holds GitHub's attempts %+v, want the 502 and then the 202 redelivery", st.GitHub)
	}
	if n := len(st.GitHub[1].Status); n > maxAttemptStatus {
		t.Errorf("a %d-byte status from the API was kept whole (%d bytes)", 2+7*2000, n)
	}
	if _, err := store.Story(ctx, "long-gone"); !errors.Is(err, ErrUnknownDelivery) {
		t.Errorf("an attempt from 80 hours ago is still known: %v", err)
	}

	config := writeConfigWith(t, t.TempDir(), "127.0.0.1:1", databaseKeys(DatabaseConfig{Driver: store.Driver(), URL: testStore(t).URL, Path: store.path}), "", amqpURL(vhost))
	var out bytes.Buffer
	if err := run(ctx, []string{"deliveries", "-config", config, "show", guid}, &out, &out); err != nil {
		t.Fatalf("deliveries show: %v\n%s", err, out.String())
	}
	text := out.String()
	failed := strings.Index(text, first.Format(time.RFC3339)+" 502 Invalid HTTP Response: 502")
	redelivered := strings.Index(text, first.Add(10*time.Minute).Format(time.RFC3339)+" 202 OK")
	if failed < 0 || redelivered < failed || !strings.Contains(text, "(redelivery)") {
		t.Errorf("deliveries show does not tell GitHub's two attempts in order:\n%s", text)
	}
}
