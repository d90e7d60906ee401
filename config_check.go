// Loading and checking a configuration: LoadConfig, Validate's errors that
// name the field, the warnings check-config and serve print, and the
// summary with every secret masked.

package main

import (
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

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

// Validate returns every problem at once, each naming its field.
func (c *Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}

	if err := checkListen(c.Server.Listen); err != nil {
		bad("server.listen", "%v", err)
	}
	if err := checkListen(c.Server.MetricsListen); err != nil {
		bad("server.metrics_listen", "%v (server.listen's to serve /metrics there)", err)
	}
	for i, p := range c.Server.TrustedProxies {
		if _, err := parsePrefix(p); err != nil {
			bad(fmt.Sprintf("server.trusted_proxies[%d]", i), "%v", err)
		}
	}
	if c.Server.ShutdownTimeout <= 0 {
		bad("server.shutdown_timeout", "must be positive")
	}
	switch {
	case c.Server.DrainDelay < 0:
		bad("server.drain_delay", "must not be negative (0: no drain)")
	case c.Server.DrainDelay > 0 && c.Server.DrainDelay >= c.Server.ShutdownTimeout:
		bad("server.drain_delay", "%s is part of server.shutdown_timeout (%s) and must be shorter than it",
			c.Server.DrainDelay, c.Server.ShutdownTimeout)
	}
	if c.Server.MemoryLimit < 0 {
		bad("server.memory_limit", "must not be negative (0: no limit)")
	}
	if c.Server.MaxInflightBytes < 1<<20 {
		bad("server.max_inflight_bytes", "at least 1 MiB (1048576), got %d", c.Server.MaxInflightBytes)
	}

	if err := checkNodeName(c.Server.NodeName); err != nil {
		bad("server.node_name", "%v", err)
	}
	if c.Server.Pprof && c.Server.metricsOnAPI() {
		bad("server.pprof", "serves profiles on server.metrics_listen, which is server.listen's address here: give metrics_listen a loopback address of its own")
	}
	if c.Server.LeaseTTL < minLeaseTTL {
		bad("server.lease_ttl", "at least %s, got %s", minLeaseTTL, c.Server.LeaseTTL)
	}
	errs = append(errs, c.Server.TLS.problems()...)
	errs = append(errs, c.Tracing.problems()...)
	if err := checkListen(c.Server.TLS.HTTPListen); c.Server.TLS.HTTPListen != "" && err != nil {
		bad("server.tls.http_listen", "%v", err)
	}

	switch c.Database.Driver {
	case "postgres":
		if err := checkDatabaseURL(c.Database.URL); err != nil {
			bad("database.url", "%v", err)
		}
		if c.Database.MaxConns < 1 {
			bad("database.max_conns", "at least 1, got %d", c.Database.MaxConns)
		}
	case "sqlite":
		if c.Database.URL != "" {
			bad("database.url", `for driver = "postgres" only; driver is "sqlite", whose file is database.path`)
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
	default:
		bad("database.driver", `want "sqlite" or "postgres", got %q`, c.Database.Driver)
	}
	window := max(c.GitHub.DeliveryWindow, githubRedeliveryWindow)
	if r := c.Database.RawRetention; r < 0 || r > 0 && time.Duration(r) < window {
		bad("database.raw_retention", "0 (keep forever) or at least %s, GitHub's redelivery window (github.delivery_window), got %s", window, r)
	}
	if time.Duration(c.Database.DeliveryRetention) < window {
		bad("database.delivery_retention", "at least %s, GitHub's redelivery window (github.delivery_window), got %s", window, c.Database.DeliveryRetention)
	}

	// Slices, not maps: the errors come in the file's order, the same at
	// every run.
	for _, f := range []struct{ field, tok string }{{"api.operator_token", c.API.OperatorToken}, {"api.producer_token", c.API.ProducerToken}} {
		field, tok := f.field, f.tok
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

	c.GitHub.check(bad)

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
	if c.Queue.OutboxMaxBytes < 1<<20 {
		bad("queue.outbox_max_bytes", "want at least 1 MiB (1048576), got %d", c.Queue.OutboxMaxBytes)
	}
	if c.Queue.KeepaliveEvery <= 0 || c.Queue.KeepaliveEvery > 7*24*time.Hour {
		bad("queue.keepalive_every", "want more than 0 and at most 7 days (free plans delete queues unused for 28), got %s", c.Queue.KeepaliveEvery)
	}
	if c.Queue.Compress != "zstd" && c.Queue.Compress != "none" {
		bad("queue.compress", "want zstd or none, got %q", c.Queue.Compress)
	}
	if c.Queue.CompressOver < 0 {
		bad("queue.compress_over", "want 0 (off) or a size in bytes, got %d", c.Queue.CompressOver)
	}
	if c.Queue.Type != "classic" && c.Queue.Type != "quorum" {
		bad("queue.type", "want classic or quorum, got %q", c.Queue.Type)
	}
	if c.Queue.MaxBatchBytes < 1<<20 {
		bad("queue.max_batch_bytes", "at least 1 MiB (1048576), got %d", c.Queue.MaxBatchBytes)
	}

	for _, w := range []struct {
		name string
		d    time.Duration
	}{
		{"workers.window", c.Workers.Window},
		{"workers.pending_check_interval", c.Workers.PendingCheckInterval},
		{"workers.cleanup_every", c.Workers.CleanupEvery},
		{"workers.cleanup_window", c.Workers.CleanupWindow},
		{"workers.hooks_poll_every", c.Workers.HooksPollEvery},
	} {
		if w.d <= 0 {
			bad(w.name, "must be positive")
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
		if b.MonthlyMessages < 0 {
			bad(fmt.Sprintf("brokers[%d].monthly_messages", i), "must not be negative (0: no quota)")
		}
		if b.MaxMessageBytes < 0 {
			bad(fmt.Sprintf("brokers[%d].max_message_bytes", i), "want 0 (16 MiB) or a size in bytes, got %d", b.MaxMessageBytes)
		}
		if b.BudgetResetsOn < 0 || b.BudgetResetsOn > 28 {
			bad(fmt.Sprintf("brokers[%d].budget_resets_on", i), "want a day from 1 to 28, got %d", b.BudgetResetsOn)
		}
	}
	if w := c.Queue.BudgetWarnAt; w <= 0 || w >= 1 {
		bad("queue.budget_warn_at", "want more than 0 and less than 1, got %v", w)
	}
	if r := c.Queue.RotateAt; r <= 0 || r > 1 {
		bad("queue.rotate_at", "want more than 0 and at most 1, got %v", r)
	}
	if c.Queue.BlockedRotateAfter <= 0 {
		bad("queue.blocked_rotate_after", "must be positive")
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

	for _, h := range []struct{ name, u string }{
		{"healthchecks.service", c.HealthChecks.Service},
		{"healthchecks.database_service", c.HealthChecks.DatabaseService},
		{"healthchecks.hooks", c.HealthChecks.Hooks},
		{"healthchecks.cleanup", c.HealthChecks.Cleanup},
	} {
		if h.u == "" {
			continue
		}
		if pu, err := url.Parse(h.u); err != nil || (pu.Scheme != "http" && pu.Scheme != "https") {
			bad(h.name, "want an http(s) URL")
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

// minLeaseTTL is the shortest lease_ttl: a holder renews every third of
// it, and must hear back from the database well within it.
const minLeaseTTL = 2 * time.Second

// checkNodeName accepts 1 to maxNodeName of [A-Za-z0-9._-].
func checkNodeName(name string) error {
	if name == "" || len(name) > maxNodeName || strings.IndexFunc(name, func(r rune) bool { return !nodeNameRune(r) }) >= 0 {
		return fmt.Errorf("want 1 to %d of A-Z, a-z, 0-9, '.', '_' and '-', got %q", maxNodeName, name)
	}
	return nil
}

// checkDatabaseURL accepts a postgres:// URL with a host and a database,
// never quoting it (it holds the password) in its errors.
func checkDatabaseURL(raw string) error {
	if raw == "" {
		return errors.New(`required with driver = "postgres" (postgres://user:password@host:5432/db?sslmode=require)`)
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return errors.New("want a postgres:// URL (postgres://user:password@host:5432/db?sslmode=require)")
	}
	if u.Host == "" || strings.Trim(u.Path, "/") == "" {
		return errors.New("want a host and a database: postgres://user:password@host:5432/db")
	}
	return nil
}

// redactDatabaseURL prints a database URL without its password.
func redactDatabaseURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparseable URL)"
	}
	if u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "***")
		}
	}
	s, _ := url.PathUnescape(u.String())
	return s
}

// checkListen accepts a listen address: host:port with a numeric port
// (0 to 65535), the host empty or an address or name.
func checkListen(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("want host:port, got %q", addr)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || port == "" || n > 65535 {
		return fmt.Errorf("want a port number from 0 to 65535, got %q", port)
	}
	return nil
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
	ws := c.Server.TLS.warnings(c.Server.Listen)
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
	secrets := map[string]string{c.GitHub.WebhookSecret: "github.webhook_secret"}
	for i, h := range c.GitHub.Hooks {
		field := fmt.Sprintf("github.hooks[%d].secret", i)
		if other, ok := secrets[h.Secret]; ok && h.Secret != "" {
			ws = append(ws, fmt.Sprintf("%s is %s too: one leaked secret then opens both hooks; give each its own", field, other))
		} else if n := len(h.Secret); n > 0 && n < warnSecretLen {
			ws = append(ws, fmt.Sprintf("%s: %d characters; %d or more is safer (openssl rand -hex 32)", field, n, warnSecretLen))
		}
		secrets[h.Secret] = field
	}
	for _, r := range []struct{ key, then string }{
		{"queue.spool_after", "every webhook is committed to the outbox first and forwarded after, with no wait on the broker: remove it"},
		{"queue.spool_max_bytes", "queue.outbox_max_bytes bounds the webhooks that wait for the broker now: remove it, or set that"},
	} {
		if c.set[r.key] {
			ws = append(ws, r.key+" is retired: "+r.then)
		}
	}
	if c.Database.Driver == "postgres" {
		var sqliteOnly []string
		for _, k := range []string{"database.path", "database.synchronous", "database.busy_timeout"} {
			if c.set[k] {
				sqliteOnly = append(sqliteOnly, k)
			}
		}
		if len(sqliteOnly) > 0 {
			ws = append(ws, strings.Join(sqliteOnly, ", ")+` set, but they are SQLite's: with driver = "postgres" they do not apply`)
		}
		if w := poolerWarning(c.Database.URL); w != "" {
			ws = append(ws, w)
		}
	}
	if len(c.GitHub.AllowedCIDRs) > 0 && c.GitHub.MetaFile == "" && !coversGitHubHooks(c.GitHub.AllowedCIDRs) {
		ws = append(ws, "github.allowed_cidrs replaces GitHub's hooks ranges and leaves some out: webhooks from GitHub "+
			"itself go to github-forbidden; list GitHub's ranges too (its /meta \"hooks\", or github.meta_file), or leave the key out")
	}
	if path != "" {
		if fi, err := os.Stat(path); err == nil && fi.Mode().Perm()&0o004 != 0 {
			ws = append(ws, fmt.Sprintf("%s: readable by every user (mode %04o), and it holds secrets: chmod 0640", path, fi.Mode().Perm()))
		}
	}
	return ws
}

// poolerPort is the port a pooler (PgBouncer, pgcat, Supavisor's
// transaction mode) usually listens on.
const poolerPort = "6432"

// poolerWarning warns of a database URL that names a pooler's usual port
// without the query mode a pooler in transaction mode needs: pgx's named
// prepared statements go to whichever server connection the pooler
// gives, and fail there ("prepared statement ... already exists").
func poolerWarning(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return ""
	}
	if mode := u.Query().Get("default_query_exec_mode"); mode == "exec" || mode == "simple_protocol" {
		return ""
	}
	for _, host := range strings.Split(u.Host, ",") {
		if _, port, err := net.SplitHostPort(host); err == nil && port == poolerPort {
			return "database.url: port " + poolerPort + " is a pooler's (PgBouncer's) usual port: in transaction mode it needs " +
				"default_query_exec_mode=exec in the URL (docs/fleet.md, \"Through a pooler\")"
		}
	}
	return ""
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
	p("server.listen = %q%s", c.Server.Listen, c.Server.TLS.summary())
	p("server.trusted_proxies = %q", c.Server.TrustedProxies)
	p("server.metrics_listen = %q", c.Server.MetricsListen)
	if c.Database.Driver == "postgres" {
		p("database.driver = \"postgres\", url = %s, max_conns = %d", redactDatabaseURL(c.Database.URL), c.Database.MaxConns)
	} else {
		p("database.driver = \"sqlite\", path = %q, synchronous = %q", c.Database.Path, strings.ToUpper(c.Database.Synchronous))
	}
	p("server.node_name = %q, lease_ttl = %s", c.Server.NodeName, c.Server.LeaseTTL)
	p("database.raw_retention = %s, delivery_retention = %s", c.Database.RawRetention, c.Database.DeliveryRetention)
	p("server.max_inflight_bytes = %d, memory_limit = %d", c.Server.MaxInflightBytes, c.Server.MemoryLimit)
	p("api.operator_token = %s", mask(c.API.OperatorToken))
	p("api.producer_token = %s", mask(c.API.ProducerToken))
	p("api.max_clock_skew = %s", c.API.MaxClockSkew)
	p("github.webhook_secret = %s", mask(c.GitHub.WebhookSecret))
	p("github.previous_webhook_secrets = %d set", len(c.GitHub.PreviousWebhookSecrets))
	for _, h := range c.GitHub.Hooks {
		where := ""
		switch {
		case h.Repository != "":
			where = fmt.Sprintf(", repository = %q", h.Repository)
		case h.Organization != "":
			where = fmt.Sprintf(", organization = %q", h.Organization)
		}
		if where != "" {
			token := mask(h.Token)
			if h.Token == "" {
				token = "(the App's installation token)"
			}
			where += ", token = " + token
		}
		p("github.hooks: id = %d, secret = %s, previous_secrets = %d set%s", h.ID, mask(h.Secret), len(h.PreviousSecrets), where)
	}
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
	p("github.delivery_window = %s, reconcile_grace = %s, redeliver_gaps = %t, redeliver_per_minute = %d, max_pages_per_poll = %d",
		c.GitHub.DeliveryWindow, c.GitHub.ReconcileGrace, c.GitHub.RedeliverGaps, c.GitHub.RedeliverPerMinute, c.GitHub.MaxPagesPerPoll)
	p("queue.declare_topology = %t, keepalive_every = %s", c.Queue.DeclareTopology, c.Queue.KeepaliveEvery)
	p("queue.retry_ttl = %s, max_attempts = %d, prefetch = %d, publish_timeout = %s",
		c.Queue.RetryTTL, c.Queue.MaxAttempts, c.Queue.Prefetch, c.Queue.PublishTimeout)
	p("queue.type = %s, compress = %s, compress_over = %d", c.Queue.Type, c.Queue.Compress, c.Queue.CompressOver)
	p("queue.outbox_max_bytes = %d (every webhook committed first, forwarded to the broker after)", c.Queue.OutboxMaxBytes)
	p("workers.window = %s, pending_check_interval = %s, leftover_drain_limit = %d",
		c.Workers.Window, c.Workers.PendingCheckInterval, c.Workers.LeftoverDrainLimit)
	p("workers.cleanup_every = %s, cleanup_window = %s, hooks_poll_every = %s",
		c.Workers.CleanupEvery, c.Workers.CleanupWindow, c.Workers.HooksPollEvery)
	for i, b := range c.Brokers {
		p("brokers[%d].url = %s, monthly_messages = %d, budget_resets_on = %d, max_message_bytes = %d", i, redactAMQPURL(b.URL),
			b.MonthlyMessages, b.resetDay(), b.maxMessageBytes())
	}
	p("alerts.rules = %d, email = %s, push = %s", len(c.Alerts.Rules),
		map[bool]string{true: "on", false: "off"}[c.Alerts.Email.Host != ""], maskURL(c.Alerts.Push.URL))
	p("healthchecks: service = %s, database_service = %s, hooks = %s, cleanup = %s",
		maskURL(c.HealthChecks.Service), maskURL(c.HealthChecks.DatabaseService),
		maskURL(c.HealthChecks.Hooks), maskURL(c.HealthChecks.Cleanup))
	p("log.level = %q, log.format = %q", c.Log.Level, c.Log.Format)
	p("%s", c.Tracing.summary())
}
