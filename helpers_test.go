package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace/noop"
)

// These tests talk to a real broker and real SQLite files: by default the
// local RabbitMQ on 127.0.0.1:5672, or the AMQP 0-9-1 broker
// SWITCHYARD_TEST_AMQP_URL names (its user must be able to use any vhost
// it is given), with its test vhosts made and removed through
// SWITCHYARD_TEST_MANAGEMENT_URL, a RabbitMQ-compatible HTTP API such as
// http://guest:guest@127.0.0.1:15672 (LavinMQ has one), or rabbitmqctl
// when that is unset. Each test makes its own vhosts, so no test sees
// another's messages. Tests that need rabbitmqctl itself (alarms, policies,
// the node's settings, stopping it) skip on another broker, saying so.

const testSecret = "test-webhook-secret"

// testBroker is the broker the tests run against, read once.
var testBroker = sync.OnceValue(func() (b struct {
	url  *url.URL // with the path (vhost) left out
	mgmt string   // the management API's base URL, "" for rabbitmqctl
	// local: the local RabbitMQ, which rabbitmqctl drives.
	local bool
}) {
	raw := os.Getenv("SWITCHYARD_TEST_AMQP_URL")
	b.local = raw == ""
	if raw == "" {
		raw = "amqp://guest:guest@127.0.0.1:5672/"
	}
	u, err := url.Parse(raw)
	if err != nil {
		panic(fmt.Sprintf("SWITCHYARD_TEST_AMQP_URL: %v", err))
	}
	u.Path, u.RawPath = "/", ""
	b.url = u
	b.mgmt = strings.TrimRight(os.Getenv("SWITCHYARD_TEST_MANAGEMENT_URL"), "/")
	return b
})

// testBrokerAddr is the host:port of the broker the tests run against, for
// the proxies tests put in front of it.
func testBrokerAddr() string {
	u := testBroker().url
	if u.Port() == "" {
		return u.Hostname() + ":5672"
	}
	return u.Host
}

// needRabbitmqctl skips a test that drives the local RabbitMQ node with
// rabbitmqctl when the tests run against another broker.
func needRabbitmqctl(t testing.TB) {
	t.Helper()
	if !testBroker().local {
		t.Skip("needs rabbitmqctl on the local RabbitMQ; SWITCHYARD_TEST_AMQP_URL names another broker")
	}
}

// newVhost gives the test a fresh vhost of its own, deleted after it.
func newVhost(t testing.TB) string {
	t.Helper()
	mgmt := testBroker().mgmt
	if mgmt == "" {
		name := localVhosts.take(t)
		t.Logf("vhost %s", name)
		t.Cleanup(func() { localVhosts.release(t, name) })
		return name
	}
	name := "sy-" + strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(name) > 40 {
		name = name[:40]
	}
	name += "-" + randHex(4)
	user := testBroker().url.User.Username()
	management(t, http.MethodPut, mgmt+"/api/vhosts/"+url.PathEscape(name), "")
	management(t, http.MethodPut, mgmt+"/api/permissions/"+url.PathEscape(name)+"/"+url.PathEscape(user),
		`{"configure":".*","write":".*","read":".*"}`)
	t.Cleanup(func() { management(t, http.MethodDelete, mgmt+"/api/vhosts/"+url.PathEscape(name), "") })
	return name
}

// localVhosts makes and deletes the local RabbitMQ's test vhosts a batch
// at a time: each rabbitmqctl starts an Erlang VM (about a second of CPU),
// and a vhost made and deleted on its own took three, some 700 s of CPU
// over the suite.
var localVhosts vhostBatches

// vhostBatch is how many vhosts one rabbitmqctl makes or deletes.
const vhostBatch = 8

type vhostBatches struct {
	mu    sync.Mutex
	ready []string // made, not yet taken
	done  []string // their tests ended, not yet deleted
}

// take returns a vhost made for the tests, with every permission for the
// tests' user, making a batch when none is left.
func (v *vhostBatches) take(t testing.TB) string {
	t.Helper()
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.ready) == 0 {
		type perm struct {
			User      string `json:"user"`
			Vhost     string `json:"vhost"`
			Configure string `json:"configure"`
			Write     string `json:"write"`
			Read      string `json:"read"`
		}
		var defs struct {
			Vhosts      []map[string]string `json:"vhosts"`
			Permissions []perm              `json:"permissions"`
		}
		user := testBroker().url.User.Username()
		var names []string
		for range vhostBatch {
			name := "sy-" + randHex(6)
			names = append(names, name)
			defs.Vhosts = append(defs.Vhosts, map[string]string{"name": name})
			defs.Permissions = append(defs.Permissions, perm{user, name, ".*", ".*", ".*"})
		}
		b, _ := json.Marshal(defs)
		cmd := exec.Command("rabbitmqctl", "-q", "import_definitions", "--format", "json") // from stdin
		cmd.Stdin = bytes.NewReader(b)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("rabbitmqctl import_definitions (the tests' vhosts): %v: %s", err, out)
		}
		v.ready = names
	}
	name := v.ready[len(v.ready)-1]
	v.ready = v.ready[:len(v.ready)-1]
	return name
}

// release deletes name with the vhosts released before it once they make
// a batch; flush deletes the rest.
func (v *vhostBatches) release(t testing.TB, name string) {
	v.mu.Lock()
	v.done = append(v.done, name)
	var names []string
	if len(v.done) >= vhostBatch {
		names, v.done = v.done, nil
	}
	v.mu.Unlock()
	if err := deleteVhosts(names); err != nil {
		t.Logf("deleting the tests' vhosts %v: %v", names, err)
	}
}

// flush deletes every vhost made and not yet deleted.
func (v *vhostBatches) flush() error {
	v.mu.Lock()
	names := append(v.done, v.ready...)
	v.done, v.ready = nil, nil
	v.mu.Unlock()
	return deleteVhosts(names)
}

// deleteVhosts deletes names on the local RabbitMQ in one rabbitmqctl.
func deleteVhosts(names []string) error {
	if len(names) == 0 {
		return nil
	}
	var list []string
	for _, n := range names {
		list = append(list, "<<\""+n+"\">>")
	}
	expr := "[rabbit_vhost:delete(V, <<\"switchyard-tests\">>) || V <- [" + strings.Join(list, ", ") + "]]."
	if out, err := exec.Command("rabbitmqctl", "-q", "eval", expr).CombinedOutput(); err != nil {
		return fmt.Errorf("%v: %s", err, out)
	}
	return nil
}

// managementGet reads path (such as /api/queues/VHOST) of the test
// broker's management API into v; ok is false when the tests use
// rabbitmqctl instead (no SWITCHYARD_TEST_MANAGEMENT_URL).
func managementGet(t testing.TB, path string, v any) (ok bool) {
	t.Helper()
	mgmt := testBroker().mgmt
	if mgmt == "" {
		return false
	}
	var body bytes.Buffer
	managementDo(t, http.MethodGet, mgmt+path, "", &body)
	if err := json.Unmarshal(body.Bytes(), v); err != nil {
		t.Fatalf("management API GET %s: %v", path, err)
	}
	return true
}

// management sends one request to the management API, with the user and
// password its URL carries.
func management(t testing.TB, method, rawURL, body string) {
	t.Helper()
	managementDo(t, method, rawURL, body, io.Discard)
}

// managementDo is management, writing the answer's body to out.
func managementDo(t testing.TB, method, rawURL, body string, out io.Writer) {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	user := u.User
	u.User = nil
	req, err := http.NewRequest(method, u.String(), strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if user != nil {
		pw, _ := user.Password()
		req.SetBasicAuth(user.Username(), pw)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Close = true // no idle connection left behind: the tests check for goroutines
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("management API %s %s: %v", method, u.Path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 && !(method == http.MethodDelete && resp.StatusCode == http.StatusNotFound) {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		t.Fatalf("management API %s %s: %d %s", method, u.Path, resp.StatusCode, b)
	}
	if _, err := io.Copy(out, resp.Body); err != nil {
		t.Fatalf("management API %s %s: %v", method, u.Path, err)
	}
}

// newBrokerUser makes a user of the test broker with a password of its
// own and the given permissions (regular expressions; "" allows nothing)
// on vhost, and deletes it when the test ends.
func newBrokerUser(t testing.TB, vhost, configure, write, read string) (user, password string) {
	t.Helper()
	user, password = "sy-user-"+randHex(4), randHex(12)
	if mgmt := testBroker().mgmt; mgmt != "" {
		management(t, http.MethodPut, mgmt+"/api/users/"+user, fmt.Sprintf(`{"password":%q,"tags":""}`, password))
		management(t, http.MethodPut, mgmt+"/api/permissions/"+url.PathEscape(vhost)+"/"+user,
			fmt.Sprintf(`{"configure":%q,"write":%q,"read":%q}`, configure, write, read))
		t.Cleanup(func() { management(t, http.MethodDelete, mgmt+"/api/users/"+user, "") })
		return user, password
	}
	rabbitmqctl(t, "add_user", user, password)
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "-q", "delete_user", user).Run() })
	rabbitmqctl(t, "set_permissions", "-p", vhost, user, configure, write, read)
	return user, password
}

// rabbitmqctl runs rabbitmqctl on the local node; a test that needs it
// skips on another broker.
func rabbitmqctl(t testing.TB, args ...string) {
	t.Helper()
	needRabbitmqctl(t)
	out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl %v: %v: %s", args, err, out)
	}
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func newGUID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// amqpURL is the test broker's URL for vhost.
func amqpURL(vhost string) string {
	u := *testBroker().url
	return u.String() + url.PathEscape(vhost)
}

// testConfig is a valid config over the given broker URLs, with short
// durations so that windows, retries and switches happen within a test.
func testConfig(t testing.TB, brokerURLs ...string) *Config {
	t.Helper()
	cfg := DefaultConfig()
	// /metrics on the API listener, which tests scrape.
	cfg.Server.Listen, cfg.Server.MetricsListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Server.TrustedProxies = []string{"127.0.0.2"}
	cfg.Database = testStore(t)
	cfg.API.OperatorToken = "operator-token-for-tests"
	cfg.API.ProducerToken = "producer-token-for-tests"
	cfg.GitHub.WebhookSecret = testSecret
	cfg.GitHub.AllowedCIDRs = []string{"127.0.0.0/8", "::1/128"}
	cfg.Queue.DeclareTopology = true
	cfg.Queue.RetryTTL = 200 * time.Millisecond
	cfg.Queue.PublishTimeout = 5 * time.Second // the default: a loaded machine's first confirms may take seconds
	cfg.Queue.CallTimeout = 3 * time.Second
	cfg.Workers.Window = 2 * time.Second
	cfg.Workers.PendingCheckInterval = 300 * time.Millisecond
	cfg.Workers.CleanupEvery = time.Second
	cfg.Workers.CleanupWindow = 500 * time.Millisecond
	cfg.Log.Level = "debug"
	for _, u := range brokerURLs {
		cfg.Brokers = append(cfg.Brokers, BrokerConfig{URL: u})
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("test config: %v", err)
	}
	return cfg
}

// testLogger writes to the test log, and keeps every line for tests that
// read them.
type logSink struct {
	t  testing.TB
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *logSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	s.b.Write(p)
	s.mu.Unlock()
	s.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func (s *logSink) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// testDaemon is a Daemon running in this process.
type testDaemon struct {
	*Daemon
	URL    string
	logs   *logSink
	cancel context.CancelFunc
	done   chan error
}

// startDaemon runs a Daemon with cfg until the test ends (or stop is called).
func startDaemon(t *testing.T, cfg *Config) *testDaemon {
	t.Helper()
	sink := &logSink{t: t}
	log := slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithCancel(context.Background())
	withMigratedStore(t, cfg.Database)
	d, err := NewDaemon(ctx, cfg, log)
	if err != nil {
		cancel()
		t.Fatalf("NewDaemon: %v", err)
	}
	ln, err := net.Listen("tcp", cfg.Server.Listen)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	td := &testDaemon{Daemon: d, URL: "http://" + ln.Addr().String(), logs: sink, cancel: cancel, done: make(chan error, 1)}
	go func() { td.done <- errors.Join(d.Run(ctx, Listeners{API: ln}, nil), d.Close()) }()
	t.Cleanup(func() { td.stop(t) })
	return td
}

// stop shuts the daemon down and waits for it; calling it twice is fine.
func (td *testDaemon) stop(t *testing.T) {
	t.Helper()
	if td.cancel == nil {
		return
	}
	td.cancel()
	td.cancel = nil
	select {
	case err := <-td.done:
		if err != nil {
			t.Errorf("daemon Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("daemon did not stop within 30s")
	}
}

func sign(secret string, body []byte) string {
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write(body)
	return "sha256=" + hex.EncodeToString(mac.Sum(nil))
}

// testHookID is the X-GitHub-Hook-ID of webhookRequest's deliveries: a
// repository webhook's.
const testHookID = 123456

// webhookRequest builds a signed GitHub-style delivery.
func webhookRequest(t testing.TB, url, event, guid string, body []byte) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+"/webhooks/github", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-GitHub-Event", event)
	req.Header.Set("X-GitHub-Delivery", guid)
	req.Header.Set("X-GitHub-Hook-ID", strconv.Itoa(testHookID))
	req.Header.Set("X-GitHub-Hook-Installation-Target-Type", "repository")
	req.Header.Set("X-GitHub-Hook-Installation-Target-ID", "35129377")
	req.Header.Set("X-Hub-Signature-256", sign(testSecret, body))
	return req
}

// do sends req and returns the status and body.
func do(t testing.TB, req *http.Request) (int, string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// answerWhileStalled sends a signed delivery while the broker is stalled or
// gone and returns the response, failing the test when none comes within
// 30 s (the tests that stall a broker set publish_timeout to a second or so): the answer is
// publish_timeout's doing, not the broker's, since the stall still holds.
func answerWhileStalled(t testing.TB, url string, body []byte) *http.Response {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := http.DefaultClient.Do(webhookRequest(t, url, "issues", newGUID(), body).WithContext(ctx))
	if err != nil {
		t.Fatalf("no answer while the broker is stalled: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// postWebhook sends a signed delivery and returns the status.
func postWebhook(t testing.TB, url, event, guid string, body []byte) int {
	t.Helper()
	code, _ := do(t, webhookRequest(t, url, event, guid, body))
	return code
}

// payloadDir holds the webhook payloads the tests send: one folder per
// event, a file per action (or variant), written after the shapes GitHub
// documents for each event; malformed/ holds the ones the workers refuse.
const payloadDir = "testdata/payloads"

// fixture is one payload of payloadDir, or of a recorded corpus.
type fixture struct {
	Event string
	Name  string
	Body  []byte
}

// loadFixtures reads every well-formed payload of payloadDir.
func loadFixtures(t testing.TB) []fixture {
	t.Helper()
	return readFixtures(t, payloadDir)
}

// readFixtures reads dir/EVENT/*.json, in a stable order, leaving out
// malformed/.
func readFixtures(t testing.TB, dir string) []fixture {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(dir, "*", "*.json"))
	if err != nil || len(paths) == 0 {
		t.Fatalf("no payloads found under %s: %v", dir, err)
	}
	sort.Strings(paths)
	var fs []fixture
	for _, p := range paths {
		event := filepath.Base(filepath.Dir(p))
		if event == "malformed" {
			continue
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		fs = append(fs, fixture{Event: event, Name: filepath.Base(p), Body: b})
	}
	return fs
}

// loadFixture is one payload of payloadDir: the event's folder, the
// action's (or variant's) file without ".json".
func loadFixture(t testing.TB, event, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(payloadDir, event, name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// openDB opens the test's database file read-only, for assertions.
// testPostgresURL is the PostgreSQL server the tests make their databases
// on: SWITCHYARD_TEST_POSTGRES_URL, by default the local one.
func testPostgresURL() string {
	if u := os.Getenv("SWITCHYARD_TEST_POSTGRES_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// testPostgres is a connection to that server, or why there is none.
var testPostgres = sync.OnceValues(func() (*sql.DB, error) {
	db, err := sql.Open("pgx", testPostgresURL())
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, err
	}
	db.SetMaxOpenConns(4)
	return db, nil
})

// needPostgres returns the test server's connection; without one the test
// skips, saying so, except under CI=true, where it fails.
func needPostgres(t testing.TB) *sql.DB {
	t.Helper()
	db, err := testPostgres()
	if err != nil {
		msg := fmt.Sprintf("no PostgreSQL answers at SWITCHYARD_TEST_POSTGRES_URL (%s): %v", redactDatabaseURL(testPostgresURL()), err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return db
}

// newPostgresDatabase makes a PostgreSQL database of the test's own and
// drops it when the test ends; it returns its URL.
func newPostgresDatabase(t testing.TB) string {
	t.Helper()
	admin := needPostgres(t)
	name := "sy_" + strings.ToLower(strings.NewReplacer("/", "_", "-", "_").Replace(t.Name()))
	name = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_' {
			return r
		}
		return '_'
	}, name)
	if len(name) > 40 {
		name = name[:40]
	}
	name += "_" + randHex(4)
	if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
		t.Fatalf("create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)"); err != nil {
			t.Logf("drop database %s: %v", name, err)
		}
	})
	u, err := url.Parse(testPostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String()
}

// postgresConfig is a database config of a PostgreSQL database of the
// test's own.
func postgresConfig(t testing.TB) DatabaseConfig {
	t.Helper()
	db := DefaultConfig().Database
	db.Driver, db.URL, db.MaxConns = "postgres", newPostgresDatabase(t), 4
	return db
}

// onBothStores runs fn twice, as parallel subtests: on SQLite ("sqlite")
// and on PostgreSQL ("postgres"), which testStore then gives fn's test
// and its subtests. Every behaviour of the store holds on both.
func onBothStores(t *testing.T, fn func(t *testing.T)) {
	t.Helper()
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		fn(t)
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		needPostgres(t)
		testStores.Store(t.Name(), "postgres")
		t.Cleanup(func() { testStores.Delete(t.Name()) })
		fn(t)
	})
}

// testStores are, by test name, the dialect onBothStores gave a test
// ("postgres"), and the PostgreSQL databases made for tests under it.
var testStores sync.Map

// testStore is the database a test runs on. Under onBothStores'
// "postgres", a PostgreSQL database of the test's own, the same one for
// every call in one test; else, as for every other test, an SQLite file
// of its own, a new one at each call.
func testStore(t testing.TB) DatabaseConfig {
	t.Helper()
	if db, ok := testStores.Load("db:" + t.Name()); ok {
		return db.(DatabaseConfig)
	}
	for name := t.Name(); name != ""; {
		if v, ok := testStores.Load(name); ok && v == "postgres" {
			cfg := postgresConfig(t)
			testStores.Store("db:"+t.Name(), cfg)
			t.Cleanup(func() { testStores.Delete("db:" + t.Name()) })
			return cfg
		}
		i := strings.LastIndex(name, "/")
		if i < 0 {
			break
		}
		name = name[:i]
	}
	db := DefaultConfig().Database
	db.Path = filepath.Join(t.TempDir(), "switchyard.db")
	return db
}

// migratedTemplate is the file of an SQLite database migrated once for
// the whole test binary, which withMigratedStore copies.
var migratedTemplate = sync.OnceValues(func() ([]byte, error) {
	dir, err := os.MkdirTemp("", "switchyard-template")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	cfg := DefaultConfig().Database
	cfg.Path = filepath.Join(dir, "switchyard.db")
	store, err := OpenStore(context.Background(), cfg, nil)
	if err != nil {
		return nil, err
	}
	_, _, err = store.Migrate(context.Background())
	// Closing the last connection folds the WAL into the file.
	if err = errors.Join(err, store.Close()); err != nil {
		return nil, err
	}
	if fi, err := os.Stat(cfg.Path + "-wal"); err == nil && fi.Size() > 0 {
		return nil, fmt.Errorf("%s-wal left with %d bytes: the copy would lack them", cfg.Path, fi.Size())
	}
	return os.ReadFile(cfg.Path)
})

// withMigratedStore puts a migrated SQLite database at db's path when
// nothing is there yet, so that the daemon or the parts about to open it
// find the schema current. Migrating from nothing parses every
// migration's SQL, which under the race detector was a fifth of the test
// process's CPU over the suite; the tests of migrating open their databases
// themselves. A PostgreSQL database, or a file a test made, is left as it
// is.
func withMigratedStore(t testing.TB, db DatabaseConfig) {
	t.Helper()
	if db.Driver == "postgres" {
		return
	}
	if _, err := os.Stat(db.Path); !errors.Is(err, os.ErrNotExist) {
		return
	}
	b, err := migratedTemplate()
	if err != nil {
		t.Fatalf("the migrated template database: %v", err)
	}
	if err := os.WriteFile(db.Path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// databaseKeys are the [database] table's keys of cfg, for a config file.
func databaseKeys(cfg DatabaseConfig) string {
	if cfg.Driver == "postgres" {
		return fmt.Sprintf("driver = \"postgres\"\nurl = %q", cfg.URL)
	}
	return fmt.Sprintf("path = %q", cfg.Path)
}

// storedPayload is the payload store gives back of guid's first copy.
func storedPayload(t testing.TB, store *Store, guid string) string {
	t.Helper()
	st, err := store.Story(context.Background(), guid)
	if err != nil {
		t.Fatalf("story of %s: %v", guid, err)
	}
	return st.Payload()
}

// openStoreDB opens the test's database, SQLite or PostgreSQL, to read
// what the daemon wrote.
func openStoreDB(t testing.TB, cfg DatabaseConfig) *sql.DB {
	t.Helper()
	if cfg.Driver != "postgres" {
		return openDB(t, cfg.Path)
	}
	db, err := sql.Open("pgx", cfg.URL)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(2)
	t.Cleanup(func() { db.Close() })
	return db
}

// openWritableDB opens the test's database to write to it, as another
// program sharing it would (the bot).
func openWritableDB(t testing.TB, cfg DatabaseConfig) *sql.DB {
	t.Helper()
	if cfg.Driver == "postgres" {
		return openStoreDB(t, cfg)
	}
	db, err := sql.Open("sqlite", "file:"+cfg.Path+"?_pragma=busy_timeout(5000)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func openDB(t testing.TB, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+path+"?mode=ro&_pragma=busy_timeout(5000)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func queryInt(t testing.TB, db *sql.DB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// scanAny scans the current row of rows, of n columns, whatever their
// types.
func scanAny(t testing.TB, rows *sql.Rows, n int) []any {
	t.Helper()
	vals := make([]any, n)
	ptrs := make([]any, n)
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	if err := rows.Scan(ptrs...); err != nil {
		t.Fatal(err)
	}
	return vals
}

// eventually polls cond every 50ms until it holds or timeout passes.
func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// amqpChannel is a raw channel on vhost, for tests that publish or inspect
// queues directly.
func amqpChannel(t testing.TB, vhost string) *amqp.Channel {
	t.Helper()
	conn, err := amqp.Dial(amqpURL(vhost))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// declareTopology declares the 12 queues on vhost the way the daemon does.
func declareTestTopology(t testing.TB, vhost string, retryTTL time.Duration) {
	t.Helper()
	q := NewQueues(QueueConfig{DeclareTopology: true, RetryTTL: retryTTL, CallTimeout: 5 * time.Second,
		PublishTimeout: 5 * time.Second, Prefetch: 1, MaxAttempts: 10}, mustBrokers(t, amqpURL(vhost)), nil, noop.NewTracerProvider(), slog.New(slog.DiscardHandler))
	defer q.Close()
	if err := q.Reachable(context.Background(), q.conns[0].broker); err != nil {
		t.Fatal(err)
	}
}

// declareRouteAtOnce declares the topology on vhost while a daemon
// publishes to it, the way no publish can see half of it: the two queues
// are bound to an exchange of their own first, and github-exchange reaches
// them by one exchange binding, made last. Bound one at a time, a publish
// between the two bindings is routed to github alone, and the broker's
// return says nothing of the queue it missed.
func declareRouteAtOnce(t testing.TB, vhost string, retryTTL time.Duration) {
	t.Helper()
	ch := amqpChannel(t, vhost)
	defer ch.Close()
	const staging = "sy-test-route"
	must := func(err error) {
		if err != nil {
			t.Fatalf("declare the route on %s: %v", vhost, err)
		}
	}
	must(ch.ExchangeDeclare(staging, amqp.ExchangeFanout, true, false, false, false, nil))
	for _, name := range allQueues() {
		_, err := ch.QueueDeclare(name, true, false, false, false, queueArgs(QueueConfig{RetryTTL: retryTTL}, name))
		must(err)
	}
	must(ch.QueueBind(queueGitHub, "", staging, false, nil))
	must(ch.QueueBind(queueDatabase, "", staging, false, nil))
	must(ch.ExchangeDeclare(exchangeName, amqp.ExchangeFanout, true, false, false, false, nil))
	must(ch.ExchangeBind(staging, "", exchangeName, false, nil)) // the route, whole, in one step
}

func mustBrokers(t testing.TB, urls ...string) []*Broker {
	t.Helper()
	var bs []*Broker
	for i, u := range urls {
		b, err := ParseBroker(i, u)
		if err != nil {
			t.Fatal(err)
		}
		bs = append(bs, b)
	}
	return bs
}

// ready returns the ready-message count of queue on vhost.
func ready(t testing.TB, vhost, queue string) int {
	t.Helper()
	ch := amqpChannel(t, vhost)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("passive declare %s on %s: %v", queue, vhost, err)
	}
	return q.Messages
}

// consuming waits until every one of queues on vhost has a consumer: the
// workers reading them have begun their windows there.
func consuming(t testing.TB, vhost string, queues ...string) {
	t.Helper()
	eventually(t, 30*time.Second, "workers consuming "+strings.Join(queues, ", ")+" on "+vhost, func() bool {
		ch := amqpChannel(t, vhost)
		defer ch.Close()
		for _, name := range queues {
			q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
			if err != nil || q.Consumers == 0 {
				return false
			}
		}
		return true
	})
}

// logged waits until line shows in logs n more times than it does now.
func logged(t testing.TB, logs *logSink, line string, n int) {
	t.Helper()
	start := strings.Count(logs.String(), line)
	eventually(t, 30*time.Second, fmt.Sprintf("%d more log lines %q", n, line), func() bool {
		return strings.Count(logs.String(), line) >= start+n
	})
}

// publishRaw publishes straight to a queue, as a producer would.
func publishRaw(t testing.TB, vhost, exchange, key string, msg amqp.Publishing) {
	t.Helper()
	ch := amqpChannel(t, vhost)
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	dc, err := ch.PublishWithDeferredConfirm(exchange, key, true, false, msg)
	if err != nil {
		t.Fatal(err)
	}
	if !dc.Wait() {
		t.Fatalf("publish to %s/%s not confirmed", exchange, key)
	}
}

// eventMessage is a message as the webhook endpoint would publish it.
func eventMessage(event, guid string, body []byte) amqp.Publishing {
	h := http.Header{}
	h.Set("X-GitHub-Event", event)
	h.Set("X-GitHub-Delivery", guid)
	return newPublishing(h, body, "127.0.0.1", time.Now())
}

// delivered is msg as a consumer receives it, for decoding without a broker.
func delivered(msg amqp.Publishing) Delivery {
	return deliveryOf(&amqp.Delivery{Headers: msg.Headers, MessageId: msg.MessageId, Type: msg.Type,
		ContentType: msg.ContentType, Timestamp: msg.Timestamp, Body: msg.Body})
}

// deliveryOf is an AMQP delivery as DecodeEvent reads it.
func deliveryOf(d *amqp.Delivery) Delivery {
	return Delivery{MessageID: d.MessageId, Type: d.Type, Header: func(k string) string { return tableString(d.Headers, k) },
		Body: d.Body, Timestamp: d.Timestamp}
}

// spyOn binds a queue of the test's own, "spy", to github-exchange on
// vhost: a copy of every message the endpoint publishes, as it went.
func spyOn(t testing.TB, vhost string) *amqp.Channel {
	t.Helper()
	spy := amqpChannel(t, vhost)
	if _, err := spy.QueueDeclare("spy", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := spy.QueueBind("spy", "", exchangeName, false, nil); err != nil {
		t.Fatal(err)
	}
	return spy
}

// answersOK reports whether a GET of url answers 200.
func answersOK(url string) bool {
	resp, err := http.Get(url)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// getOne takes one message from queue on vhost, failing when there is none.
func getOne(t testing.TB, vhost, queue string) amqp.Delivery {
	t.Helper()
	ch := amqpChannel(t, vhost)
	d, ok, err := ch.Get(queue, true)
	if err != nil || !ok {
		t.Fatalf("get %s on %s: ok=%v err=%v", queue, vhost, ok, err)
	}
	return d
}

// parts are the daemon's pieces over cfg without the daemon: a migrated
// store, the brokers, their queues, and a logger writing to the test. The
// test's cleanup closes them.
type parts struct {
	store   *Store
	brokers *Brokers
	queues  *Queues
	log     *slog.Logger
	logs    *logSink
}

func newParts(t testing.TB, cfg *Config) *parts {
	t.Helper()
	ctx := context.Background()
	withMigratedStore(t, cfg.Database)
	store, err := OpenStore(ctx, cfg.Database, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	sink := &logSink{t: t}
	log := slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelDebug}))
	brokers, err := NewBrokers(ctx, cfg.Brokers, store, nil, log)
	if err != nil {
		t.Fatal(err)
	}
	queues := NewQueues(cfg.Queue, brokers.List(), nil, noop.NewTracerProvider(), log)
	t.Cleanup(func() { queues.Close() })
	return &parts{store: store, brokers: brokers, queues: queues, log: log, logs: sink}
}

// eventFunc is h for an Event built by hand or decoded without its rows
// (Decoded.TableRows decodes them), what it found dropped: the form the
// tests wrap handlers in.
func eventFunc(h Handler) func(ctx context.Context, tx *Tx, ev *Event) error {
	return func(ctx context.Context, tx *Tx, ev *Event) error {
		_, err := h(ctx, tx, Decoded{Event: ev})
		return err
	}
}

// handlerOf is a Handler of a test's function of an Event, which finds
// nothing.
func handlerOf(h func(ctx context.Context, tx *Tx, ev *Event) error) Handler {
	return func(ctx context.Context, tx *Tx, d Decoded) (Found, error) { return Found{}, h(ctx, tx, d.Event) }
}

// migratedStore is the test's store (testStore), opened and migrated,
// closed at the test's end.
func migratedStore(t testing.TB) *Store {
	t.Helper()
	return migratedStoreOf(t, testStore(t))
}

// migratedStoreOf is the store of db, opened and migrated, closed at the
// test's end.
func migratedStoreOf(t testing.TB, db DatabaseConfig) *Store {
	t.Helper()
	store, err := OpenStore(context.Background(), db, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	if _, _, err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return store
}

// consumersBackWithBroker holds d's consumers of the active broker to
// coming back with it after an outage long enough that a backoff of their
// own would have grown to 7.5-15 s: each attached within consumersBack of
// the connection's first dial after the broker returned at back, both as
// d's own clock says.
func consumersBackWithBroker(t *testing.T, d *Daemon, back time.Time) {
	t.Helper()
	// brokerRetry at most, then the calls that start a consumer: a loaded
	// machine's took 1.2 s in a full run. Well under a grown backoff.
	const consumersBack = 5 * time.Second
	b, err := d.brokers.Get(d.brokers.Cached().Active)
	if err != nil {
		t.Fatal(err)
	}
	var up time.Time
	eventually(t, 30*time.Second, "the active broker dialed again", func() bool {
		if p := d.queues.conns[b.Index].upSince.Load(); p != nil {
			up = *p
		}
		return up.After(back)
	})
	for _, w := range d.workers {
		if w.Queue != queueGitHub && w.Queue != queueDatabase {
			continue
		}
		var attached time.Time
		eventually(t, 30*time.Second, w.Name+"'s consumer back", func() bool {
			attached = w.State().Recovered
			return !attached.Before(up)
		})
		if late := attached.Sub(up); late > consumersBack {
			t.Errorf("%s consumed again %s after the broker's connection came back, want within %s", w.Name, late, consumersBack)
		}
	}
}

// makingTools holds one make of a test tool at a time: two tests that
// find a tool missing at once (onBothStores' two) would otherwise run
// apt-get side by side, and the second fails on dpkg's lock.
var makingTools sync.Mutex

// makeTool runs make for target (a file under .tools) unless an earlier
// test has made it meanwhile.
func makeTool(t testing.TB, target string) {
	t.Helper()
	makingTools.Lock()
	defer makingTools.Unlock()
	if _, err := os.Stat(target); err == nil {
		return
	}
	if out, err := exec.Command("make", "-s", target).CombinedOutput(); err != nil {
		t.Fatalf("no %s, and make %s failed: %v\n%s", target, target, err, out)
	}
}
