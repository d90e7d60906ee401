// The daemon as the serve command runs it: the runtime's limits, the
// signals (SIGHUP reloads the config file, SIGTERM stops), and what a
// reload may change.

package main

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/signal"
	"reflect"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"
	"time"
)

// setGCLimits sets the Go runtime's soft memory limit (server.memory_limit;
// GOMEMLIMIT in the environment wins) and, under a limit, collects less
// often (gcPercentUnderLimit; GOGC in the environment wins). The limit makes
// the collector work harder as the heap nears it, so that garbage from large
// payloads does not double the footprint on a small VPS; below it, garbage
// from 25 KB webhooks may wait longer.
func setGCLimits(memoryLimit int64) {
	limited := os.Getenv("GOMEMLIMIT") != ""
	if !limited && memoryLimit > 0 {
		debug.SetMemoryLimit(memoryLimit)
		limited = true
	}
	if limited && os.Getenv("GOGC") == "" {
		debug.SetGCPercent(gcPercentUnderLimit)
	}
}

// serve is the serve command: listen, then run until SIGTERM or SIGINT.
// SIGHUP reloads the config file at path.
func serve(ctx context.Context, cfg *Config, path string, level *slog.LevelVar, log *slog.Logger, ready func()) error {
	setGCLimits(cfg.Server.MemoryLimit)
	// The listener first: an address in use fails before a database is
	// created or migrated. A socket systemd passed takes connections into
	// its queue already; they are accepted once the daemon can answer them.
	ls, err := listen(cfg.Server, log)
	if err != nil {
		return err
	}
	d, err := NewDaemon(ctx, cfg, log)
	if err != nil {
		ls.Close()
		return err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	reloads := make(chan struct{})
	reloaded := make(chan struct{})
	go func() {
		defer close(reloaded)
		for {
			select {
			case <-reloads:
				return
			case <-hup:
				d.ReloadFile(path, level)
			}
		}
	}()
	err = d.Run(ctx, ls, ready)
	close(reloads)
	<-reloaded
	err = errors.Join(err, d.Close())
	log.Info("stopped", "error", err)
	return err
}

// reloadable are the config keys a SIGHUP applies at once;
// a key ending in "." stands for its whole section.
var reloadable = []string{"log.level", "github.webhook_secret", "github.previous_webhook_secrets", "github.hooks",
	"github.allowed_cidrs", "github.meta_file", "server.trusted_proxies", "api.operator_token",
	"api.producer_token", "alerts.", "healthchecks."}

// ReloadFile reads the config file again and applies what may change while
// running: log level, webhook secrets, allow list and meta file, trusted
// proxies, API tokens, alerts and HealthChecks. Any other changed key is
// logged as needing a restart. A file that does not validate changes
// nothing, and every bad field is logged.
func (d *Daemon) ReloadFile(path string, level *slog.LevelVar) {
	cfg, err := LoadConfig(path)
	if err != nil {
		for _, line := range strings.Split(err.Error(), "\n") {
			d.log.Error("config reload refused, the running config stays", "problem", line)
		}
		return
	}
	if err := d.api.Reload(cfg); err != nil {
		d.log.Error("config reload refused, the running config stays", "problem", err)
		return
	}
	level.Set(parseLevel(cfg.Log.Level))
	d.alerter.Reload(cfg.Alerts)
	if d.tls != nil {
		if err := d.tls.Reload(); err != nil {
			d.log.Error("the certificate files did not load; the certificate served stays", "error", err)
		}
	}
	urls := map[string]string{"service": cfg.HealthChecks.Service, "database-service": cfg.HealthChecks.DatabaseService,
		"hooks": cfg.HealthChecks.Hooks, "cleanup": cfg.HealthChecks.Cleanup}
	for _, w := range d.workers {
		w.Health.SetURL(urls[w.Name])
	}
	var restart []string
	for _, key := range changedKeys(d.cfg, cfg) {
		if !slices.ContainsFunc(reloadable, func(r string) bool { return key == r || strings.HasSuffix(r, ".") && strings.HasPrefix(key, r) }) {
			restart = append(restart, key)
		}
	}
	if ledgerHooks := func(c *Config) []HookConfig {
		var out []HookConfig
		for _, h := range c.GitHub.Hooks {
			if h.Repository != "" || h.Organization != "" {
				out = append(out, HookConfig{ID: h.ID, Repository: h.Repository, Organization: h.Organization, Token: h.Token})
			}
		}
		return out
	}; !reflect.DeepEqual(ledgerHooks(d.cfg), ledgerHooks(cfg)) {
		// The secrets reload; the ledgers the hooks worker reads do not.
		restart = append(restart, "github.hooks (repository, organization, token)")
	}
	for _, w := range cfg.Warnings(path) {
		d.log.Warn("config: " + w)
	}
	d.log.Info("config reloaded", "path", path)
	for _, key := range restart {
		d.log.Warn("config key changed; it takes effect after a restart", "key", key)
	}
}

// changedKeys names the config keys ("section.key", as in the file) whose
// values differ between a and b.
func changedKeys(a, b *Config) []string {
	var keys []string
	var walk func(prefix string, va, vb reflect.Value)
	walk = func(prefix string, va, vb reflect.Value) {
		if va.Kind() == reflect.Struct && va.Type() != reflect.TypeOf(time.Time{}) {
			for i := 0; i < va.NumField(); i++ {
				tag, _, _ := strings.Cut(va.Type().Field(i).Tag.Get("toml"), ",")
				if tag == "" || tag == "-" {
					continue
				}
				name := tag
				if prefix != "" {
					name = prefix + "." + tag
				}
				walk(name, va.Field(i), vb.Field(i))
			}
			return
		}
		if !reflect.DeepEqual(va.Interface(), vb.Interface()) {
			keys = append(keys, prefix)
		}
	}
	walk("", reflect.ValueOf(*a), reflect.ValueOf(*b))
	return keys
}
