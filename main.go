// Command switchyard takes GitHub webhooks through RabbitMQ into SQLite, and
// follows its producer from broker to broker without losing or reordering an
// Event. See README.md and SPEC.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sync/errgroup"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(exitCode(err, os.Stderr))
}

// usageError is bad usage: exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

func exitCode(err error, stderr io.Writer) int {
	if err == nil {
		return 0
	}
	fmt.Fprintln(stderr, "switchyard:", err)
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprint(stderr, usageText)
		return 2
	}
	return 1
}

const usageText = `usage:
  switchyard serve        [-config PATH]
  switchyard migrate      [-config PATH]
  switchyard check-config [-config PATH]
  switchyard backup       [-config PATH] DEST
  switchyard queues       [-config PATH]
  switchyard replay       [-config PATH] QUEUE [-limit N]
  switchyard version
PATH defaults to $SWITCHYARD_CONFIG, then ./switchyard.toml.
`

// run is the whole program; the end-to-end tests call it.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return usagef("no command")
	}
	cmd, args := args[0], args[1:]
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	configPath := fs.String("config", defaultConfigPath(), "config file")
	limit := fs.Int("limit", 0, "replay: at most this many messages (0: all)")
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return usagef("%s: %v", cmd, err)
	}
	want := map[string]int{"serve": 0, "migrate": 0, "check-config": 0, "backup": 1, "queues": 0, "replay": 1, "version": 0}
	n, ok := want[cmd]
	if !ok {
		return usagef("unknown command %q", cmd)
	}
	if len(pos) != n {
		return usagef("%s takes %d argument(s), got %d", cmd, n, len(pos))
	}

	switch cmd {
	case "version":
		fmt.Fprintln(stdout, "switchyard", version)
		return nil
	case "check-config":
		return checkConfig(*configPath, stdout)
	}

	cfg, err := LoadConfig(*configPath)
	if err != nil {
		return err
	}
	log := newLogger(cfg.Log, stderr)
	switch cmd {
	case "serve":
		return serve(ctx, cfg, log, func() { sdNotify(log, daemon.SdNotifyReady) })
	case "migrate":
		return migrate(ctx, cfg, stdout)
	case "backup":
		return backup(ctx, cfg, pos[0], stdout)
	case "queues":
		return listQueues(ctx, cfg, log, stdout)
	case "replay":
		return replay(ctx, cfg, log, pos[0], *limit, stdout)
	}
	return nil
}

// parseInterleaved parses flags that may stand before or after the positional
// arguments ("replay QUEUE -limit 5").
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

func defaultConfigPath() string {
	if p := os.Getenv("SWITCHYARD_CONFIG"); p != "" {
		return p
	}
	return "switchyard.toml"
}

// newLogger sets up log/slog once. Under systemd (JOURNAL_STREAM set) the time
// is left to journald, which stamps every line.
func newLogger(cfg LogConfig, w io.Writer) *slog.Logger {
	level := map[string]slog.Level{"debug": slog.LevelDebug, "info": slog.LevelInfo, "warn": slog.LevelWarn, "error": slog.LevelError}[cfg.Level]
	opts := &slog.HandlerOptions{Level: level}
	if os.Getenv("JOURNAL_STREAM") != "" {
		opts.ReplaceAttr = func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) == 0 && a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		}
	}
	if cfg.Format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// checkConfig validates the file and prints a summary with secrets masked, or
// every problem, one per line.
func checkConfig(path string, stdout io.Writer) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	defer f.Close()
	cfg, err := DecodeConfig(f)
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		return fmt.Errorf("%s is not valid:\n  %s", path, strings.ReplaceAll(err.Error(), "\n", "\n  "))
	}
	fmt.Fprintf(stdout, "%s is valid\n", path)
	cfg.Summary(stdout)
	return nil
}

func migrate(ctx context.Context, cfg *Config, stdout io.Writer) error {
	store, err := OpenStore(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	from, to, err := store.Migrate(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "database %s: schema version %d -> %d\n", cfg.Database.Path, from, to)
	return nil
}

func backup(ctx context.Context, cfg *Config, dest string, stdout io.Writer) error {
	if _, err := os.Stat(dest); err == nil {
		return fmt.Errorf("backup: %s exists; refusing to overwrite it", dest)
	}
	store, err := OpenStore(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	if err := store.Backup(ctx, dest); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "backup of %s written to %s; integrity_check ok\n", cfg.Database.Path, dest)
	return nil
}

// listQueues prints the ready-message count of all 12 queues on every broker.
func listQueues(ctx context.Context, cfg *Config, log *slog.Logger, stdout io.Writer) error {
	var brokers []*Broker
	for i, bc := range cfg.Brokers {
		b, err := ParseBroker(i, bc.URL)
		if err != nil {
			return err
		}
		brokers = append(brokers, b)
	}
	queues := operatorQueues(cfg, brokers, log)
	defer queues.Close()
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "BROKER\tQUEUE\tREADY")
	var unreachable int
	for _, b := range brokers {
		counts, err := queues.ReadyCounts(ctx, b, allQueues())
		if err != nil {
			unreachable++
			fmt.Fprintf(tw, "%s\t-\tunreachable: %v\n", b, err)
			continue
		}
		for _, q := range allQueues() {
			fmt.Fprintf(tw, "%s\t%s\t%d\n", b, q, counts[q])
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if unreachable == len(brokers) {
		return errors.New("no broker reachable")
	}
	return nil
}

// operatorQueues is the AMQP side for the queues and replay commands. They
// work on the queues as they are, so they never declare (and never fail on a
// declare that the running daemon's retry_ttl would contradict).
func operatorQueues(cfg *Config, brokers []*Broker, log *slog.Logger) *Queues {
	qcfg := cfg.Queue
	qcfg.DeclareTopology = false
	return NewQueues(qcfg, brokers, log)
}

// replay moves messages from QUEUE-error back to QUEUE on the active broker:
// each is published with a confirm before it is acked, so stopping half way
// loses nothing (at worst a message is in both, and the workers' duplicate
// check takes care of it).
func replay(ctx context.Context, cfg *Config, log *slog.Logger, queue string, limit int, stdout io.Writer) error {
	queue = strings.TrimSuffix(queue, "-error")
	known := false
	for _, q := range logicalQueues {
		known = known || q == queue
	}
	if !known {
		return usagef("replay: unknown queue %q (want one of %s)", queue, strings.Join(logicalQueues, ", "))
	}
	store, err := OpenStore(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	if _, _, err := store.Migrate(ctx); err != nil {
		return err
	}
	brokers, err := NewBrokers(ctx, cfg.Brokers, store, log)
	if err != nil {
		return err
	}
	st, err := brokers.State(ctx)
	if err != nil {
		return err
	}
	b, err := brokers.Get(st.Active)
	if err != nil {
		return err
	}
	queues := operatorQueues(cfg, brokers.List(), log)
	defer queues.Close()
	n, err := queues.Replay(ctx, b, queue, limit)
	fmt.Fprintf(stdout, "replayed %d message(s) from %s to %s on %s\n", n, errorQueue(queue), queue, b)
	return err
}

// Daemon is `switchyard serve`: the store, the brokers, the HTTP server and
// the workers, with one lifetime.
type Daemon struct {
	cfg     *Config
	log     *slog.Logger
	store   *Store
	brokers *Brokers
	queues  *Queues
	metrics *Metrics
	api     *API
	workers []*Worker
}

// NewDaemon opens and migrates the database and wires everything; nothing runs
// until Run.
func NewDaemon(ctx context.Context, cfg *Config, log *slog.Logger) (*Daemon, error) {
	store, err := OpenStore(ctx, cfg.Database)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Daemon, error) {
		store.Close()
		return nil, err
	}
	from, to, err := store.Migrate(ctx)
	if err != nil {
		return fail(err)
	}
	if from != to {
		log.Info("database migrated", "path", cfg.Database.Path, "from", from, "to", to)
	}
	brokers, err := NewBrokers(ctx, cfg.Brokers, store, log)
	if err != nil {
		return fail(err)
	}
	queues := NewQueues(cfg.Queue, brokers.List(), log)
	metrics := NewMetrics()
	webhook, err := NewWebhook(cfg, brokers, queues, metrics, log)
	if err != nil {
		return fail(err)
	}
	store.metrics, brokers.metrics, queues.metrics = metrics, metrics, metrics
	metrics.brokerState(brokers.Cached())
	d := &Daemon{cfg: cfg, log: log, store: store, brokers: brokers, queues: queues, metrics: metrics,
		api: NewAPI(cfg, store, brokers, queues, webhook, metrics, log)}
	w := cfg.Workers
	alerter := NewAlerter(cfg.Alerts, log.With("component", "alerts"))
	hc := func(url, name string) *HealthCheck { return NewHealthCheck(url, name, d.metrics, log) }
	service := newWorker("service", queueGitHub, serviceHandler(store, alerter, false, log), w.Window, 0, w, brokers, queues, log)
	service.health = hc(cfg.HealthChecks.Service, "service")
	database := newWorker("database-service", queueDatabase, databaseHandler(store, cfg.GitHub.BotAppID, log.With("worker", "database-service")), w.Window, 0, w, brokers, queues, log)
	database.health = hc(cfg.HealthChecks.DatabaseService, "database-service")
	cleanup := newWorker("cleanup", queueForbidden, serviceHandler(store, alerter, true, log), w.CleanupWindow, w.CleanupEvery, w, brokers, queues, log)
	cleanup.health = hc(cfg.HealthChecks.Cleanup, "cleanup")
	// The hooks worker talks to GitHub per message: it is not batched.
	for _, w := range []*Worker{service, database, cleanup} {
		w.Batch = store
	}
	d.workers = []*Worker{service, database, cleanup}
	if cfg.GitHub.AppID > 0 {
		app, err := NewGitHubApp(cfg.GitHub, log.With("component", "github"))
		if err != nil {
			queues.Close()
			return fail(err)
		}
		hooks := &Hooks{app: app, store: store, brokers: brokers, queues: queues, timeout: cfg.Queue.PublishTimeout, log: log.With("worker", "hooks")}
		// The poll runs between windows: a window longer than
		// hooks_poll_every would stretch it (SPEC §12.1).
		hw := newWorker("hooks", queueHooks, hooks.Handle, min(w.Window, w.HooksPollEvery), 0, w, brokers, queues, log)
		hw.Poll = func(ctx context.Context) error {
			n, err := hooks.Poll(ctx)
			if n > 0 {
				log.Info("hooks poll queued failed deliveries", "worker", "hooks", "queued", n)
			}
			return err
		}
		hw.PollEvery = w.HooksPollEvery
		hw.health = hc(cfg.HealthChecks.Hooks, "hooks")
		d.workers = append(d.workers, hw)
	}
	for _, w := range d.workers {
		w.consumed = cfg.ConsumedQueues()
	}
	return d, nil
}

// Run serves HTTP on ln and runs the workers until ctx ends, then shuts down:
// stop accepting HTTP, cancel the consumers (each finishes and acks the message
// in hand), close channels, connections and the database, within
// shutdown_timeout. ready, if set, is called once the listener accepts.
func (d *Daemon) Run(ctx context.Context, ln net.Listener, ready func()) error {
	srv := &http.Server{
		Handler:           d.api.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       2 * time.Minute,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(d.log.Handler(), slog.LevelWarn),
	}
	servers := []*http.Server{srv}
	listeners := []net.Listener{ln}
	if addr := d.cfg.Server.MetricsListen; addr != "" {
		mln, err := net.Listen("tcp", addr)
		if err != nil {
			ln.Close()
			return errors.Join(fmt.Errorf("listen %s (server.metrics_listen): %w", addr, err), d.queues.Close(), d.store.Close())
		}
		servers = append(servers, &http.Server{Handler: d.metrics.Handler(), ReadHeaderTimeout: 10 * time.Second})
		listeners = append(listeners, mln)
	}
	// The workers' context does not follow ctx: they stop only after the HTTP
	// server has stopped taking webhooks.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	g, gctx := errgroup.WithContext(workCtx)
	for i, s := range servers {
		g.Go(func() error {
			if err := s.Serve(listeners[i]); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("http %s: %w", listeners[i].Addr(), err)
			}
			return nil
		})
	}
	for _, w := range d.workers {
		g.Go(func() error { return w.Run(gctx) })
	}
	d.log.Info("switchyard serving", "version", version, "listen", ln.Addr().String(),
		"database", d.cfg.Database.Path, "brokers", len(d.brokers.List()))
	if ready != nil {
		ready()
	}

	// Under systemd with WatchdogSec, prove the process is alive.
	if interval, err := daemon.SdWatchdogEnabled(false); err == nil && interval > 0 {
		g.Go(func() error {
			t := time.NewTicker(interval / 2)
			defer t.Stop()
			for {
				select {
				case <-gctx.Done():
					return nil
				case <-t.C:
					sdNotify(d.log, daemon.SdNotifyWatchdog)
				}
			}
		})
	}

	stopped := make(chan struct{})
	g.Go(func() error {
		select {
		case <-ctx.Done():
		case <-gctx.Done():
		}
		close(stopped)
		d.log.Info("shutting down")
		sdNotify(d.log, daemon.SdNotifyStopping)
		sctx, cancel := context.WithTimeout(context.Background(), d.cfg.Server.ShutdownTimeout*3/4)
		defer cancel()
		var errs []error
		for _, s := range servers {
			if err := s.Shutdown(sctx); err != nil {
				errs = append(errs, fmt.Errorf("http shutdown: %w", err))
			}
		}
		cancelWork()
		return errors.Join(errs...)
	})

	done := make(chan error, 1)
	go func() { done <- g.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-stopped:
		select {
		case err = <-done:
		case <-time.After(d.cfg.Server.ShutdownTimeout):
			err = fmt.Errorf("shutdown took longer than %s", d.cfg.Server.ShutdownTimeout)
		}
	}
	return errors.Join(err, d.queues.Close(), d.store.Close())
}

// sdNotify tells systemd the daemon's state when NOTIFY_SOCKET is set
// (Type=notify); elsewhere it does nothing.
func sdNotify(log *slog.Logger, state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		log.Warn("cannot notify systemd", "state", state, "error", err)
	}
}

// serve is the serve command: listen, then run until SIGTERM or SIGINT.
func serve(ctx context.Context, cfg *Config, log *slog.Logger, ready func()) error {
	d, err := NewDaemon(ctx, cfg, log)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Server.Listen)
	if err != nil {
		d.queues.Close()
		d.store.Close()
		return fmt.Errorf("listen %s: %w", cfg.Server.Listen, err)
	}
	err = d.Run(ctx, ln, ready)
	log.Info("stopped", "error", err)
	return err
}
