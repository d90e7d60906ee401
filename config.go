package main

import (
	"cmp"
	_ "embed"
	"encoding"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/url"
	"os"
	"reflect"
	"regexp"
	"slices"
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
	Tracing      TracingConfig      `toml:"tracing"`

	// set are the keys the file set ("database.path"), for the warnings
	// about keys that do not apply.
	set map[string]bool
}

// ServerConfig is the HTTP listener.
type ServerConfig struct {
	Listen         string   `toml:"listen"`
	TrustedProxies []string `toml:"trusted_proxies"`
	// ShutdownTimeout bounds the whole shutdown after SIGTERM; systemd's
	// TimeoutStopSec must be longer.
	ShutdownTimeout time.Duration `toml:"shutdown_timeout"`
	// DrainDelay is how long, on SIGTERM, the node answers /readyz 503
	// "draining" while it still takes webhooks, so that a balancer sends
	// them elsewhere before it stops accepting; part of ShutdownTimeout.
	DrainDelay time.Duration `toml:"drain_delay"`
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
	// NodeName names this node among those sharing one database; the
	// host name by default.
	NodeName string `toml:"node_name"`
	// LeaseTTL is how long a once-only job's lease lasts unrenewed; the
	// holder renews it every third of it.
	LeaseTTL time.Duration `toml:"lease_ttl"`
	// Pprof serves Go's net/http/pprof on the metrics listener, so that
	// an operator can profile the daemon where it runs.
	Pprof bool `toml:"pprof"`
	// TLS has the endpoint serve HTTPS itself (config_tls.go).
	TLS TLSConfig `toml:"tls"`
}

// metricsOnAPI reports whether /metrics is served on the API listener: only
// when the operator gave metrics_listen the same address.
func (c ServerConfig) metricsOnAPI() bool { return c.MetricsListen == c.Listen }

// DatabaseConfig is the store: an SQLite file (the default), or a
// PostgreSQL database shared by several nodes.
type DatabaseConfig struct {
	// Driver is "sqlite" or "postgres".
	Driver string `toml:"driver"`
	// URL is the PostgreSQL database (postgres only), with its password:
	// never print it, use redactDatabaseURL.
	URL string `toml:"url"`
	// MaxConns bounds the connections to PostgreSQL.
	MaxConns int `toml:"max_conns"`
	// Path, Synchronous and BusyTimeout are SQLite's.
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

// APIConfig holds the bearer tokens of the broker admin API.
type APIConfig struct {
	OperatorToken string `toml:"operator_token"`
	ProducerToken string `toml:"producer_token"`
	// MaxClockSkew is how far in the future a notification's switchedAt
	// may be: one further ahead would block every real one after it.
	MaxClockSkew time.Duration `toml:"max_clock_skew"`
}

// QueueConfig is the AMQP side: topology, retries and publishing.
type QueueConfig struct {
	DeclareTopology bool          `toml:"declare_topology"`
	RetryTTL        time.Duration `toml:"retry_ttl"`
	MaxAttempts     int           `toml:"max_attempts"`
	Prefetch        int           `toml:"prefetch"`
	PublishTimeout  time.Duration `toml:"publish_timeout"`
	// OutboxMaxBytes bounds the bytes of the webhooks a node committed to
	// the outbox that wait for the broker: past it a webhook takes the
	// broker's path (published with a confirm), and is refused (503) when
	// the broker does not take it either.
	OutboxMaxBytes int64 `toml:"outbox_max_bytes"`
	// SpoolAfter and SpoolMaxBytes are retired (the spool became the
	// outbox, always on): a config that still sets them is served, with a
	// warning naming what replaced them.
	SpoolAfter    time.Duration `toml:"spool_after"`
	SpoolMaxBytes int64         `toml:"spool_max_bytes"`
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
	// BudgetWarnAt is the share of a broker's monthly_messages at which
	// a budget alert goes out; the second goes out at 1.0.
	BudgetWarnAt float64 `toml:"budget_warn_at"`
	// RotateOnBudget lets switchyard record a Pending Switch itself when
	// the broker it publishes to has spent RotateAt of its budget, or has
	// blocked the connection for BlockedRotateAfter: to the next broker in
	// config order under RotateAt that answers.
	RotateOnBudget     bool          `toml:"rotate_on_budget"`
	RotateAt           float64       `toml:"rotate_at"`
	BlockedRotateAfter time.Duration `toml:"blocked_rotate_after"`
	// Compress is how a webhook is published: "zstd" compresses every
	// one (content_encoding zstd) once every live node reads it; "none",
	// for queues another consumer also reads, publishes it as it came but
	// over CompressOver.
	Compress string `toml:"compress"`
	// CompressOver is the body size over which a webhook not published
	// zstd-compressed goes gzip-compressed (content_encoding gzip); 0
	// publishes every such body as it came.
	CompressOver int64 `toml:"compress_over"`
	// Type is the queue type every queue is declared with, explicitly
	// (x-queue-type), so that a vhost's default type changes nothing:
	// "classic" or "quorum".
	Type string `toml:"type"`
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
	// MonthlyMessages is the broker's monthly message quota (a free plan's;
	// a publish and each delivery count), 0 for none.
	MonthlyMessages int64 `toml:"monthly_messages"`
	// BudgetResetsOn is the day of the month (1-28, UTC) its quota starts
	// anew; 0 is the 1st.
	BudgetResetsOn int `toml:"budget_resets_on"`
	// MaxMessageBytes is the largest message the broker takes (RabbitMQ
	// 4's max_message_size is 16 MiB by default); a webhook still over it
	// once compressed is answered 413. 0 is the default, 16 MiB.
	MaxMessageBytes int64 `toml:"max_message_bytes"`
}

// defaultMaxMessageBytes is RabbitMQ 4's default max_message_size.
const defaultMaxMessageBytes = 16 << 20

// maxMessageBytes is the largest message the broker takes.
func (b BrokerConfig) maxMessageBytes() int64 {
	return cmp.Or(b.MaxMessageBytes, defaultMaxMessageBytes)
}

// resetDay is the day of the month the broker's budget starts anew.
func (b BrokerConfig) resetDay() int { return max(b.BudgetResetsOn, 1) }

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
			MemoryLimit: 64 << 20, NodeName: hostName(), LeaseTTL: 30 * time.Second, TLS: TLSConfig{ACMECA: letsEncrypt}},
		Database: DatabaseConfig{Driver: "sqlite", MaxConns: 10, Path: "switchyard.db", Synchronous: "FULL", BusyTimeout: 5 * time.Second,
			RawRetention: Duration(90 * 24 * time.Hour), DeliveryRetention: Duration(30 * 24 * time.Hour)},
		API: APIConfig{MaxClockSkew: 5 * time.Minute}, Tracing: TracingConfig{SampleRatio: 1},
		GitHub: GitHubConfig{APIURL: "https://api.github.com", ReconcileGrace: 2 * time.Hour, RedeliverGaps: true, DeliveryWindow: githubRedeliveryWindow,
			MaxPagesPerPoll: 100, RedeliverPerMinute: 30},
		Queue: QueueConfig{
			RetryTTL:    10 * time.Minute,
			MaxAttempts: 10,
			// 4 consumers share a connection: 800 unacked, within CloudAMQP's
			// 1,000 per connection on free plans. A consumer waits a round
			// trip per window, so a window of 1 over a WAN link is a few
			// dozen messages a second.
			Prefetch:           200,
			PublishTimeout:     5 * time.Second,
			OutboxMaxBytes:     1 << 30,
			CallTimeout:        10 * time.Second,
			MaxBatchBytes:      4 << 20,
			KeepaliveEvery:     24 * time.Hour,
			BudgetWarnAt:       0.8,
			RotateAt:           0.9,
			BlockedRotateAfter: 5 * time.Minute,
			Compress:           "zstd",
			CompressOver:       1 << 20,
			Type:               "classic",
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

// hostName is the machine's host name, the default node_name: cut to what
// a node name may hold.
func hostName() string {
	h, _ := os.Hostname()
	h = strings.Map(func(r rune) rune {
		if nodeNameRune(r) {
			return r
		}
		return '-'
	}, h)
	if len(h) > maxNodeName {
		h = h[:maxNodeName]
	}
	return cmp.Or(h, "switchyard")
}

// maxNodeName is the longest node_name.
const maxNodeName = 64

// nodeNameRune reports whether r may be in a node name: [A-Za-z0-9._-].
func nodeNameRune(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-'
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
	cfg.set = map[string]bool{}
	for _, k := range md.Keys() {
		cfg.set[k.String()] = true
	}
	cfg.Tracing = tracingFromEnv(cfg.Tracing, md.IsDefined("tracing"))
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

// redactAMQPURL prints a broker URL as amqps://user:***@host/vhost.
func redactAMQPURL(raw string) string {
	u, err := amqp.ParseURI(raw)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Scheme + "://" + u.Username + ":***@" + net.JoinHostPort(u.Host, fmt.Sprint(u.Port)) + "/" + url.PathEscape(u.Vhost)
}
