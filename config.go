package main

import (
	"bytes"
	"cmp"
	_ "embed"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
	amqp "github.com/rabbitmq/amqp091-go"
)

// version is the build's version, set with -ldflags "-X main.version=...";
// it sits with the configuration because every layer may report it.
var version = "dev"

// Config is the whole of switchyard's configuration: one TOML file, decoded over
// DefaultConfig. Its keys are what operators write: never rename one.
type Config struct {
	Server       ServerConfig       `toml:"server"`
	Database     DatabaseConfig     `toml:"database"`
	API          APIConfig          `toml:"api"`
	GitHub       GitHubConfig       `toml:"github"`
	Queue        QueueConfig        `toml:"queue"`
	Workers      WorkersConfig      `toml:"workers"`
	Brokers      []BrokerConfig     `toml:"brokers"`
	Alerts       AlertsConfig       `toml:"alerts"`
	HealthChecks HealthChecksConfig `toml:"healthchecks"`
	Log          LogConfig          `toml:"log"`
}

// ServerConfig is the HTTP listener.
type ServerConfig struct {
	Listen         string   `toml:"listen"`
	TrustedProxies []string `toml:"trusted_proxies"`
	// ShutdownTimeout bounds the whole shutdown after SIGTERM; systemd's
	// TimeoutStopSec must be longer.
	ShutdownTimeout time.Duration `toml:"shutdown_timeout"`
	// MetricsListen is where /metrics is served: its own listener, on
	// loopback by default, since the metrics name every broker's vhost (on
	// shared plans, its user); the address of listen serves it there.
	MetricsListen string `toml:"metrics_listen"`
	// MaxInflightBytes bounds the webhook bodies being read at once, all
	// together.
	MaxInflightBytes int64 `toml:"max_inflight_bytes"`
	// MemoryLimit is the Go runtime's soft memory limit in bytes (0: none);
	// GOMEMLIMIT in the environment wins over it.
	MemoryLimit int64 `toml:"memory_limit"`
}

// metricsOnAPI reports whether /metrics is served on the API listener: only
// when the operator gave metrics_listen the same address.
func (c ServerConfig) metricsOnAPI() bool { return c.MetricsListen == c.Listen }

// DatabaseConfig is the SQLite file.
type DatabaseConfig struct {
	Path        string        `toml:"path"`
	Synchronous string        `toml:"synchronous"`
	BusyTimeout time.Duration `toml:"busy_timeout"`
	// RawRetention is how long the raw payloads of the github table are
	// kept; zero keeps them forever. It takes days too ("90d").
	RawRetention Duration `toml:"raw_retention"`
	// DeliveryRetention is how long a delivery's identity (its github row
	// without the payload, which workers finished it) is kept: at least as
	// long as its payload, so that a redelivery is known as a duplicate.
	DeliveryRetention Duration `toml:"delivery_retention"`
}

// githubRedeliveryWindow is how long GitHub keeps a delivery and can deliver
// it again: a payload or identity pruned sooner would let a redelivery
// count twice, or the ledger call a stored delivery a gap.
const githubRedeliveryWindow = 72 * time.Hour

// APIConfig holds the bearer tokens of the broker admin API.
type APIConfig struct {
	OperatorToken string `toml:"operator_token"`
	ProducerToken string `toml:"producer_token"`
	// MaxClockSkew is how far in the future a notification's switchedAt
	// may be: one further ahead would block every real one after it.
	MaxClockSkew time.Duration `toml:"max_clock_skew"`
}

// GitHubConfig is everything switchyard knows of GitHub.
type GitHubConfig struct {
	WebhookSecret          string   `toml:"webhook_secret"`
	PreviousWebhookSecrets []string `toml:"previous_webhook_secrets"`
	AllowedCIDRs           []string `toml:"allowed_cidrs"`
	MetaFile               string   `toml:"meta_file"`
	BotAppID               int64    `toml:"bot_app_id"`
	AppID                  int64    `toml:"app_id"`
	PrivateKeyFile         string   `toml:"private_key_file"`
	APIURL                 string   `toml:"api_url"`
	// ReconcileGrace is how long a delivery GitHub made with a 2xx may take
	// to be stored (the retry cycle) before the hooks poll calls it a gap.
	ReconcileGrace time.Duration `toml:"reconcile_grace"`
	// RedeliverGaps asks GitHub to deliver a gap again.
	RedeliverGaps bool `toml:"redeliver_gaps"`
	// MaxPagesPerPoll bounds the pages of deliveries one poll (and the
	// deliveries command) reads; the next poll goes on from the checkpoint.
	MaxPagesPerPoll int `toml:"max_pages_per_poll"`
	// RedeliverPerMinute bounds the redeliveries asked of GitHub, whose
	// content-creation limit is 80 a minute for everything the App does.
	RedeliverPerMinute int `toml:"redeliver_per_minute"`
}

// QueueConfig is the AMQP side: topology, retries and publishing.
type QueueConfig struct {
	DeclareTopology bool          `toml:"declare_topology"`
	RetryTTL        time.Duration `toml:"retry_ttl"`
	MaxAttempts     int           `toml:"max_attempts"`
	Prefetch        int           `toml:"prefetch"`
	PublishTimeout  time.Duration `toml:"publish_timeout"`
	// CallTimeout bounds every other AMQP call (dial, declare, get, ack).
	CallTimeout time.Duration `toml:"call_timeout"`
	// MaxBatchBytes bounds the message bytes one consumer holds: its window
	// is at most this many bytes of messages by the sizes seen, and a batch
	// at most half of it.
	MaxBatchBytes int64 `toml:"max_batch_bytes"`
	// KeepaliveEvery is how often every broker's 12 queues are checked
	// (and, with declare_topology, declared again): free plans delete a
	// queue nobody used for 28 days.
	KeepaliveEvery time.Duration `toml:"keepalive_every"`
}

// WorkersConfig sets the cadence of the four workers.
type WorkersConfig struct {
	Window               time.Duration `toml:"window"`
	PendingCheckInterval time.Duration `toml:"pending_check_interval"`
	LeftoverDrainLimit   int           `toml:"leftover_drain_limit"`
	CleanupEvery         time.Duration `toml:"cleanup_every"`
	CleanupWindow        time.Duration `toml:"cleanup_window"`
	HooksPollEvery       time.Duration `toml:"hooks_poll_every"`
}

// BrokerConfig is one [[brokers]] entry; its position in the file is its index.
type BrokerConfig struct {
	URL string `toml:"url"`
}

// AlertsConfig selects Events and where to announce them.
type AlertsConfig struct {
	Rules []AlertRule `toml:"rules"`
	Email EmailConfig `toml:"email"`
	Push  PushConfig  `toml:"push"`
}

// AlertRule matches Events by "event.action" patterns and names its channels.
type AlertRule struct {
	Events   []string `toml:"events"`
	Channels []string `toml:"channels"`
}

// EmailConfig is the SMTP channel.
type EmailConfig struct {
	Host     string   `toml:"host"`
	Port     int      `toml:"port"`
	Username string   `toml:"username"`
	Password string   `toml:"password"`
	From     string   `toml:"from"`
	To       []string `toml:"to"`
	TLS      string   `toml:"tls"`
}

// PushConfig is the HTTP push channel (an ntfy-style POST).
type PushConfig struct {
	URL   string `toml:"url"`
	Token string `toml:"token"`
}

// HealthChecksConfig holds one ping URL per worker.
type HealthChecksConfig struct {
	Service         string `toml:"service"`
	DatabaseService string `toml:"database_service"`
	Hooks           string `toml:"hooks"`
	Cleanup         string `toml:"cleanup"`
}

// LogConfig sets up log/slog.
type LogConfig struct {
	Level  string `toml:"level"`
	Format string `toml:"format"`
}

// DefaultConfig returns the configuration an empty file would give.
func DefaultConfig() *Config {
	return &Config{
		Server: ServerConfig{Listen: "127.0.0.1:8080", MetricsListen: "127.0.0.1:9185", ShutdownTimeout: 25 * time.Second, MaxInflightBytes: 64 << 20,
			MemoryLimit: 48 << 20},
		Database: DatabaseConfig{Path: "switchyard.db", Synchronous: "FULL", BusyTimeout: 5 * time.Second,
			RawRetention: Duration(90 * 24 * time.Hour), DeliveryRetention: Duration(30 * 24 * time.Hour)},
		API: APIConfig{MaxClockSkew: 5 * time.Minute},
		GitHub: GitHubConfig{APIURL: "https://api.github.com", ReconcileGrace: 2 * time.Hour, RedeliverGaps: true,
			MaxPagesPerPoll: 100, RedeliverPerMinute: 30},
		Queue: QueueConfig{
			RetryTTL:    10 * time.Minute,
			MaxAttempts: 10,
			// 4 consumers share a connection: 800 unacked, within CloudAMQP's
			// 1,000 per connection on free plans. Over a 50 ms link a window of
			// 1 is 20 messages a second (BENCHMARKS.md).
			Prefetch:       200,
			PublishTimeout: 5 * time.Second,
			CallTimeout:    10 * time.Second,
			MaxBatchBytes:  8 << 20,
			KeepaliveEvery: 24 * time.Hour,
		},
		Workers: WorkersConfig{
			Window:               5 * time.Minute,
			PendingCheckInterval: 15 * time.Second,
			LeftoverDrainLimit:   500,
			CleanupEvery:         time.Hour,
			CleanupWindow:        60 * time.Second,
			HooksPollEvery:       5 * time.Minute,
		},
		Log: LogConfig{Level: "info", Format: "text"},
	}
}

// LoadConfig reads path over the defaults and validates the result. A key the
// Config does not know is an error: a typo must not silently fall back to a default.
func LoadConfig(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	cfg, err := ParseConfig(b)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return cfg, nil
}

// ParseConfig decodes TOML over DefaultConfig and validates the result. It
// returns every problem at once: the keys it does not know, the values that
// do not have their key's type, and what Validate finds in the rest. Only
// TOML that does not parse at all stops it at the first error.
func ParseConfig(b []byte) (*Config, error) {
	cfg, err := DecodeConfig(bytes.NewReader(b))
	if cfg == nil {
		return nil, err
	}
	if err := errors.Join(err, cfg.Validate()); err != nil {
		return nil, err
	}
	return cfg, nil
}

// DecodeConfig decodes TOML over DefaultConfig without validating. Each key
// is decoded on its own, so that one bad value or unknown key does not hide
// the next: the Config it returns holds every value that decoded, the
// error every key that did not. A nil Config means the TOML did not parse.
func DecodeConfig(r io.Reader) (*Config, error) {
	cfg := DefaultConfig()
	var top toml.Primitive
	md, err := toml.NewDecoder(r).Decode(&top)
	if err != nil {
		return nil, err
	}
	var errs []error
	var unknown []string
	decodeKeys(&md, top, reflect.ValueOf(cfg).Elem(), "", &errs, &unknown)
	for _, k := range md.Undecoded() {
		// Keys under a table already reported unknown, or under a value
		// that failed to decode, are not news.
		key := k.String()
		covered := false
		for _, u := range unknown {
			if key == u || strings.HasPrefix(key, u+".") {
				covered = true
				break
			}
		}
		if !covered {
			errs = append(errs, fmt.Errorf("%s: unknown key", key))
		}
	}
	return cfg, errors.Join(errs...)
}

// decodeKeys decodes prim into v, a table into a struct key by key (a key
// the struct has no field for is an unknown key), anything else in one go.
// A value that does not decode is reported by its dotted path and leaves
// the field as it was.
func decodeKeys(md *toml.MetaData, prim toml.Primitive, v reflect.Value, path string, errs *[]error, unknown *[]string) {
	_, leaf := v.Addr().Interface().(encoding.TextUnmarshaler)
	if v.Kind() != reflect.Struct || leaf {
		if err := md.PrimitiveDecode(prim, v.Addr().Interface()); err != nil {
			*errs = append(*errs, fmt.Errorf("%s: %s", path, tomlMessage(err)))
			*unknown = append(*unknown, path)
		}
		return
	}
	var keys map[string]toml.Primitive
	if err := md.PrimitiveDecode(prim, &keys); err != nil {
		*errs = append(*errs, fmt.Errorf("%s: want a table: %s", cmp.Or(path, "config"), tomlMessage(err)))
		*unknown = append(*unknown, path)
		return
	}
	fields := map[string]int{}
	for i := range v.NumField() {
		if tag := v.Type().Field(i).Tag.Get("toml"); tag != "" {
			fields[tag] = i
		}
	}
	for _, k := range slices.Sorted(maps.Keys(keys)) {
		sub := k
		if path != "" {
			sub = path + "." + k
		}
		i, ok := fields[k]
		if !ok {
			*errs = append(*errs, fmt.Errorf("%s: unknown key", sub))
			*unknown = append(*unknown, sub)
			continue
		}
		decodeKeys(md, keys[k], v.Field(i), sub, errs, unknown)
	}
}

// lastKey is the part of the TOML library's messages that repeats the key
// the message is already prefixed with.
var lastKey = regexp.MustCompile(` \(last key "[^"]*"\)`)

// tomlMessage is a decoding error of the TOML library without its prefix
// and without the key that decodeKeys names anyway.
func tomlMessage(err error) string {
	return lastKey.ReplaceAllString(strings.TrimPrefix(err.Error(), "toml: "), "")
}

// Validate returns every problem at once, each naming its field.
func (c *Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}

	if _, _, err := net.SplitHostPort(c.Server.Listen); err != nil {
		bad("server.listen", "want host:port, got %q", c.Server.Listen)
	}
	if _, _, err := net.SplitHostPort(c.Server.MetricsListen); err != nil {
		bad("server.metrics_listen", "want host:port (server.listen's to serve /metrics there), got %q", c.Server.MetricsListen)
	}
	for i, p := range c.Server.TrustedProxies {
		if _, err := parsePrefix(p); err != nil {
			bad(fmt.Sprintf("server.trusted_proxies[%d]", i), "%v", err)
		}
	}
	if c.Server.ShutdownTimeout <= 0 {
		bad("server.shutdown_timeout", "must be positive")
	}
	if c.Server.MemoryLimit < 0 {
		bad("server.memory_limit", "must not be negative (0: no limit)")
	}
	if c.Server.MaxInflightBytes < 1<<20 {
		bad("server.max_inflight_bytes", "at least 1 MiB (1048576), got %d", c.Server.MaxInflightBytes)
	}

	if c.Database.Path == "" {
		bad("database.path", "required")
	} else if dir := filepath.Dir(c.Database.Path); !isDir(dir) {
		bad("database.path", "directory %s does not exist (serve creates the file, not its directory)", dir)
	}
	if !slices.Contains([]string{"FULL", "NORMAL", "EXTRA"}, strings.ToUpper(c.Database.Synchronous)) {
		bad("database.synchronous", "want FULL, NORMAL or EXTRA, got %q", c.Database.Synchronous)
	}
	if c.Database.BusyTimeout <= 0 {
		bad("database.busy_timeout", "must be positive")
	}
	if r := c.Database.RawRetention; r < 0 || r > 0 && time.Duration(r) < githubRedeliveryWindow {
		bad("database.raw_retention", "0 (keep forever) or at least 72h, GitHub's redelivery window, got %s", r)
	}
	if time.Duration(c.Database.DeliveryRetention) < githubRedeliveryWindow {
		bad("database.delivery_retention", "at least 72h, GitHub's redelivery window, got %s", c.Database.DeliveryRetention)
	}

	for field, tok := range map[string]string{"api.operator_token": c.API.OperatorToken, "api.producer_token": c.API.ProducerToken} {
		switch {
		case strings.TrimSpace(tok) == "":
			bad(field, "required, and more than spaces")
		case len(tok) < minTokenLen:
			bad(field, "at least %d characters, got %d (generate one with: openssl rand -hex 32)", minTokenLen, len(tok))
		}
	}
	if c.API.OperatorToken != "" && c.API.OperatorToken == c.API.ProducerToken {
		bad("api.producer_token", "must differ from api.operator_token")
	}
	if c.API.MaxClockSkew <= 0 {
		bad("api.max_clock_skew", "must be positive")
	}

	if strings.TrimSpace(c.GitHub.WebhookSecret) == "" {
		bad("github.webhook_secret", "required, and more than spaces")
	}
	for i, s := range c.GitHub.PreviousWebhookSecrets {
		if strings.TrimSpace(s) == "" {
			bad(fmt.Sprintf("github.previous_webhook_secrets[%d]", i), "empty or only spaces")
		}
	}
	for i, p := range c.GitHub.AllowedCIDRs {
		if _, err := parsePrefix(p); err != nil {
			bad(fmt.Sprintf("github.allowed_cidrs[%d]", i), "%v", err)
		}
	}
	if c.GitHub.MetaFile != "" {
		if _, err := loadMetaHooks(c.GitHub.MetaFile); err != nil {
			bad("github.meta_file", "%v", err)
		}
	}
	if c.GitHub.BotAppID < 0 {
		bad("github.bot_app_id", "must not be negative")
	}
	if c.GitHub.AppID < 0 {
		bad("github.app_id", "must not be negative")
	}
	if c.GitHub.AppID > 0 && c.GitHub.PrivateKeyFile == "" {
		bad("github.private_key_file", "required when github.app_id is set")
	}
	if u, err := url.Parse(c.GitHub.APIURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		bad("github.api_url", "want an http(s) URL, got %q", c.GitHub.APIURL)
	}
	if c.GitHub.MaxPagesPerPoll < 1 || c.GitHub.MaxPagesPerPoll > 10000 {
		bad("github.max_pages_per_poll", "want 1 to 10000, got %d", c.GitHub.MaxPagesPerPoll)
	}
	if c.GitHub.RedeliverPerMinute < 1 || c.GitHub.RedeliverPerMinute > 80 {
		bad("github.redeliver_per_minute", "want 1 to 80 (GitHub's content-creation limit), got %d", c.GitHub.RedeliverPerMinute)
	}
	if c.GitHub.ReconcileGrace <= 0 || c.GitHub.ReconcileGrace >= githubRedeliveryWindow {
		bad("github.reconcile_grace", "want more than 0 and less than GitHub's 72h of deliveries, got %s", c.GitHub.ReconcileGrace)
	}

	// RabbitMQ takes x-message-ttl in milliseconds as a non-negative 32-bit integer.
	if c.Queue.RetryTTL < time.Millisecond || c.Queue.RetryTTL.Milliseconds() > 1<<31-1 {
		bad("queue.retry_ttl", "want between 1ms and 24 days, got %s", c.Queue.RetryTTL)
	}
	if c.Queue.MaxAttempts < 0 {
		bad("queue.max_attempts", "must not be negative")
	}
	if c.Queue.Prefetch < 1 || c.Queue.Prefetch > 65535 {
		bad("queue.prefetch", "want 1 to 65535, got %d", c.Queue.Prefetch)
	}
	if c.Queue.PublishTimeout <= 0 {
		bad("queue.publish_timeout", "must be positive")
	}
	if c.Queue.CallTimeout <= 0 {
		bad("queue.call_timeout", "must be positive")
	}
	if c.Queue.KeepaliveEvery <= 0 || c.Queue.KeepaliveEvery > 7*24*time.Hour {
		bad("queue.keepalive_every", "want more than 0 and at most 7 days (free plans delete queues unused for 28), got %s", c.Queue.KeepaliveEvery)
	}
	if c.Queue.MaxBatchBytes < 1<<20 {
		bad("queue.max_batch_bytes", "at least 1 MiB (1048576), got %d", c.Queue.MaxBatchBytes)
	}

	for name, d := range map[string]time.Duration{
		"workers.window":                 c.Workers.Window,
		"workers.pending_check_interval": c.Workers.PendingCheckInterval,
		"workers.cleanup_every":          c.Workers.CleanupEvery,
		"workers.cleanup_window":         c.Workers.CleanupWindow,
		"workers.hooks_poll_every":       c.Workers.HooksPollEvery,
	} {
		if d <= 0 {
			bad(name, "must be positive")
		}
	}
	if c.Workers.LeftoverDrainLimit < 0 {
		bad("workers.leftover_drain_limit", "must not be negative")
	}

	if len(c.Brokers) == 0 {
		bad("brokers", "at least one [[brokers]] entry is required")
	}
	for i, b := range c.Brokers {
		if _, err := parseBrokerURL(b.URL); err != nil {
			bad(fmt.Sprintf("brokers[%d].url", i), "%v", err)
		}
	}

	for i, r := range c.Alerts.Rules {
		if len(r.Events) == 0 {
			bad(fmt.Sprintf("alerts.rules[%d].events", i), "required")
		}
		for _, ch := range r.Channels {
			if ch != "email" && ch != "push" {
				bad(fmt.Sprintf("alerts.rules[%d].channels", i), "want \"email\" or \"push\", got %q", ch)
			}
		}
	}

	for name, u := range map[string]string{
		"healthchecks.service":          c.HealthChecks.Service,
		"healthchecks.database_service": c.HealthChecks.DatabaseService,
		"healthchecks.hooks":            c.HealthChecks.Hooks,
		"healthchecks.cleanup":          c.HealthChecks.Cleanup,
	} {
		if u == "" {
			continue
		}
		if pu, err := url.Parse(u); err != nil || (pu.Scheme != "http" && pu.Scheme != "https") {
			bad(name, "want an http(s) URL")
		}
	}

	if !slices.Contains([]string{"debug", "info", "warn", "error"}, c.Log.Level) {
		bad("log.level", "want debug, info, warn or error, got %q", c.Log.Level)
	}
	if c.Log.Format != "text" && c.Log.Format != "json" {
		bad("log.format", "want text or json, got %q", c.Log.Format)
	}

	// Map iteration is random; sort so the same file always reads the same.
	sort.SliceStable(errs, func(i, j int) bool { return errs[i].Error() < errs[j].Error() })
	return errors.Join(errs...)
}

// minTokenLen is the shortest API token accepted; warnTokenLen the shortest
// that passes without a warning.
const (
	minTokenLen  = 16
	warnTokenLen = 32
	// warnSecretLen is the webhook secret below which check-config warns:
	// GitHub takes any secret, but a short one can be guessed.
	warnSecretLen = 16
)

// isDir reports whether path is a directory that exists.
func isDir(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.IsDir()
}

//go:embed config.example.toml
var exampleConfig string

// Warnings are what check-config and serve point out without refusing the
// config: short tokens, secrets still as config.example.toml has them, and a
// file that others can read. path is the file's path, "" to skip its mode.
func (c *Config) Warnings(path string) []string {
	var ws []string
	example, _ := DecodeConfig(strings.NewReader(exampleConfig))
	for _, s := range []struct {
		field, value, placeholder string
		token                     bool
	}{
		{"api.operator_token", c.API.OperatorToken, example.API.OperatorToken, true},
		{"api.producer_token", c.API.ProducerToken, example.API.ProducerToken, true},
		{"github.webhook_secret", c.GitHub.WebhookSecret, example.GitHub.WebhookSecret, false},
	} {
		if s.value == s.placeholder {
			ws = append(ws, fmt.Sprintf("%s: still the placeholder of config.example.toml; anyone who read it can use it", s.field))
		} else if s.token && len(s.value) < warnTokenLen {
			ws = append(ws, fmt.Sprintf("%s: %d characters; %d or more is safer (openssl rand -hex 32)", s.field, len(s.value), warnTokenLen))
		}
	}
	if n := len(c.GitHub.WebhookSecret); n > 0 && n < warnSecretLen && c.GitHub.WebhookSecret != example.GitHub.WebhookSecret {
		ws = append(ws, fmt.Sprintf("github.webhook_secret: %d characters; %d or more is safer (openssl rand -hex 32)", n, warnSecretLen))
	}
	if path != "" {
		if fi, err := os.Stat(path); err == nil && fi.Mode().Perm()&0o004 != 0 {
			ws = append(ws, fmt.Sprintf("%s: readable by every user (mode %04o), and it holds secrets: chmod 0640", path, fi.Mode().Perm()))
		}
	}
	return ws
}

// Duration is a time.Duration that also takes whole days ("90d"): a
// retention period reads better in days than in hours.
type Duration time.Duration

// UnmarshalText reads Go's duration syntax, or a whole number of days.
func (d *Duration) UnmarshalText(b []byte) error {
	s := string(b)
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n < 0 || n > 100*365 {
			return fmt.Errorf("want a duration such as \"90d\" or \"720h\", got %q", s)
		}
		*d = Duration(time.Duration(n) * 24 * time.Hour)
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("want a duration such as \"90d\" or \"720h\", got %q", s)
	}
	*d = Duration(v)
	return nil
}

// String prints whole days as "90d", anything else as Go does; 0 is "0 (forever)".
func (d Duration) String() string {
	v := time.Duration(d)
	switch {
	case v == 0:
		return "0 (forever)"
	case v%(24*time.Hour) == 0:
		return fmt.Sprintf("%dd", v/(24*time.Hour))
	}
	return v.String()
}

// parseBrokerURL reads a [[brokers]] url the way amqp091-go dials it,
// refusing what it could not dial, and never quoting the URL (it holds the
// password) in its errors.
func parseBrokerURL(raw string) (amqp.URI, error) {
	if raw == "" {
		return amqp.URI{}, errors.New("missing")
	}
	u, err := amqp.ParseURI(raw)
	if err != nil {
		return amqp.URI{}, errors.New("not an amqp:// or amqps:// URL")
	}
	if u.Host == "" {
		return amqp.URI{}, errors.New("missing host")
	}
	if u.Port <= 0 || u.Port > 65535 {
		return amqp.URI{}, fmt.Errorf("port %d out of range", u.Port)
	}
	return u, nil
}

// normalizeVhost makes "" and "/" the same default vhost.
func normalizeVhost(v string) string {
	if v == "" {
		return "/"
	}
	return v
}

// loadMetaHooks reads the "hooks" list of a saved GitHub /meta answer.
func loadMetaHooks(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var meta struct {
		Hooks []string `json:"hooks"`
	}
	if err := json.Unmarshal(b, &meta); err != nil {
		return nil, fmt.Errorf("not GitHub /meta JSON: %w", err)
	}
	if len(meta.Hooks) == 0 {
		return nil, errors.New(`no "hooks" ranges in it`)
	}
	for _, c := range meta.Hooks {
		if _, err := parsePrefix(c); err != nil {
			return nil, fmt.Errorf("hooks: %w", err)
		}
	}
	return meta.Hooks, nil
}

// parsePrefix accepts a CIDR or a bare address (a /32 or /128).
func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("not a CIDR: %q", s)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("not an address or CIDR: %q", s)
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// mask hides a secret while saying whether it is set.
func mask(s string) string {
	if s == "" {
		return "(unset)"
	}
	return "***"
}

// maskURL hides a URL's password, and its path and query, which for ping and
// push URLs are often the secret itself.
func maskURL(s string) string {
	if s == "" {
		return "(unset)"
	}
	u, err := url.Parse(s)
	if err != nil {
		return "***"
	}
	return u.Scheme + "://" + u.Host + "/***"
}

// Summary writes the configuration for check-config, every secret masked.
func (c *Config) Summary(w io.Writer) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	p("server.listen = %q", c.Server.Listen)
	p("server.trusted_proxies = %q", c.Server.TrustedProxies)
	p("server.metrics_listen = %q", c.Server.MetricsListen)
	p("database.path = %q", c.Database.Path)
	p("database.synchronous = %q", strings.ToUpper(c.Database.Synchronous))
	p("database.raw_retention = %s, delivery_retention = %s", c.Database.RawRetention, c.Database.DeliveryRetention)
	p("server.max_inflight_bytes = %d, memory_limit = %d", c.Server.MaxInflightBytes, c.Server.MemoryLimit)
	p("api.operator_token = %s", mask(c.API.OperatorToken))
	p("api.producer_token = %s", mask(c.API.ProducerToken))
	p("api.max_clock_skew = %s", c.API.MaxClockSkew)
	p("github.webhook_secret = %s", mask(c.GitHub.WebhookSecret))
	p("github.previous_webhook_secrets = %d set", len(c.GitHub.PreviousWebhookSecrets))
	if c.GitHub.MetaFile != "" {
		p("github.meta_file = %q", c.GitHub.MetaFile)
	} else if len(c.GitHub.AllowedCIDRs) > 0 {
		p("github.allowed_cidrs = %q", c.GitHub.AllowedCIDRs)
	} else {
		p("github.allowed_cidrs = GitHub's hooks ranges (built in)")
	}
	p("github.bot_app_id = %d", c.GitHub.BotAppID)
	p("github.app_id = %d (hooks worker %s)", c.GitHub.AppID, map[bool]string{true: "on", false: "off"}[c.GitHub.AppID > 0])
	p("github.api_url = %q", c.GitHub.APIURL)
	p("github.reconcile_grace = %s, redeliver_gaps = %t, redeliver_per_minute = %d, max_pages_per_poll = %d",
		c.GitHub.ReconcileGrace, c.GitHub.RedeliverGaps, c.GitHub.RedeliverPerMinute, c.GitHub.MaxPagesPerPoll)
	p("queue.declare_topology = %t, keepalive_every = %s", c.Queue.DeclareTopology, c.Queue.KeepaliveEvery)
	p("queue.retry_ttl = %s, max_attempts = %d, prefetch = %d, publish_timeout = %s",
		c.Queue.RetryTTL, c.Queue.MaxAttempts, c.Queue.Prefetch, c.Queue.PublishTimeout)
	p("workers.window = %s, pending_check_interval = %s, leftover_drain_limit = %d",
		c.Workers.Window, c.Workers.PendingCheckInterval, c.Workers.LeftoverDrainLimit)
	p("workers.cleanup_every = %s, cleanup_window = %s, hooks_poll_every = %s",
		c.Workers.CleanupEvery, c.Workers.CleanupWindow, c.Workers.HooksPollEvery)
	for i, b := range c.Brokers {
		p("brokers[%d].url = %s", i, redactAMQPURL(b.URL))
	}
	p("alerts.rules = %d, email = %s, push = %s", len(c.Alerts.Rules),
		map[bool]string{true: "on", false: "off"}[c.Alerts.Email.Host != ""], maskURL(c.Alerts.Push.URL))
	p("healthchecks: service = %s, database_service = %s, hooks = %s, cleanup = %s",
		maskURL(c.HealthChecks.Service), maskURL(c.HealthChecks.DatabaseService),
		maskURL(c.HealthChecks.Hooks), maskURL(c.HealthChecks.Cleanup))
	p("log.level = %q, log.format = %q", c.Log.Level, c.Log.Format)
}

// redactAMQPURL prints a broker URL as amqps://user:***@host/vhost.
func redactAMQPURL(raw string) string {
	u, err := amqp.ParseURI(raw)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Scheme + "://" + u.Username + ":***@" + net.JoinHostPort(u.Host, fmt.Sprint(u.Port)) + "/" + url.PathEscape(u.Vhost)
}
