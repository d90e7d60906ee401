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
	db := openDB(t, cfg.Database.Path)
	waitDatabase(t, db, guids...)
	ctx := context.Background()
	eventually(t, 20*time.Second, "every delivery counted", func() bool {
		if err := d.budget.Flush(ctx); err != nil {
			t.Fatal(err)
		}
		return queryInt(t, db, "SELECT coalesce(sum(delivered), 0) FROM broker_usage") == 2*n
	})
	if got := queryInt(t, db, "SELECT coalesce(sum(published), 0) FROM broker_usage"); got != n {
		t.Errorf("published: %d, want %d", got, n)
	}
	m := scrape(t, d.URL+"/metrics")
	if m[`switchyard_broker_messages{broker="0",kind="published"}`] != n || m[`switchyard_broker_messages{broker="0",kind="delivered"}`] != 2*n ||
		m[`switchyard_broker_budget_used_ratio{broker="0"}`] != 3*n/50.0 {
		t.Errorf("gauges: published %v, delivered %v, ratio %v; want %d, %d, %v", m[`switchyard_broker_messages{broker="0",kind="published"}`],
			m[`switchyard_broker_messages{broker="0",kind="delivered"}`], m[`switchyard_broker_budget_used_ratio{broker="0"}`], n, 2*n, 3*n/50.0)
	}
	if err := d.budget.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	for _, level := range []string{"warn", "exhausted"} {
		if got := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id LIKE ?", "budget:%:"+level); got != 1 {
			t.Errorf("%s alerts: %d, want 1", level, got)
		}
	}
	_, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
	var st Status
	if err := json.Unmarshal([]byte(raw), &st); err != nil || len(st.Budgets) != 1 || st.Budgets[0].Published != n ||
		!strings.Contains(strings.Join(st.Problems, "\n"), "has spent its monthly_messages") {
		t.Errorf("status: %v, budgets %+v, problems %q", err, st.Budgets, st.Problems)
	}

	// A restart keeps the month's spending.
	d.stop(t)
	d = startDaemon(t, cfg)
	eventually(t, 20*time.Second, "the month's spending read back after a restart", func() bool {
		return scrape(t, d.URL+"/metrics")[`switchyard_broker_messages{broker="0",kind="published"}`] == n
	})
}
