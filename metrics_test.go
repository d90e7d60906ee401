package main

import (
	"bufio"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// scrape reads /metrics into "name{labels}" -> value.
func scrape(t testing.TB, url string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d", url, resp.StatusCode)
	}
	m := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") || line == "" {
			continue
		}
		i := strings.LastIndex(line, " ")
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			m[line[:i]] = v
		}
	}
	return m
}

// One webhook moves the received, published and consumed counters by one each.
func TestMetricsMove(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	before := scrape(t, d.URL+"/metrics")

	guid := newGUID()
	postWebhook(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened"))
	eventually(t, 20*time.Second, "stored by both workers", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1 &&
			queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = $1", guid) == 1
	})
	// A bad request is counted by its outcome too.
	r := webhookRequest(t, d.URL, "issues", newGUID(), []byte(`{}`))
	r.Header.Set("X-Hub-Signature-256", "sha256=00")
	do(t, r)
	eventually(t, 5*time.Second, "consumed counters", func() bool {
		after := scrape(t, d.URL+"/metrics")
		return after[`switchyard_messages_consumed_total{outcome="done",queue="github-database"}`] == 1
	})
	after := scrape(t, d.URL+"/metrics")
	for _, name := range []string{
		`switchyard_webhooks_received_total{outcome="accepted"}`,
		`switchyard_webhooks_received_total{outcome="unauthorized"}`,
		`switchyard_publishes_total{broker="0",outcome="confirmed"}`,
		`switchyard_messages_consumed_total{outcome="done",queue="github"}`,
		`switchyard_messages_consumed_total{outcome="done",queue="github-database"}`,
		`switchyard_publish_duration_seconds_count{broker="0"}`,
		`switchyard_webhook_duration_seconds_count{outcome="accepted"}`,
		`switchyard_webhook_duration_seconds_count{outcome="unauthorized"}`,
		`switchyard_message_processing_seconds_count{queue="github"}`,
	} {
		if got := after[name] - before[name]; got != 1 {
			t.Errorf("%s moved by %v, want 1", name, got)
		}
	}
	metricsDocumented(t, after)
	if after["switchyard_database_write_seconds_count"] < 2 {
		t.Errorf("database writes not measured")
	}
	if _, ok := after["switchyard_active_broker_index"]; !ok {
		t.Errorf("no active broker gauge")
	}
	if _, ok := after["go_goroutines"]; !ok {
		t.Errorf("no Go runtime metrics")
	}
}

// /metrics is not on the public listener by default: it names every
// broker's vhost. metrics_listen moves it to its own address, loopback
// unless the operator says otherwise.
func TestMetricsListen(t *testing.T) {
	t.Parallel()
	if def := DefaultConfig().Server; def.metricsOnAPI() || !strings.HasPrefix(def.MetricsListen, "127.0.0.1:") {
		t.Errorf("default metrics_listen %q, listen %q: want its own loopback address", def.MetricsListen, def.Listen)
	}
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Server.MetricsListen = freeAddr(t)
	cfg.Server.Pprof = true
	d := startDaemon(t, cfg)
	eventually(t, 10*time.Second, "metrics listener", func() bool {
		resp, err := http.Get("http://" + cfg.Server.MetricsListen + "/metrics")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	if code, _ := do(t, mustRequest(t, http.MethodGet, d.URL+"/metrics")); code != http.StatusNotFound {
		t.Errorf("/metrics on the main listener: %d, want 404", code)
	}
	// server.pprof: Go's profiles beside /metrics, never on the main listener.
	if code, body := do(t, mustRequest(t, http.MethodGet, "http://"+cfg.Server.MetricsListen+"/debug/pprof/")); code != http.StatusOK ||
		!strings.Contains(body, "goroutine") {
		t.Errorf("/debug/pprof/ on the metrics listener: %d, want 200 with the profiles", code)
	}
	if code, _ := do(t, mustRequest(t, http.MethodGet, d.URL+"/debug/pprof/")); code != http.StatusNotFound {
		t.Errorf("/debug/pprof/ on the main listener: %d, want 404", code)
	}
	public := *cfg
	public.Server.MetricsListen = public.Server.Listen
	if err := public.Validate(); err == nil || !strings.Contains(err.Error(), "server.pprof") {
		t.Errorf("pprof with metrics on the public listener: %v, want refused", err)
	}
}

// metricsDocumented holds the table of docs/metrics.md to the metrics a
// daemon serves (scraped): every switchyard_ metric is named in it, and
// every outcome of switchyard_webhooks_received_total in its row.
func metricsDocumented(t *testing.T, scraped map[string]float64) {
	t.Helper()
	readme, err := os.ReadFile("docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(readme)
	row := ""
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "| `switchyard_webhooks_received_total{outcome}`") {
			row = line
		}
	}
	for series := range scraped {
		name, labels, _ := strings.Cut(series, "{")
		if !strings.HasPrefix(name, "switchyard_") {
			continue
		}
		base := name
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if trimmed, ok := strings.CutSuffix(name, suffix); ok && !strings.Contains(text, "`"+name) {
				base = trimmed
			}
		}
		if !strings.Contains(text, "`"+base) {
			t.Errorf("docs/metrics.md does not name %s", base)
		}
		if name == "switchyard_webhooks_received_total" {
			outcome := strings.TrimSuffix(strings.TrimPrefix(labels, `outcome="`), `"}`)
			if !strings.Contains(row, "`"+outcome+"`") {
				t.Errorf("docs/metrics.md's row of switchyard_webhooks_received_total does not name the outcome %q:\n%s", outcome, row)
			}
		}
	}
}
