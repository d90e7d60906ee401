package main

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

// A budget month starts on the broker's budget_resets_on, UTC.
func TestBudgetMonth(t *testing.T) {
	t.Parallel()
	day := func(s string) time.Time { d, _ := time.Parse("2006-01-02", s); return d }
	for _, tt := range []struct {
		now        string
		reset      int
		start, end string
	}{
		{"2026-12-02", 1, "2026-12-01", "2027-01-01"},
		{"2026-12-02", 15, "2026-11-15", "2026-12-15"},
		{"2026-12-20", 15, "2026-12-15", "2027-01-15"},
		{"2026-01-10", 28, "2025-12-28", "2026-01-28"},
	} {
		start, end := budgetMonth(day(tt.now).Add(13*time.Hour), tt.reset)
		if !start.Equal(day(tt.start)) || !end.Equal(day(tt.end)) {
			t.Errorf("%s, resets on %d: got %s..%s, want %s..%s", tt.now, tt.reset, start.Format("2006-01-02"),
				end.Format("2006-01-02"), tt.start, tt.end)
		}
	}
}

// Every webhook costs one publish and two deliveries (github and
// github-database), counted in broker_usage, shown by the gauges and the
// status, kept across a restart; a broker past its monthly_messages is
// alerted once at the warning share and once when spent, however often the
// budget is checked.
func TestBrokerUsageCounted(t *testing.T) {
	t.Parallel()
	onBothStores(t, testBrokerUsageCounted)
}

func testBrokerUsageCounted(t *testing.T) {
	cfg := testConfig(t, amqpURL(newVhost(t)))
	cfg.Brokers[0].MonthlyMessages = 50
	cfg.Queue.BudgetWarnAt = 0.5
	cfg.Alerts = AlertsConfig{Rules: []AlertRule{{Events: []string{"budget"}, Channels: []string{"push"}}},
		Push: PushConfig{URL: "http://127.0.0.1:1/never"}}
	d := startDaemon(t, cfg)
	const n = 20
	body := loadFixture(t, "issues", "opened")
	var guids []string
	for range n {
		g := newGUID()
		guids = append(guids, g)
		if code := postWebhook(t, d.URL, "issues", g, body); code != http.StatusAccepted {
			t.Fatalf("webhook: %d", code)
		}
	}
	db := openStoreDB(t, cfg.Database)
	waitDatabase(t, db, guids...)
	ctx := context.Background()
	// At least two deliveries each; a message a consumer held when its
	// window closed is delivered, and counted, again (as the broker counts
	// it: TestUsageMatchesTheWire holds the count to the wire's).
	eventually(t, 20*time.Second, "every delivery counted", func() bool {
		if err := d.usage.flushAndCheck(ctx); err != nil {
			t.Fatal(err)
		}
		return queryInt(t, db, "SELECT coalesce(sum(delivered), 0) FROM broker_usage") >= 2*n
	})
	if err := d.usage.flushAndCheck(ctx); err != nil {
		t.Fatal(err)
	}
	pub := queryInt(t, db, "SELECT coalesce(sum(published), 0) FROM broker_usage")
	del := queryInt(t, db, "SELECT coalesce(sum(delivered), 0) FROM broker_usage")
	if pub != n {
		t.Errorf("published: %d, want %d", pub, n)
	}
	m := scrape(t, d.URL+"/metrics")
	if m[`switchyard_broker_messages{broker="0",kind="published"}`] != float64(pub) || m[`switchyard_broker_messages{broker="0",kind="delivered"}`] != float64(del) ||
		m[`switchyard_broker_budget_used_ratio{broker="0"}`] != float64(pub+del)/50 {
		t.Errorf("gauges: published %v, delivered %v, ratio %v; want %d, %d, %v", m[`switchyard_broker_messages{broker="0",kind="published"}`],
			m[`switchyard_broker_messages{broker="0",kind="delivered"}`], m[`switchyard_broker_budget_used_ratio{broker="0"}`], pub, del, float64(pub+del)/50)
	}
	if err := d.usage.flushAndCheck(ctx); err != nil {
		t.Fatal(err)
	}
	for _, level := range []string{"warn", "exhausted"} {
		if got := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id LIKE $1", "budget:%:"+level); got != 1 {
			t.Errorf("%s alerts: %d, want 1", level, got)
		}
	}
	_, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
	var st Status
	if err := json.Unmarshal([]byte(raw), &st); err != nil || len(st.Budgets) != 1 || st.Budgets[0].Published != n ||
		!strings.Contains(strings.Join(st.Problems, "\n"), "has spent its monthly_messages") {
		t.Errorf("status: %v, budgets %+v, problems %q", err, st.Budgets, st.Problems)
	}
	// Minutes of counting project nothing: a day of it is needed.
	if v := st.Budgets[0]; v.Projected != nil || v.ProjectedFrom.Before(time.Now().Add(22*time.Hour)) ||
		!strings.Contains(v.ProjectionText(), "too early") {
		t.Errorf("a projection after minutes of counting: %+v (%s), want none before a day", v, v.ProjectionText())
	}
	// With a day counted (an hour of two days ago), the last 24 hours' rate.
	wdb := openWritableDB(t, cfg.Database)
	if _, err := wdb.Exec("INSERT INTO broker_usage (broker, hour, published, delivered) VALUES ($1, $2, 0, 0)",
		usageKey(d.brokers.List()[0].Host, d.brokers.List()[0].Vhost), formatTime(time.Now().Add(-48*time.Hour).Truncate(time.Hour))); err != nil {
		t.Fatal(err)
	}
	views, err := d.usage.Views(ctx, time.Now())
	if err != nil || views[0].Projected == nil || *views[0].Projected < int64(pub+del) {
		t.Errorf("a projection with a day counted: %v %+v", err, views)
	}

	// A restart keeps the month's spending.
	d.stop(t)
	d = startDaemon(t, cfg)
	eventually(t, 20*time.Second, "the month's spending read back after a restart", func() bool {
		return scrape(t, d.URL+"/metrics")[`switchyard_broker_messages{broker="0",kind="published"}`] == n
	})
}

// rotate_on_budget: when the broker switchyard publishes to passes
// rotate_at, a Pending Switch to the next broker under it is recorded, the
// workers follow once the old one is drained, and nothing is lost; with
// every broker past it nothing moves and one alert says so.
func TestRotateOnBudget(t *testing.T) {
	t.Parallel()
	for _, allSpent := range []bool{false, true} {
		t.Run(map[bool]string{false: "to the next broker", true: "every broker spent"}[allSpent], func(t *testing.T) {
			t.Parallel()
			a, b := newVhost(t), newVhost(t)
			cfg := testConfig(t, amqpURL(a), amqpURL(b))
			cfg.Brokers[0].MonthlyMessages = 10
			cfg.Queue.RotateOnBudget, cfg.Queue.RotateAt = true, 0.5
			cfg.Alerts = AlertsConfig{Rules: []AlertRule{{Events: []string{"budget"}, Channels: []string{"push"}}},
				Push: PushConfig{URL: "http://127.0.0.1:1/never"}}
			ctx := context.Background()
			if allSpent {
				cfg.Brokers[1].MonthlyMessages = 10
				store, err := OpenStore(ctx, cfg.Database, nil)
				if err != nil {
					t.Fatal(err)
				}
				store.Migrate(ctx)
				if err := store.WriteTx(ctx, func(tx *Tx) error {
					return tx.AddBrokerUsage(ctx, time.Now(), []usageRow{{Broker: usageKey("127.0.0.1", b), Published: 10}})
				}); err != nil {
					t.Fatal(err)
				}
				store.Close()
			}
			d := startDaemon(t, cfg)
			db := openStoreDB(t, cfg.Database)
			body := loadFixture(t, "issues", "opened")
			var guids []string
			post := func(n int) {
				for range n {
					g := newGUID()
					guids = append(guids, g)
					if code := postWebhook(t, d.URL, "issues", g, body); code != http.StatusAccepted {
						t.Fatalf("webhook: %d", code)
					}
				}
			}
			post(5)
			waitDatabase(t, db, guids...)
			if allSpent {
				for range 2 {
					if err := d.usage.flushAndCheck(ctx); err != nil {
						t.Fatal(err)
					}
				}
				if st := d.brokers.Cached(); st.Active != 0 || st.Pending != nil {
					t.Errorf("state %+v: want broker 0 kept, no pending switch", st)
				}
				if n := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id LIKE 'budget:every broker:%:none'"); n != 1 {
					t.Errorf("'no broker left' alerts: %d, want 1", n)
				}
				return
			}
			eventually(t, 30*time.Second, "publishing moved to broker 1 and the workers followed", func() bool {
				if err := d.usage.flushAndCheck(ctx); err != nil {
					t.Fatal(err)
				}
				st, err := d.brokers.State(ctx)
				return err == nil && st.Active == 1 && st.Pending == nil
			})
			post(3)
			eventually(t, 20*time.Second, "every webhook stored once", func() bool {
				return queryInt(t, db, "SELECT count(*) FROM github") == len(guids)
			})
			if n := ready(t, b, queueGitHub); n != 0 {
				t.Errorf("broker 1's github holds %d, want all consumed", n)
			}
		})
	}
}

// What switchyard counts is what the wire carried: basic.publish frames
// from it, basic.deliver and basic.get-ok frames to it, as a proxy between
// it and the broker counts them, on the webhook, consume and replay paths.
func TestUsageMatchesTheWire(t *testing.T) {
	t.Parallel()
	vhost, _, wire, cfg := wireConfig(t)
	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	body := loadFixture(t, "issues", "opened")
	var guids []string
	for range 12 {
		g := newGUID()
		guids = append(guids, g)
		if code := postWebhook(t, d.URL, "issues", g, body); code != http.StatusAccepted {
			t.Fatalf("webhook: %d", code)
		}
	}
	// A message replayed from -error: a basic.get-ok and a publish.
	failed := eventMessage("issues", newGUID(), body)
	publishRaw(t, vhost, "", errorQueue(queueGitHub), failed)
	if moved, _, err := d.queues.Replay(context.Background(), d.brokers.List()[0], d.brokers.List()[0], queueGitHub, 0, func(int, int) {}); err != nil || moved != 1 {
		t.Fatalf("replay: %d, %v", moved, err)
	}
	waitDatabase(t, db, guids...)
	eventually(t, 20*time.Second, "the replayed message stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", failed.MessageId) == 1
	})
	ctx := context.Background()
	eventually(t, 20*time.Second, "switchyard's count equal to the wire's", func() bool {
		if err := d.usage.flushAndCheck(ctx); err != nil {
			t.Fatal(err)
		}
		pub := queryInt(t, db, "SELECT coalesce(sum(published), 0) FROM broker_usage")
		del := queryInt(t, db, "SELECT coalesce(sum(delivered), 0) FROM broker_usage")
		ok := int64(pub) == wire.publish.Load() && int64(del) == wire.deliver.Load()+wire.getOK.Load()
		if !ok {
			t.Logf("counted %d published, %d delivered; the wire %d publish, %d deliver, %d get-ok", pub, del,
				wire.publish.Load(), wire.deliver.Load(), wire.getOK.Load())
		}
		return ok
	})
	if wire.publish.Load() < 13 || wire.deliver.Load() < 25 || wire.getOK.Load() != 1 {
		t.Errorf("the wire carried %d publishes, %d deliveries, %d get-oks; want at least 13, 25 (two a webhook, one for the replayed message) and exactly 1",
			wire.publish.Load(), wire.deliver.Load(), wire.getOK.Load())
	}
}

// A batch of consumed messages commits the deliveries the broker counted
// for it in its own transaction: with no Usage running (nothing flushes),
// broker_usage holds every delivery the wire carried once the rows are
// stored (more than one a message: a consumer that resizes its window has
// the messages it held sent again, and the broker counts them again).
func TestUsageInBatchTransactions(t *testing.T) {
	t.Parallel()
	onBothStores(t, testUsageInBatchTransactions)
}

func testUsageInBatchTransactions(t *testing.T) {
	countUsageInBatches(t, queueGitHub, func(p *parts) Handler { return serviceHandler(nil, 0, false) }, nil,
		"every delivery stored", "SELECT count(*) FROM github")
}

// countUsageInBatches publishes 40 deliveries to queue and consumes them
// with the handler h gives, with a Usage that never runs (nothing writes
// its counts but the batches' transactions). before, when set, runs for
// each delivery before it is published. Once finished (a count that
// reaches 40) says every delivery is done, broker_usage holds every
// delivery the wire carried.
func countUsageInBatches(t *testing.T, queue string, h func(p *parts) Handler, before func(p *parts, guid string, i int),
	what, finished string) {
	t.Helper()
	vhost, _, wire, cfg := wireConfig(t)
	p := newParts(t, cfg)
	if err := p.queues.Reachable(context.Background(), p.brokers.List()[0]); err != nil { // declares the topology
		t.Fatal(err)
	}
	budget := NewUsage(cfg, p.brokers, p.queues, p.store, nil, nil, p.log, nil) // never Run
	body := loadFixture(t, "issues", "opened")
	for i := range 40 {
		g := newGUID()
		if before != nil {
			before(p, g, i)
		}
		publishRaw(t, vhost, "", queue, eventMessage("issues", g, body))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		consumeUntil(ctx, p.queues, p.brokers.List()[0], EventOptions{Queue: queue, Handle: h(p),
			Batch: p.store, Usage: budget, Log: p.log}.options())
		close(done)
	}()
	t.Cleanup(func() { cancel(); <-done })
	db := openStoreDB(t, cfg.Database)
	eventually(t, 30*time.Second, what, func() bool { return queryInt(t, db, finished) == 40 })
	eventually(t, 10*time.Second, "every delivery on the wire counted once, with a batch", func() bool {
		return int64(queryInt(t, db, "SELECT coalesce(sum(delivered), 0) FROM broker_usage")) == wire.deliver.Load()
	})
	if wire.deliver.Load() < 40 {
		t.Errorf("the wire carried %d deliveries of 40 messages", wire.deliver.Load())
	}
}

// A batch that runs again (on PostgreSQL, one whose statement sent ahead
// was answered otherwise: a delivery done before) counts what the broker
// counted once, with the run that commits: the database worker's batches
// of deliveries half of which it finished before.
func TestUsageCountedOnceWhenABatchRunsAgain(t *testing.T) {
	t.Parallel()
	onBothStores(t, testUsageCountedOnceWhenABatchRunsAgain)
}

func testUsageCountedOnceWhenABatchRunsAgain(t *testing.T) {
	markedBefore := func(p *parts, guid string, i int) {
		if i%2 == 0 {
			return
		}
		ctx := context.Background()
		if err := p.store.WriteTx(ctx, func(tx *Tx) error {
			_, err := tx.MarkDelivery(ctx, "database-service", DeliveryKey{GUID: guid}, nil)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	countUsageInBatches(t, queueDatabase, func(p *parts) Handler { return databaseHandler(testBotAppID) }, markedBefore,
		"every delivery finished", "SELECT count(*) FROM worker_deliveries WHERE worker = 'database-service'")
}

// wireConfig is a test config whose broker is a new vhost behind proxy,
// which counts the billable frames it carries.
func wireConfig(t *testing.T) (vhost string, proxy *tcpProxy, wire *frameCounts, cfg *Config) {
	t.Helper()
	vhost = newVhost(t)
	proxy = newTCPProxy(t, testBrokerAddr())
	return vhost, proxy, proxy.countFrames(), testConfig(t, proxy.URL(vhost))
}

// flushAndCheck writes what the brokers cost, then checks the budgets as
// the budget lease's job does (with no lease: a test's).
func (b *Usage) flushAndCheck(ctx context.Context) error {
	if err := b.Flush(ctx); err != nil {
		return err
	}
	return b.Check(ctx, Holding{})
}
