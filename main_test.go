package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// writeConfig writes a TOML config for the built binary.
func writeConfig(t testing.TB, dir, listen, dbPath string, brokerURLs ...string) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, `[server]
listen = %q
[database]
path = %q
[api]
operator_token = "operator-token-for-tests"
producer_token = "producer-token-for-tests"
[github]
webhook_secret = %q
allowed_cidrs = ["127.0.0.0/8"]
[queue]
declare_topology = true
retry_ttl = "200ms"
[workers]
window = "2s"
pending_check_interval = "300ms"
cleanup_every = "1s"
cleanup_window = "500ms"
[log]
level = "info"
`, listen, dbPath, testSecret)
	for _, u := range brokerURLs {
		fmt.Fprintf(&b, "[[brokers]]\nurl = %q\n", u)
	}
	p := filepath.Join(dir, "switchyard.toml")
	if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// builtBinary builds switchyard once for the tests that need a real process
// (signals, SIGKILL).
func builtBinary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "switchyard-bin")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "switchyard")
		cmd := exec.Command("go", "build", "-o", binPath, ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v: %s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// startProcess runs `switchyard serve` and waits until /healthz answers.
func startProcess(t *testing.T, config, addr string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(builtBinary(t), "serve", "-config", config)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	eventually(t, 20*time.Second, "serve answering /healthz", func() bool {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return cmd, &out
}

// processSetup is a config for the real binary: a fresh vhost, a free
// address and a database file of the test's own.
func processSetup(t *testing.T) (config, addr, dbPath string) {
	t.Helper()
	vhost := newVhost(t)
	dir := t.TempDir()
	addr = freeAddr(t)
	dbPath = filepath.Join(dir, "switchyard.db")
	return writeConfig(t, dir, addr, dbPath, amqpURL(vhost)), addr, dbPath
}

// SIGTERM while webhooks flow: the process exits within 25 s, and after a
// restart every delivery that got a 202 is stored exactly once.
func TestSIGTERMLosesNothing(t *testing.T) {
	config, addr, dbPath := processSetup(t)
	cmd, out := startProcess(t, config, addr)

	body := loadFixture(t, "push", "payload.json")
	var mu sync.Mutex
	var accepted []string
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				guid := newGUID()
				resp, err := http.DefaultClient.Do(webhookRequest(t, "http://"+addr, "push", guid, body))
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				resp.Body.Close()
				if resp.StatusCode == http.StatusAccepted {
					mu.Lock()
					accepted = append(accepted, guid)
					mu.Unlock()
				}
			}
		}()
	}
	eventually(t, 20*time.Second, "100 deliveries accepted", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(accepted) >= 100
	})
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	select {
	case err := <-waited:
		if err != nil {
			t.Errorf("exit after SIGTERM: %v\n%s", err, out)
		}
	case <-time.After(25 * time.Second):
		t.Fatalf("still running 25s after SIGTERM\n%s", out)
	}
	t.Logf("stopped %s after SIGTERM", time.Since(start).Round(time.Millisecond))
	close(stop)
	wg.Wait()
	if !strings.Contains(out.String(), "shutting down") {
		t.Errorf("no shutdown log line:\n%s", out)
	}

	startProcess(t, config, addr)
	db := openDB(t, dbPath)
	mu.Lock()
	want := len(accepted)
	mu.Unlock()
	eventually(t, 60*time.Second, fmt.Sprintf("%d accepted deliveries stored", want), func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") >= want
	})
	for _, g := range accepted {
		if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = ?", g); n != 1 {
			t.Errorf("delivery %s: %d rows, want 1", g, n)
		}
	}
	if n := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h"); n != queryInt(t, db, "SELECT count(*) FROM github") {
		t.Errorf("statistics %d do not match rows", n)
	}
}

// check-config names every bad field; config.example.toml validates and its
// summary shows no secret.
func TestCheckConfig(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.toml")
	os.WriteFile(bad, []byte(`
[database]
synchronous = "SOMETIMES"
[api]
operator_token = "op"
producer_token = "pr"
[github]
webhook_secret = "s3cret-value"
[queue]
prefetch = 0
[[brokers]]
url = "http://user:hunter2@example.com/"
`), 0o600)
	var stdout bytes.Buffer
	err := run(context.Background(), []string{"check-config", "-config", bad}, &stdout, &stdout)
	if err == nil {
		t.Fatal("got no error for a config with three mistakes")
	}
	for _, field := range []string{"database.synchronous", "queue.prefetch", "brokers[0].url"} {
		if !strings.Contains(err.Error(), field) {
			t.Errorf("error does not name %s:\n%v", field, err)
		}
	}
	if strings.Contains(err.Error(), "hunter2") || strings.Contains(err.Error(), "s3cret-value") {
		t.Errorf("error leaks a secret:\n%v", err)
	}
	if got := exitCode(err, &bytes.Buffer{}); got != 1 {
		t.Errorf("exit code: got %d, want 1", got)
	}

	unknown := filepath.Join(dir, "unknown.toml")
	os.WriteFile(unknown, []byte("[server]\nlisten = \"127.0.0.1:1\"\nlisen = \"typo\"\n"), 0o600)
	err = run(context.Background(), []string{"check-config", "-config", unknown}, &stdout, &stdout)
	if err == nil || !strings.Contains(err.Error(), "server.lisen: unknown key") {
		t.Errorf("unknown key: got %v", err)
	}

	stdout.Reset()
	if err := run(context.Background(), []string{"check-config", "-config", "config.example.toml"}, &stdout, &stdout); err != nil {
		t.Fatalf("config.example.toml: %v", err)
	}
	for _, secret := range []string{"change-me-operator-token", "change-me-producer-token", "change-me-webhook-secret", "guest:guest"} {
		if strings.Contains(stdout.String(), secret) {
			t.Errorf("check-config output shows %q:\n%s", secret, stdout.String())
		}
	}
	if !strings.Contains(stdout.String(), "amqp://guest:***@127.0.0.1:5672/") {
		t.Errorf("broker URL not shown masked:\n%s", stdout.String())
	}
}

func TestUsage(t *testing.T) {
	tests := []struct {
		args []string
		code int
	}{
		{nil, 2},
		{[]string{"frobnicate"}, 2},
		{[]string{"backup"}, 2},
		{[]string{"serve", "-nope"}, 2},
		{[]string{"version"}, 0},
		{[]string{"serve", "-config", "/does/not/exist.toml"}, 1},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), tt.args, &out, &out)
			if got := exitCode(err, &out); got != tt.code {
				t.Errorf("got exit %d (%v), want %d", got, err, tt.code)
			}
		})
	}
}

// migrate creates the schema once and is a no-op the second time.
func TestMigrateCommand(t *testing.T) {
	dir := t.TempDir()
	config := writeConfig(t, dir, "127.0.0.1:1", dir+"/m.db", amqpURL("x"))
	ms, err := parseMigrations(schemaSQL)
	if err != nil {
		t.Fatal(err)
	}
	latest := len(ms)
	for _, want := range []string{fmt.Sprintf("schema version 0 -> %d", latest), fmt.Sprintf("schema version %d -> %d", latest, latest)} {
		var out bytes.Buffer
		if err := run(context.Background(), []string{"migrate", "-config", config}, &out, &out); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.String(), want) {
			t.Errorf("got %q, want %q", out.String(), want)
		}
	}
	db := openDB(t, dir+"/m.db")
	for _, table := range []string{"settings", "github", "github_statistics_6h", "worker_deliveries",
		"github_releases", "github_release_workflow_runs", "github_branches", "github_issues", "github_pull_requests",
		"github_comments", "github_discussions", "github_check_runs", "github_pushes", "github_installations",
		"github_repositories"} {
		if n := queryInt(t, db, "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = ?", table); n != 1 {
			t.Errorf("table %s missing", table)
		}
	}
	var mode string
	if err := db.QueryRow("PRAGMA journal_mode").Scan(&mode); err != nil || mode != "wal" {
		t.Errorf("journal_mode: %q %v, want wal", mode, err)
	}
}

// A database at an older schema version is upgraded in place, keeping its rows.
func TestMigrateUpgradesInPlace(t *testing.T) {
	ctx := context.Background()
	cfg := DefaultConfig().Database
	cfg.Path = filepath.Join(t.TempDir(), "old.db")
	store, err := OpenStore(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	ms, err := parseMigrations(schemaSQL)
	if err != nil || len(ms) < 2 {
		t.Fatalf("migrations: %d, %v", len(ms), err)
	}
	// The database as the first release left it.
	if _, err := store.w.Exec(ms[0].sql + "; PRAGMA user_version = 1"); err != nil {
		t.Fatal(err)
	}
	ev := &Event{DeliveryID: "old-row", Name: "ping", Payload: []byte("{}"), ReceivedAt: time.Now()}
	if _, err := store.InsertEvent(ctx, ev, false); err != nil {
		t.Fatal(err)
	}
	from, to, err := store.Migrate(ctx)
	if err != nil || from != 1 || to != len(ms) {
		t.Fatalf("Migrate: %d -> %d, %v; want 1 -> %d", from, to, err, len(ms))
	}
	var n int
	if err := store.r.QueryRow("SELECT count(*) FROM github WHERE delivery_id = 'old-row'").Scan(&n); err != nil || n != 1 {
		t.Errorf("row kept: %d %v", n, err)
	}
	if err := store.r.QueryRow("SELECT count(*) FROM github_pull_requests").Scan(&n); err != nil {
		t.Errorf("new table missing: %v", err)
	}
}
