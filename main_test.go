package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// writeConfig writes a TOML config for the built binary, its database an
// SQLite file.
func writeConfig(t testing.TB, dir, listen, dbPath string, brokerURLs ...string) string {
	t.Helper()
	return writeConfigWith(t, dir, listen, fmt.Sprintf("path = %q", dbPath), "", brokerURLs...)
}

// writeConfigWith writes a TOML config for the built binary: database is
// the [database] table's keys, server more keys of [server].
func writeConfigWith(t testing.TB, dir, listen, database, server string, brokerURLs ...string) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, `[server]
listen = %q
metrics_listen = %q
%s
[database]
%s
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
`, listen, listen, server, database, testSecret)
	for _, u := range brokerURLs {
		fmt.Fprintf(&b, "[[brokers]]\nurl = %q\n", u)
	}
	p := filepath.Join(dir, "switchyard.toml")
	if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// editConfig replaces old, which the config file at path holds, with new
// once.
func editConfig(t testing.TB, path, old, new string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), old) {
		t.Fatalf("%s does not hold %q", path, old)
	}
	if err := os.WriteFile(path, []byte(strings.Replace(string(b), old, new, 1)), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestMain removes what was made once for every test: the built binary
// and the vhosts not deleted yet.
func TestMain(m *testing.M) {
	code := m.Run()
	if err := localVhosts.flush(); err != nil {
		fmt.Fprintf(os.Stderr, "deleting the tests' last vhosts: %v\n", err)
	}
	if binPath != "" {
		os.RemoveAll(filepath.Dir(binPath))
	}
	os.Exit(code)
}

// buildFlags are `make build`'s, and every build a test starts (this
// binary, `make deb`'s, the export data TestLayers reads) is CGO_ENABLED=0
// with them: they share the compiled packages in Go's build cache, where
// each other set of flags compiles every dependency again (a few minutes
// of CPU on a cold cache, beside the race-detector build of the tests).
const buildFlags = "-trimpath"

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// builtBinary builds switchyard once for the tests that need a real process
// (signals, SIGKILL).
//
// SWITCHYARD_BENCH_BINARY names another binary for make bench, such as
// one built from an earlier commit, to profile before and after a change.
func builtBinary(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("SWITCHYARD_BENCH_BINARY"); p != "" {
		return p
	}
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "switchyard-bin")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "switchyard")
		cmd := exec.Command("go", "build", buildFlags, "-o", binPath, ".")
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

// runBinary runs the built binary with args, as an operator would, and
// returns what it printed and its exit status: a command that moves
// megabytes (check-broker's 20 MiB) runs at its own speed there, not
// under the race detector's.
func runBinary(t testing.TB, args ...string) (string, int) {
	t.Helper()
	out, err := exec.Command(builtBinary(t), args...).CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(out), ee.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(out), 0
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
func startProcess(t *testing.T, config, addr string) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	cmd := exec.Command(builtBinary(t), "serve", "-config", config)
	out := started(t, cmd)
	t.Cleanup(func() {
		if t.Failed() && !answersOK("http://"+addr+"/healthz") {
			t.Logf("serve on %s, not answering /healthz:\n%s", addr, out)
		}
	})
	// Within a minute: on a loaded machine the dial of the broker alone may
	// take its call_timeout (10 s) before the listener serves.
	eventually(t, time.Minute, "serve answering /healthz", func() bool { return answersOK("http://" + addr + "/healthz") })
	return cmd, out
}

// started starts cmd, its output in the buffer it returns, and kills it
// at the test's end if it still runs.
func started(t testing.TB, cmd *exec.Cmd) *syncBuffer {
	t.Helper()
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return out
}

// syncBuffer is a process's output, safe to read while the process writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
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
	t.Parallel()
	config, addr, dbPath := processSetup(t)
	cmd, out := startProcess(t, config, addr)

	body := loadFixture(t, "push", "branch")
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
	stopProcess(t, cmd, out, 25*time.Second)
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
		if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", g); n != 1 {
			t.Errorf("delivery %s: %d rows, want 1", g, n)
		}
	}
	if n := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h"); n != queryInt(t, db, "SELECT count(*) FROM github") {
		t.Errorf("statistics %d do not match rows", n)
	}
}

// stopProcess sends SIGTERM and waits for an exit with status 0, failing
// the test when the process still runs after within.
func stopProcess(t testing.TB, cmd *exec.Cmd, out *syncBuffer, within time.Duration) {
	t.Helper()
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	select {
	case err := <-waited:
		if err != nil {
			t.Errorf("exit after SIGTERM: %v, want status 0\n%s", err, out)
		}
	case <-time.After(within):
		// SIGQUIT makes the Go runtime print every goroutine's stack and
		// exit: where the shutdown waits. The process is waited for here,
		// not by started's cleanup, which would wait on it a second time.
		_ = cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case <-waited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-waited
		}
		t.Fatalf("still running %s after SIGTERM; its goroutines at SIGQUIT:\n%s", within, out)
	}
	t.Logf("stopped %s after SIGTERM", time.Since(start).Round(time.Millisecond))
}

// check-config names every bad field; config.example.toml validates and its
// summary shows no secret.
func TestCheckConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.toml")
	os.WriteFile(bad, []byte(`
[server]
drain_delay = "30s"
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
		t.Fatal("got no error for a config with four mistakes")
	}
	// drain_delay is part of shutdown_timeout (25 s by default).
	for _, field := range []string{"server.drain_delay", "database.synchronous", "queue.prefetch", "brokers[0].url"} {
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

	// Unknown keys, values of the wrong type and invalid values, all in one
	// answer; a database directory that does not exist is named.
	mixed := filepath.Join(dir, "mixed.toml")
	os.WriteFile(mixed, []byte(`
[server]
colour = "blue"
[database]
path = "`+filepath.Join(dir, "no-such-dir", "switchyard.db")+`"
busy_timeout = "soon"
[queue]
prefetch = "many"
max_attempts = -1
[frobnicate]
x = 1
[[brokers]]
url = "amqp://guest:guest@127.0.0.1:5672/"
vhostx = "y"
`), 0o600)
	err = run(context.Background(), []string{"check-config", "-config", mixed}, &stdout, &stdout)
	for _, want := range []string{"server.colour: unknown key", "frobnicate: unknown key", "brokers.vhostx: unknown key",
		`database.busy_timeout: line 6: invalid duration: "soon"`, "queue.prefetch: line 8: incompatible types",
		"queue.max_attempts:", "api.operator_token: required", "github.webhook_secret: required",
		"database.path: directory " + filepath.Join(dir, "no-such-dir") + " does not exist"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("check-config of a file with many mistakes lacks %q:\n%v", want, err)
		}
	}

	// A port that is not a number is refused before serve creates
	// anything; so is one past 65535.
	ports := filepath.Join(dir, "ports.toml")
	dbPath := filepath.Join(dir, "never.db")
	os.WriteFile(ports, []byte(`
[server]
listen = "127.0.0.1:808O"
metrics_listen = "127.0.0.1:70000"
[database]
path = "`+dbPath+`"
[api]
operator_token = "operator-token-for-tests"
producer_token = "producer-token-for-tests"
[github]
webhook_secret = "a-webhook-secret-for-tests"
[[brokers]]
url = "amqp://guest:guest@127.0.0.1:5672/"
`), 0o600)
	err = run(context.Background(), []string{"check-config", "-config", ports}, &stdout, &stdout)
	for _, want := range []string{`server.listen: want a port number from 0 to 65535, got "808O"`, `server.metrics_listen: want a port number from 0 to 65535, got "70000"`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("check-config of bad ports lacks %q:\n%v", want, err)
		}
	}
	if err := run(context.Background(), []string{"serve", "-config", ports}, &stdout, &stdout); err == nil {
		t.Error("serve took a config whose port is not a number")
	}
	if _, err := os.Stat(dbPath); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("serve with a bad port created %s (%v)", dbPath, err)
	}

	// allowed_cidrs replaces GitHub's ranges: a list that leaves them out
	// is a warning; one that takes them in is not.
	for _, c := range []struct {
		cidrs string
		warn  bool
	}{
		{`["127.0.0.0/8"]`, true},
		{`["127.0.0.0/8", "192.30.252.0/22", "185.199.108.0/22", "140.82.112.0/20", "143.55.64.0/20", "2a0a:a440::/29", "2606:50c0::/32"]`, false},
		{`["0.0.0.0/0", "::/0"]`, false},
	} {
		path := filepath.Join(dir, "cidrs.toml")
		os.WriteFile(path, []byte(`
[api]
operator_token = "operator-token-for-tests-0123456789"
producer_token = "producer-token-for-tests-0123456789"
[github]
webhook_secret = "a-webhook-secret-for-tests"
allowed_cidrs = `+c.cidrs+`
[[brokers]]
url = "amqp://guest:guest@127.0.0.1:5672/"
`), 0o600)
		stdout.Reset()
		if err := run(context.Background(), []string{"check-config", "-config", path}, &stdout, &stdout); err != nil {
			t.Fatal(err)
		}
		if got := strings.Contains(stdout.String(), "github.allowed_cidrs replaces GitHub's hooks ranges"); got != c.warn {
			t.Errorf("allowed_cidrs = %s: warned %t, want %t:\n%s", c.cidrs, got, c.warn, stdout.String())
		}
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

// A config valid before this release still starts: publish_timeout of a
// second, from before there was a spool_after to keep under it, and the
// spool's keys, retired, which check-config names with what replaced
// them. The built binary checks it and serves it, and takes a webhook.
func TestOlderConfigStarts(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr := freeAddr(t)
	config := writeConfigWith(t, dir, addr, fmt.Sprintf("path = %q", filepath.Join(dir, "switchyard.db")), "", amqpURL(newVhost(t)))
	editConfig(t, config, "[queue]\n", "[queue]\npublish_timeout = \"1s\"\nspool_after = \"500ms\"\nspool_max_bytes = 1073741824\n")
	out, code := runBinary(t, "check-config", "-config", config)
	if code != 0 {
		t.Fatalf("check-config of a config with publish_timeout = \"1s\" and the spool's keys: exit %d\n%s", code, out)
	}
	for _, want := range []string{"queue.spool_after is retired", "queue.spool_max_bytes is retired: queue.outbox_max_bytes"} {
		if !strings.Contains(out, want) {
			t.Errorf("check-config does not say %q:\n%s", want, out)
		}
	}
	cmd, served := startProcess(t, config, addr)
	if code := postWebhook(t, "http://"+addr, "issues", newGUID(), loadFixture(t, "issues", "opened")); code != http.StatusAccepted {
		t.Errorf("a webhook: %d, want 202\n%s", code, served)
	}
	stopProcess(t, cmd, served, 30*time.Second)
}

// Secrets of only spaces and short tokens are errors; tokens under 32
// characters, the example's placeholders and a file others can read are
// warnings, from check-config and from serve.
func TestConfigSecretRules(t *testing.T) {
	t.Parallel()
	base := func() *Config {
		cfg := DefaultConfig()
		cfg.API.OperatorToken = strings.Repeat("o", 40)
		cfg.API.ProducerToken = strings.Repeat("p", 40)
		cfg.GitHub.WebhookSecret = "a-real-secret-of-some-length"
		cfg.Brokers = []BrokerConfig{{URL: "amqp://guest:guest@127.0.0.1:5672/"}}
		return cfg
	}
	errs := []struct {
		name, field string
		mutate      func(c *Config)
	}{
		{"secret of spaces", "github.webhook_secret", func(c *Config) { c.GitHub.WebhookSecret = "   \t " }},
		{"previous secret of spaces", "github.previous_webhook_secrets[0]", func(c *Config) { c.GitHub.PreviousWebhookSecrets = []string{" "} }},
		{"one-character operator token", "api.operator_token", func(c *Config) { c.API.OperatorToken = "x" }},
		{"15-character producer token", "api.producer_token", func(c *Config) { c.API.ProducerToken = strings.Repeat("p", 15) }},
		{"token of spaces", "api.operator_token", func(c *Config) { c.API.OperatorToken = strings.Repeat(" ", 20) }},
		{"inflight budget under 1 MiB", "server.max_inflight_bytes", func(c *Config) { c.Server.MaxInflightBytes = 1000 }},
		{"negative retention", "database.raw_retention", func(c *Config) { c.Database.RawRetention = -1 }},
		{"retention under GitHub's redelivery window", "database.raw_retention", func(c *Config) { c.Database.RawRetention = Duration(48 * time.Hour) }},
		{"identities kept under GitHub's redelivery window", "database.delivery_retention", func(c *Config) { c.Database.DeliveryRetention = Duration(24 * time.Hour) }},
		{"no clock skew", "api.max_clock_skew", func(c *Config) { c.API.MaxClockSkew = 0 }},
		{"hook without id", "github.hooks[0].id", func(c *Config) { c.GitHub.Hooks = []HookConfig{{Secret: "its-own-secret-123"}} }},
		{"hook listed twice", "github.hooks[1].id", func(c *Config) {
			c.GitHub.Hooks = []HookConfig{{ID: 7, Secret: "its-own-secret-123"}, {ID: 7, Secret: "another-secret-456"}}
		}},
		{"hook secret of spaces", "github.hooks[0].secret", func(c *Config) { c.GitHub.Hooks = []HookConfig{{ID: 7, Secret: "  "}} }},
		{"hook previous secret empty", "github.hooks[0].previous_secrets[0]", func(c *Config) {
			c.GitHub.Hooks = []HookConfig{{ID: 7, Secret: "its-own-secret-123", PreviousSecrets: []string{""}}}
		}},
		{"hook token without repository or organization", "github.hooks[0].token", func(c *Config) {
			c.GitHub.Hooks = []HookConfig{{ID: 7, Secret: "its-own-secret-123", Token: "github_pat_x"}}
		}},
		{"hook of a repository and an organization", "github.hooks[0]", func(c *Config) {
			c.GitHub.Hooks = []HookConfig{{ID: 7, Repository: "acme/widgets", Organization: "acme", Token: "github_pat_x"}}
		}},
		{"repository hook without token or App", "github.hooks[0].token", func(c *Config) {
			c.GitHub.Hooks = []HookConfig{{ID: 7, Repository: "acme/widgets"}}
		}},
		{"repository not OWNER/NAME", "github.hooks[0].repository", func(c *Config) {
			c.GitHub.Hooks = []HookConfig{{ID: 7, Repository: "widgets", Token: "github_pat_x"}}
		}},
		{"organization not a login", "github.hooks[0].organization", func(c *Config) {
			c.GitHub.Hooks = []HookConfig{{ID: 7, Organization: "acme/widgets", Token: "github_pat_x"}}
		}},
		{"delivery window past GitHub Enterprise Server's 7 days", "github.delivery_window", func(c *Config) { c.GitHub.DeliveryWindow = 8 * 24 * time.Hour }},
		{"retention under a 7-day delivery window", "database.raw_retention", func(c *Config) {
			c.GitHub.DeliveryWindow = 7 * 24 * time.Hour
			c.Database.RawRetention = Duration(96 * time.Hour)
		}},
	}
	if err := base().Validate(); err != nil {
		t.Fatalf("base config: %v", err)
	}
	for _, tt := range errs {
		t.Run(tt.name, func(t *testing.T) {
			c := base()
			tt.mutate(c)
			if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tt.field+":") {
				t.Errorf("got %v, want an error naming %s", err, tt.field)
			}
		})
	}

	// A repository's and an organization's webhook, each with its token
	// and no secret of its own (github.webhook_secret verifies them), and
	// one on the App's installation token: taken, every token masked.
	c := base()
	c.GitHub.AppID, c.GitHub.PrivateKeyFile = 42, "/etc/switchyard/app.pem"
	c.GitHub.Hooks = []HookConfig{{ID: 9, Repository: "acme/widgets.go", Token: "github_pat_the_hooks_own_token"},
		{ID: 10, Organization: "acme-corp", Token: "github_pat_the_hooks_own_token"}, {ID: 11, Repository: "acme/gadgets"}}
	if err := c.Validate(); err != nil {
		t.Fatalf("hooks with their ledgers: %v", err)
	}
	var summary bytes.Buffer
	c.Summary(&summary)
	if strings.Contains(summary.String(), "github_pat_the_hooks_own_token") {
		t.Errorf("check-config prints a hook's token:\n%s", summary.String())
	}
	for _, want := range []string{`id = 9, secret = (unset), previous_secrets = 0 set, repository = "acme/widgets.go", token = ***`,
		`organization = "acme-corp", token = ***`, `repository = "acme/gadgets", token = (the App's installation token)`, "github.delivery_window = 72h0m0s"} {
		if !strings.Contains(summary.String(), want) {
			t.Errorf("check-config's summary lacks %q:\n%s", want, summary.String())
		}
	}

	c = base()
	c.API.OperatorToken = strings.Repeat("o", 20)
	example, err := DecodeConfig(strings.NewReader(exampleConfig))
	if err != nil {
		t.Fatal(err)
	}
	c.API.ProducerToken = example.API.ProducerToken
	c.GitHub.WebhookSecret = "abc"
	c.GitHub.Hooks = []HookConfig{{ID: 7, Secret: "abc"}, {ID: 8, Secret: "short"}}
	if err := c.Validate(); err != nil {
		t.Fatalf("warnings are not errors: %v", err)
	}
	path := filepath.Join(t.TempDir(), "switchyard.toml")
	os.WriteFile(path, nil, 0o644)
	os.Chmod(path, 0o644)
	warnings := strings.Join(c.Warnings(path), "\n")
	for _, want := range []string{"api.operator_token: 20 characters", "api.producer_token: still the placeholder", "readable by every user (mode 0644)",
		"github.webhook_secret: 3 characters; 16 or more", "github.hooks[0].secret is github.webhook_secret too",
		"github.hooks[1].secret: 5 characters"} {
		if !strings.Contains(warnings, want) {
			t.Errorf("warnings lack %q:\n%s", want, warnings)
		}
	}
	os.Chmod(path, 0o640)
	if w := base().Warnings(path); len(w) != 0 {
		t.Errorf("a good config at mode 0640 warns: %v", w)
	}

	// check-config prints them; config.example.toml starts, with warnings.
	example640 := filepath.Join(t.TempDir(), "example.toml")
	b, _ := os.ReadFile("config.example.toml")
	os.WriteFile(example640, b, 0o644)
	os.Chmod(example640, 0o644)
	var out bytes.Buffer
	if err := run(context.Background(), []string{"check-config", "-config", example640}, &out, &out); err != nil {
		t.Fatalf("check-config config.example.toml: %v", err)
	}
	for _, want := range []string{"warning: api.operator_token: still the placeholder", "warning: github.webhook_secret: still the placeholder", "warning: " + example640 + ": readable by every user"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("check-config output lacks %q:\n%s", want, out.String())
		}
	}
}

func TestUsage(t *testing.T) {
	t.Parallel()
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
		{[]string{"help", "nope"}, 2},
		{[]string{"help", "replay", "backup"}, 2},
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

// help, -h and --help print usage and exit 0: the overview, or one
// command's usage and flags; --version is version, with the Go version.
func TestHelp(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args []string
		want []string
	}{
		{[]string{"help"}, []string{"usage: switchyard COMMAND", "replay QUEUE", "check-config"}},
		{[]string{"-h"}, []string{"usage: switchyard COMMAND"}},
		{[]string{"--help"}, []string{"usage: switchyard COMMAND"}},
		{[]string{"help", "replay"}, []string{"usage: switchyard replay [-config PATH] QUEUE", "-dry-run", "-broker", "-limit"}},
		{[]string{"replay", "-h"}, []string{"usage: switchyard replay", "-dry-run"}},
		{[]string{"replay", "--help"}, []string{"usage: switchyard replay", "-dry-run"}},
		{[]string{"serve", "-h"}, []string{"usage: switchyard serve [-config PATH]", "-config", "SIGHUP"}},
		{[]string{"backup", "-help"}, []string{"usage: switchyard backup [-config PATH] DEST"}},
		{[]string{"--version"}, []string{"switchyard ", runtime.Version()}},
		{[]string{"version"}, []string{runtime.Version()}},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), tt.args, &stdout, &stderr)
			if code := exitCode(err, &stderr); code != 0 {
				t.Fatalf("exit %d: %v\n%s", code, err, stderr.String())
			}
			for _, w := range tt.want {
				if !strings.Contains(stdout.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, stdout.String())
				}
			}
			if strings.Contains(stdout.String()+stderr.String(), "help requested") {
				t.Errorf("output says 'help requested':\n%s%s", stdout.String(), stderr.String())
			}
		})
	}
}

// Only serve and migrate create a database: backup and replay on a path
// that does not exist (a relative database.path read from another
// directory) fail, saying so, and create nothing.
func TestCommandsNeedExistingDatabase(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	dir := t.TempDir()
	dbPath := filepath.Join(dir, "switchyard.db")
	config := writeConfig(t, dir, freeAddr(t), dbPath, amqpURL(vhost))
	dest := filepath.Join(dir, "backup.db")
	for _, args := range [][]string{{"backup", "-config", config, dest}, {"replay", "-config", config, "github"}} {
		var out bytes.Buffer
		err := run(context.Background(), args, &out, &out)
		if code := exitCode(err, &out); code != 1 || !strings.Contains(fmt.Sprint(err), "database "+dbPath+" does not exist") {
			t.Errorf("%s: exit %d, %v; want 1 and \"database %s does not exist\"", args[0], code, err, dbPath)
		}
	}
	for _, p := range []string{dbPath, dest} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s was created", p)
		}
	}
	var out bytes.Buffer
	if err := run(context.Background(), []string{"migrate", "-config", config}, &out, &out); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if err := run(context.Background(), []string{"backup", "-config", config, dest}, &out, &out); err != nil {
		t.Errorf("backup after migrate: %v\n%s", err, out.String())
	}
}

// Under journald each line starts with its syslog priority, so that
// `journalctl -p warning` finds warnings, child loggers included. Not
// parallel: it sets JOURNAL_STREAM for the whole process.
func TestJournalPriorities(t *testing.T) {
	t.Setenv("JOURNAL_STREAM", "8:12345")
	var buf bytes.Buffer
	log := newLogger(LogConfig{Level: "debug", Format: "text"}, new(slog.LevelVar), &buf)
	child := log.With("worker", "service")
	log.Debug("d")
	log.Info("i")
	child.Warn("w")
	child.Error("e")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	want := []string{"<7>level=DEBUG msg=d", "<6>level=INFO msg=i", "<4>level=WARN msg=w worker=service", "<3>level=ERROR msg=e worker=service"}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), len(want), buf.String())
	}
	for i := range want {
		if lines[i] != want[i] {
			t.Errorf("line %d: got %q, want %q (no time under journald)", i, lines[i], want[i])
		}
	}
}

// SIGHUP reloads the config file: a rotated webhook secret and a new log
// level take effect at once; a changed key that needs a restart is named; a
// file that does not validate changes nothing and names its bad fields. The
// daemon keeps running throughout.
func TestSIGHUPReloads(t *testing.T) {
	t.Parallel()
	config, addr, _ := processSetup(t)
	cmd, out := startProcess(t, config, addr)
	base := "http://" + addr
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, base, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("before reload: got %d", code)
	}
	orig, err := os.ReadFile(config)
	if err != nil {
		t.Fatal(err)
	}
	const rotated = "rotated-webhook-secret"
	changed := strings.Replace(string(orig), testSecret, rotated, 1)
	changed = strings.Replace(changed, `window = "2s"`, `window = "3s"`, 1)
	changed = strings.Replace(changed, `level = "info"`, `level = "debug"`, 1)
	const hookSecret = "hook-111-own-secret"
	changed += "\n[[github.hooks]]\nid = 111\nsecret = \"" + hookSecret + "\"\n"
	if err := os.WriteFile(config, []byte(changed), 0o600); err != nil {
		t.Fatal(err)
	}
	signedAs := func(hook int, secret string) int {
		r := webhookRequest(t, base, "issues", newGUID(), body)
		r.Header.Set("X-GitHub-Hook-ID", strconv.Itoa(hook))
		r.Header.Set("X-Hub-Signature-256", sign(secret, body))
		code, _ := do(t, r)
		return code
	}
	signedWith := func(secret string) int { return signedAs(testHookID, secret) }
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the rotated secret accepted", func() bool { return signedWith(rotated) == http.StatusAccepted })
	if code := signedWith(testSecret); code != http.StatusUnauthorized {
		t.Errorf("old secret after reload: got %d, want 401", code)
	}
	// The hook listed now keeps its own secret, and only it.
	if code := signedAs(111, hookSecret); code != http.StatusAccepted {
		t.Errorf("hook 111 with its own secret after reload: got %d, want 202", code)
	}
	if code := signedAs(111, rotated); code != http.StatusUnauthorized {
		t.Errorf("hook 111 with github.webhook_secret after reload: got %d, want 401", code)
	}
	eventually(t, 10*time.Second, "reload logged", func() bool {
		s := out.String()
		return strings.Contains(s, "config reloaded") && strings.Contains(s, "key=workers.window") &&
			strings.Contains(s, "level=DEBUG") // the new level is in force
	})
	if !strings.Contains(out.String(), "api.operator_token: 24 characters") {
		t.Errorf("serve does not warn of the short operator token:\n%s", out.String())
	}
	if strings.Contains(out.String(), "key=github.webhook_secret") || strings.Contains(out.String(), "key=github.hooks") {
		t.Errorf("the webhook secrets are reported as needing a restart")
	}

	// An invalid file: refused, every bad field named, nothing changes.
	bad := strings.Replace(changed, `cleanup_window = "500ms"`, `cleanup_window = "-1s"`, 1)
	bad = strings.Replace(bad, `level = "debug"`, `level = "loud"`, 1)
	if err := os.WriteFile(config, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the refusal logged", func() bool {
		return strings.Contains(out.String(), "config reload refused") && strings.Contains(out.String(), "log.level") && strings.Contains(out.String(), "workers.cleanup_window")
	})
	if code := signedWith(rotated); code != http.StatusAccepted {
		t.Errorf("after a refused reload: got %d, want 202 with the running secret (the daemon must still run)", code)
	}
}

// migrate creates the schema once and is a no-op the second time.
func TestMigrateCommand(t *testing.T) {
	t.Parallel()
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
		if n := queryInt(t, db, "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = $1", table); n != 1 {
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
	t.Parallel()
	ctx := context.Background()
	cfg := DefaultConfig().Database
	cfg.Path = filepath.Join(t.TempDir(), "old.db")
	store, err := OpenStore(ctx, cfg, nil)
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
	if err := insertOldRow(store, ev); err != nil {
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

// TestGCLimits: serve sets the configured soft memory limit and, under a
// limit, GOGC 150; the environment's GOMEMLIMIT and GOGC win, and without a
// limit the collector keeps Go's default.
func TestGCLimits(t *testing.T) {
	percent, limit := debug.SetGCPercent(100), debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetGCPercent(percent); debug.SetMemoryLimit(limit) })
	const noLimit = int64(1<<63 - 1)
	for _, c := range []struct {
		name            string
		gomemlimit, gc  string
		memoryLimit     int64
		wantPercent     int
		wantMemoryLimit int64
	}{
		{"default config", "", "", 64 << 20, gcPercentUnderLimit, 64 << 20},
		{"GOGC wins", "", "50", 48 << 20, 100, 48 << 20},
		{"no limit", "", "", 0, 100, noLimit},
		{"GOMEMLIMIT wins", "64MiB", "", 48 << 20, gcPercentUnderLimit, noLimit},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("GOMEMLIMIT", c.gomemlimit)
			t.Setenv("GOGC", c.gc)
			debug.SetGCPercent(100)
			debug.SetMemoryLimit(noLimit)
			setGCLimits(c.memoryLimit)
			if got := debug.SetGCPercent(100); got != c.wantPercent {
				t.Errorf("GOGC %d, want %d", got, c.wantPercent)
			}
			if got := debug.SetMemoryLimit(-1); got != c.wantMemoryLimit {
				t.Errorf("memory limit %d, want %d", got, c.wantMemoryLimit)
			}
		})
	}
}

// The README's two webhooks, run as written against `make run`'s config
// (its address, database and broker moved to the test's), store a row in
// github for each and one in github_pull_requests.
func TestReadmeDevWebhooks(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, ok := strings.Cut(string(readme), "<!-- make run: webhooks -->\n```sh\n")
	block, _, ok2 := strings.Cut(block, "```")
	if !ok || !ok2 {
		t.Fatal("README.md has no ```sh block after <!-- make run: webhooks -->")
	}
	makefile, _ := os.ReadFile("Makefile")
	if !regexp.MustCompile(`(?m)^CONFIG\s*\?= config\.dev\.toml$`).Match(makefile) {
		t.Fatal("make run does not use config.dev.toml")
	}
	cfg, err := LoadConfig("config.dev.toml")
	if err != nil {
		t.Fatal(err)
	}
	const devAddr = "http://127.0.0.1:8080"
	if !strings.Contains(block, devAddr) || cfg.Server.Listen != strings.TrimPrefix(devAddr, "http://") {
		t.Fatalf("the README's webhooks and config.dev.toml do not both use %s", devAddr)
	}
	cfg.Server.Listen, cfg.Server.MetricsListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Database.Path = filepath.Join(t.TempDir(), "switchyard.db")
	cfg.Brokers = []BrokerConfig{{URL: amqpURL(newVhost(t))}}
	d := startDaemon(t, cfg)

	out, err := exec.Command("bash", "-euo", "pipefail", "-c", strings.ReplaceAll(block, devAddr, d.URL)).CombinedOutput()
	if err != nil || strings.Count(string(out), `{"status":"queued"`) != 2 {
		t.Fatalf("the README's webhooks: %v\n%s", err, out)
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "a github row for each and a github_pull_requests row", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") == 2 && queryInt(t, db, "SELECT count(*) FROM github_pull_requests") == 1
	})
	if n := queryInt(t, db, "SELECT count(*) FROM github WHERE forbidden = 0 AND event IN ('ping', 'pull_request')"); n != 2 {
		t.Errorf("got %d rows of ping and pull_request taken as GitHub's, want 2", n)
	}
}

// config.example.toml shows every key with its default: decoded, it is
// DefaultConfig but for the values that have none (secrets, brokers).
func TestExampleConfigShowsDefaults(t *testing.T) {
	t.Parallel()
	example, err := DecodeConfig(strings.NewReader(exampleConfig))
	if err != nil {
		t.Fatal(err)
	}
	want := DefaultConfig()
	want.API.OperatorToken, want.API.ProducerToken = example.API.OperatorToken, example.API.ProducerToken
	want.GitHub.WebhookSecret = example.GitHub.WebhookSecret
	want.Brokers = example.Brokers
	want.set = example.set // the keys the file sets, for warnings
	// Printed, so that an empty list and none compare equal.
	if got, want := fmt.Sprintf("%+v", example), fmt.Sprintf("%+v", want); got != want {
		t.Errorf("config.example.toml differs from the defaults:\n got %s\nwant %s", got, want)
	}
}

// deliveries show tells one delivery's story: a stored one (accepted,
// stored, each worker, its typed rows), one GitHub delivered that is a gap,
// and an unknown GUID, which is an error naming it (exit 1).
func TestDeliveriesShow(t *testing.T) {
	t.Parallel()
	onBothStores(t, testDeliveriesShow)
}

func testDeliveriesShow(t *testing.T) {
	d, cfg, db := botDaemon(t)
	stored := newGUID()
	postAs(t, d.URL, "pull_request", stored, loadFixture(t, "pull_request", "opened"), true)
	waitDatabase(t, db, stored)
	postAs(t, d.URL, "pull_request", stored, loadFixture(t, "pull_request", "opened"), true) // again: a duplicate
	// A synchronize older than the stored row: stale.
	stale := newGUID()
	postAs(t, d.URL, "pull_request", stale, mutate(t, loadFixture(t, "pull_request", "synchronize"), func(p map[string]any) {
		obj(p, "pull_request")["updated_at"] = "2001-01-01T00:00:00Z"
	}), true)
	waitDatabase(t, db, stale)
	eventually(t, 20*time.Second, "the duplicate counted", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND duplicates = 1", stored) == 1
	})
	gap := newGUID()
	if err := d.store.WriteTx(context.Background(), func(tx *Tx) error {
		_, err := tx.RecordGap(context.Background(), deliveryGap{GUID: gap, DeliveryID: 7, Event: "issues",
			DeliveredAt: time.Now().Add(-5 * time.Hour), FoundAt: time.Now()}, nil)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	failed := eventMessage("issues", newGUID(), loadFixture(t, "issues", "opened"))
	failed.Headers[hdrErrorReason] = "issues: payload has no issue.node_id or issue.number"
	publishRaw(t, d.brokers.List()[0].Vhost, "", errorQueue(queueGitHub), failed)
	config := writeConfigWith(t, t.TempDir(), "127.0.0.1:1", databaseKeys(cfg.Database), "", cfg.Brokers[0].URL)
	show := func(args ...string) (string, error) {
		var out bytes.Buffer
		err := run(context.Background(), append([]string{"deliveries", "-config", config}, args...), &out, &out)
		return out.String(), err
	}
	out, err := show("show", stored)
	for _, want := range []string{"pull_request.opened on octo-org/switchyard-demo by mona", "accepted", "sent to integration 4242",
		"worker service", "stored the github row", "worker database-service", "stored", "typed row", "github_pull_requests PR_kwDOKtN3FM5yp7Bb", "payload"} {
		if err != nil || !strings.Contains(out, want) {
			t.Errorf("show of a stored delivery lacks %q (%v):\n%s", want, err, out)
		}
	}
	if b := d.brokers.List()[0]; !strings.Contains(out, "came through "+b.Host+" vhost "+b.Vhost) {
		t.Errorf("show of a stored delivery does not name the broker it came through:\n%s", out)
	}
	if !strings.Contains(out, "received again 1 time after it was stored") {
		t.Errorf("show of a duplicated delivery does not say it came again:\n%s", out)
	}
	if out, err := show("show", stored, "-hook", strconv.Itoa(testHookID)); err != nil || !strings.Contains(out, fmt.Sprintf("hook %d,", testHookID)) {
		t.Errorf("show -hook of the copy's hook: %v\n%s", err, out)
	}
	if _, err := show("show", stored, "-hook", "999"); !errors.Is(err, ErrUnknownDelivery) {
		t.Errorf("show -hook of a hook with no copy: %v, want ErrUnknownDelivery", err)
	}
	if out, err := show("show", stale); err != nil || !strings.Contains(out, "stale: the typed row held a newer object") {
		t.Errorf("show of a stale delivery: %v\n%s", err, out)
	}
	out, err = show("-json", "show", stored)
	var st DeliveryStory
	if err != nil || json.Unmarshal([]byte(out), &st) != nil || len(st.Copies) != 1 || st.Copies[0].Received == nil ||
		st.Copies[0].Received.Event != "pull_request" || len(st.Copies[0].Rows) == 0 {
		t.Errorf("show -json: %v\n%s", err, out)
	}
	out, err = show("show", gap)
	if err != nil || !strings.Contains(out, "gap") || !strings.Contains(out, "not in github") {
		t.Errorf("show of a gap: %v\n%s", err, out)
	}
	out, err = show("show", failed.MessageId)
	if err != nil || !strings.Contains(out, "in github-error") || !strings.Contains(out, "payload has no issue.node_id") {
		t.Errorf("show of a delivery waiting in github-error: %v\n%s", err, out)
	}
	_, err = show("show", "no-such-delivery")
	if !errors.Is(err, ErrUnknownDelivery) || exitCode(err, io.Discard) != 1 || !strings.Contains(err.Error(), "no-such-delivery") {
		t.Errorf("show of an unknown GUID: %v, want ErrUnknownDelivery naming it, exit 1", err)
	}
}

// deliveries show finds a delivery failing for a passing reason in its
// -retry queue, with its failures so far, and leaves it there.
func TestDeliveriesShowRetrying(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	declareTestTopology(t, vhost, time.Hour) // it waits there while the test looks
	dir := t.TempDir()
	config := writeConfig(t, dir, "127.0.0.1:1", filepath.Join(dir, "switchyard.db"), amqpURL(vhost))
	var out bytes.Buffer
	if err := run(context.Background(), []string{"migrate", "-config", config}, &out, &out); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out.String())
	}
	msg := eventMessage("issues", newGUID(), loadFixture(t, "issues", "opened"))
	msg.Headers["x-death"] = []any{amqp.Table{"queue": queueDatabase, "reason": "rejected", "count": int64(2)}}
	publishRaw(t, vhost, "", retryQueue(queueDatabase), msg)
	out.Reset()
	if err := run(context.Background(), []string{"deliveries", "-config", config, "show", msg.MessageId}, &out, &out); err != nil {
		t.Fatalf("deliveries show: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "in github-database-retry") || !strings.Contains(out.String(), "attempts 2") {
		t.Errorf("deliveries show of a delivery in github-database-retry:\n%s", out.String())
	}
	if n := ready(t, vhost, retryQueue(queueDatabase)); n != 1 {
		t.Errorf("github-database-retry holds %d after the look, want the message still there", n)
	}
}

// SIGTERM while a worker's transaction, the leases and the usage flush
// wait on a database another process holds locked (SQLite with
// busy_timeout longer than shutdown_timeout; PostgreSQL waiting on its
// table locks): the whole shutdown ends within shutdown_timeout, the wait
// given up, the message in hand left unacknowledged, the process exiting
// 0 while the lock still holds, with no use of a closed store; after a
// restart every webhook is stored exactly once.
func TestShutdownTimeoutAbandonsLockedWork(t *testing.T) {
	t.Parallel()
	const shutdownTimeout, busyTimeout = 3 * time.Second, 60 * time.Second
	onBothStores(t, func(t *testing.T) {
		store := testStore(t)
		database := fmt.Sprintf("path = %q\nbusy_timeout = %q", store.Path, busyTimeout.String())
		var lock func(t *testing.T) (unlock func())
		if store.Driver == "postgres" {
			database = fmt.Sprintf("driver = \"postgres\"\nurl = %q", store.URL)
			lock = func(t *testing.T) func() {
				tx, err := openWritableDB(t, store).Begin()
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx.Exec(`LOCK TABLE github, leases, nodes, broker_usage, worker_deliveries, github_statistics_6h,
					settings IN ACCESS EXCLUSIVE MODE`); err != nil {
					t.Fatal(err)
				}
				return func() { tx.Rollback() }
			}
		} else {
			lock = func(t *testing.T) func() {
				locker, err := sql.Open("sqlite", "file:"+store.Path+"?_pragma=busy_timeout(5000)")
				if err != nil {
					t.Fatal(err)
				}
				conn, err := locker.Conn(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if _, err := conn.ExecContext(context.Background(), "BEGIN IMMEDIATE"); err != nil {
					t.Fatal(err)
				}
				return func() {
					conn.ExecContext(context.Background(), "ROLLBACK")
					conn.Close()
					locker.Close()
				}
			}
		}
		vhost := newVhost(t)
		dir := t.TempDir()
		addr := freeAddr(t)
		config := writeConfigWith(t, dir, addr, database, fmt.Sprintf("shutdown_timeout = %q", shutdownTimeout.String()), amqpURL(vhost))
		cmd, out := startProcess(t, config, addr)
		body := loadFixture(t, "issues", "opened")
		db := openStoreDB(t, store)
		firstStored(t, addr, db, body)
		// The leases held, so that the shutdown has them to give up.
		eventually(t, 20*time.Second, "the leases held", func() bool {
			return scrapeWith(http.DefaultClient, "http://"+addr+"/metrics", "switchyard_lease_held")[jobAlerts] == 1
		})

		// Another process's write lock, held until the daemon has exited.
		unlock := lock(t)
		locked := newGUID()
		if code := postWebhook(t, "http://"+addr, "issues", locked, body); code != http.StatusAccepted {
			t.Fatalf("webhook under the lock: %d", code)
		}
		// In a worker's hand: delivered and not acknowledged. None ready
		// alone is not enough: the webhook is committed to the outbox first,
		// and may not have been published yet.
		eventually(t, 20*time.Second, "the message in a worker's hand", func() bool {
			return unacked(t, vhost, queueGitHub) >= 1
		})

		// Within shutdown_timeout (and the second a process takes to
		// exit on a loaded machine), the lock still held.
		stopProcess(t, cmd, out, shutdownTimeout+time.Second)
		for _, bad := range []string{"database is closed", "sql: database is closed", "level=ERROR"} {
			if strings.Contains(out.String(), bad) {
				t.Errorf("the log has %q:\n%s", bad, out)
			}
		}
		// Left at the deadline, or handed back as the database was
		// called lost (PostgreSQL's lease renewal times out first).
		if !strings.Contains(out.String(), "left unacknowledged") && !strings.Contains(out.String(), "handed back unacknowledged") {
			t.Errorf("the log does not say the message in hand was left:\n%s", out)
		}
		unlock()

		startProcess(t, config, addr)
		eventually(t, 30*time.Second, "the webhook in hand at shutdown stored after the restart", func() bool {
			return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", locked) == 1
		})
		if n := queryInt(t, db, "SELECT count(*) FROM github"); n != 2 {
			t.Errorf("github rows: %d, want each webhook once", n)
		}
		if n := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h"); n != 2 {
			t.Errorf("statistics: %d, want 2", n)
		}
	})
}

// A broker that stops answering just before SIGTERM holds the shutdown
// no longer than shutdown_timeout, its calls and dials (call_timeout,
// longer) given up: with the connections up (a consumer attached, a
// webhook's publish waiting for its confirm), or with them cut and dialed
// again, the handshake unanswered. The webhook taken meanwhile, still in
// the outbox, is stored once after a restart on a broker that answers.
func TestShutdownWithinTimeoutOnStalledBroker(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cut  bool
	}{{"calls under way", false}, {"dials under way", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const shutdownTimeout = 3 * time.Second
			vhost := newVhost(t)
			proxy := newTCPProxy(t, testBrokerAddr())
			dir := t.TempDir()
			addr := freeAddr(t)
			dbPath := filepath.Join(dir, "switchyard.db")
			database := fmt.Sprintf("path = %q", dbPath)
			server := fmt.Sprintf("shutdown_timeout = %q", shutdownTimeout.String())
			config := writeConfigWith(t, dir, addr, database, server, proxy.URL(vhost))
			cmd, out := startProcess(t, config, addr)
			body := loadFixture(t, "issues", "opened")
			db := openDB(t, dbPath)
			firstStored(t, addr, db, body)

			proxy.Stall(true)
			if tc.cut {
				proxy.Cut()
				eventually(t, 20*time.Second, "a connection dialed again", func() bool {
					proxy.mu.Lock()
					defer proxy.mu.Unlock()
					return len(proxy.conns) > 0
				})
			}
			stalled := newGUID()
			if code := postWebhook(t, "http://"+addr, "issues", stalled, body); code != http.StatusAccepted {
				t.Fatalf("webhook with the broker stalled: %d", code)
			}
			stopProcess(t, cmd, out, shutdownTimeout+time.Second)
			if !proxy.isStalled() {
				t.Fatal("the stall ended before the shutdown did")
			}
			proxy.Stall(false)
			proxy.Cut()

			config = writeConfigWith(t, dir, addr, database, server, amqpURL(vhost))
			startProcess(t, config, addr)
			eventually(t, 30*time.Second, "the webhook taken during the stall stored after the restart", func() bool {
				return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", stalled) == 1
			})
			if n := queryInt(t, db, "SELECT count(*) FROM github"); n != 2 {
				t.Errorf("github rows: %d, want each webhook once", n)
			}
		})
	}
}

// firstStored posts an issues webhook of body to the process at addr and
// waits until db holds it.
func firstStored(t *testing.T, addr string, db *sql.DB, body []byte) {
	t.Helper()
	guid := newGUID()
	if code := postWebhook(t, "http://"+addr, "issues", guid, body); code != http.StatusAccepted {
		t.Fatalf("webhook: %d", code)
	}
	eventually(t, 20*time.Second, "the first webhook stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
	})
}

// database.driver = "postgres" takes a URL, whose password check-config
// never prints; SQLite's keys set beside it are a warning that they do
// not apply; backup points at pg_dump.
func TestPostgresConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, database string) string {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(`
[database]
`+database+`
[api]
operator_token = "operator-token-for-tests-0123456789"
producer_token = "producer-token-for-tests-0123456789"
[github]
webhook_secret = "a-webhook-secret-for-tests"
[[brokers]]
url = "amqp://guest:guest@127.0.0.1:5672/"
`), 0o600)
		return p
	}
	var out bytes.Buffer
	good := write("pg.toml", "driver = \"postgres\"\nurl = \"postgres://sy:pg-s3cret@db.example:5432/switchyard?sslmode=require\"\npath = \"/nowhere/x.db\"\nsynchronous = \"NORMAL\"")
	if err := run(context.Background(), []string{"check-config", "-config", good}, &out, &out); err != nil {
		t.Fatalf("check-config: %v\n%s", err, out.String())
	}
	for _, want := range []string{`database.driver = "postgres", url = postgres://sy:***@db.example:5432/switchyard?sslmode=require`,
		"warning: database.path, database.synchronous set, but they are SQLite's"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("check-config of a PostgreSQL config lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "pg-s3cret") {
		t.Errorf("check-config shows the database password:\n%s", out.String())
	}
	// A pooler's usual port without the query mode a pooler in
	// transaction mode needs is a warning; with it, none.
	for url, warned := range map[string]bool{
		"postgres://sy:pw@pgbouncer:6432/switchyard":                                    true,
		"postgres://sy:pw@db1:5432,pgbouncer:6432/switchyard?sslmode=require":           true,
		"postgres://sy:pw@pgbouncer:6432/switchyard?default_query_exec_mode=exec":       false,
		"postgres://sy:pw@db1:5432,db2:5432/switchyard?target_session_attrs=read-write": false,
	} {
		out.Reset()
		p := write("pooler.toml", fmt.Sprintf("driver = \"postgres\"\nurl = %q", url))
		if err := run(context.Background(), []string{"check-config", "-config", p}, &out, &out); err != nil {
			t.Fatalf("check-config of %s: %v\n%s", url, err, out.String())
		}
		if got := strings.Contains(out.String(), "is a pooler's (PgBouncer's) usual port"); got != warned {
			t.Errorf("check-config of %s: warned %v, want %v:\n%s", url, got, warned, out.String())
		}
	}
	for _, c := range []struct{ database, want string }{
		{`driver = "postgres"`, "database.url: required"},
		{"driver = \"postgres\"\nurl = \"mysql://x@y/z\"", "database.url: want a postgres:// URL"},
		{"driver = \"postgres\"\nurl = \"postgres://u:p@h:5432/d\"\nmax_conns = 0", "database.max_conns: at least 1"},
		{`driver = "oracle"`, `database.driver: want "sqlite" or "postgres"`},
	} {
		err := run(context.Background(), []string{"check-config", "-config", write("bad.toml", c.database)}, &out, &out)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), ":p@") {
			t.Errorf("check-config of %q: %v, want %q", c.database, err, c.want)
		}
	}
	err := run(context.Background(), []string{"backup", "-config", good, filepath.Join(dir, "b.db")}, &out, &out)
	if err == nil || !strings.Contains(err.Error(), "pg_dump") {
		t.Errorf("backup on PostgreSQL: %v, want it to point at pg_dump", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "b.db")); err == nil {
		t.Error("backup on PostgreSQL left a file")
	}
}
