// The Daemon: serve's parts, built by NewDaemon, run by Run, closed by
// Close, and reloaded on SIGHUP.

package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"sync"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sync/errgroup"
)

// Daemon is `switchyard serve`: the store, the brokers, the HTTP server and
// the workers, with one lifetime.
type Daemon struct {
	cfg       *Config
	log       *slog.Logger
	store     *Store
	brokers   *Brokers
	queues    *Queues
	metrics   *Metrics
	api       *API
	alerter   *Alerter
	alerts    *AlertSender
	keepalive *Keepalive
	usage     *Usage
	leases    *Leases
	retention *Retention
	refused   *RejectLog
	outbox    *Outbox
	workers   []*Worker
	// hooks is the hooks worker, which runs under its lease; nil without a
	// hook's ledger (the App's, a repository's or an organization's
	// webhook's).
	hooks        *Worker
	healthChecks *HealthChecks
	// tls serves HTTPS (server.tls); nil for plain HTTP.
	tls *serverTLS
	// tracer makes the API's request spans; stopTracing exports the spans
	// that wait and stops ([tracing]).
	tracer      Tracer
	stopTracing func(context.Context) error
}

// NewDaemon opens and migrates the database and wires everything; nothing runs
// until Run.
func NewDaemon(ctx context.Context, cfg *Config, log *slog.Logger) (*Daemon, error) {
	metrics := NewMetrics(MetricLabels{Version: version, Queues: logicalQueues, Tables: orderSafeTables,
		Outcomes: outcomes})
	// Tracing first: everything traced is handed its provider (the no-op
	// one when [tracing] is off), the store's PostgreSQL connections too.
	tp, stopTracing, err := NewTracing(cfg.Tracing, cfg.Server.NodeName, metrics.SpansDropped, log)
	if err != nil {
		return nil, err
	}
	store, err := OpenTracedStore(ctx, cfg.Database, metrics, tp)
	if err != nil {
		return nil, err
	}
	store.LogTo(log)
	fail := func(err error) (*Daemon, error) {
		store.Close()
		return nil, err
	}
	if err := store.Claim(ctx); err != nil {
		return fail(err)
	}
	from, to, err := store.Migrate(ctx)
	if err != nil {
		return fail(err)
	}
	if from != to {
		log.Info("database migrated", "database", store.Name(), "from", from, "to", to)
	}
	if to > store.Version() {
		log.Info("the database's schema is newer than this binary's, and its floor allows this binary: serving",
			"database_version", to, "binary_version", store.Version())
	}
	brokers, err := NewBrokers(ctx, cfg.Brokers, store, metrics, log)
	if err != nil {
		return fail(err)
	}
	brokers.JoinNodes(cfg.Server.NodeName, cfg.Server.LeaseTTL)
	leases := NewLeases(store, cfg.Server.NodeName, cfg.Server.LeaseTTL, leaseJobs(cfg), metrics, log)
	queues := NewQueues(cfg.Queue, brokers.List(), metrics, tp, log)
	leases.OnZstdReaders(queues.SetZstdReaders)
	for _, b := range brokers.List() {
		metrics.broker(b.Index, b.Host, b.Vhost)
	}
	refused := NewRejectLog(store, metrics, log.With("component", "webhook"))
	outbox := NewOutbox(cfg, store, brokers, queues, metrics, tp, log)
	webhook, err := NewWebhook(cfg, brokers, outbox, metrics, refused, log)
	if err != nil {
		return fail(err)
	}
	d := &Daemon{cfg: cfg, log: log, store: store, brokers: brokers, queues: queues, metrics: metrics, leases: leases, refused: refused,
		outbox: outbox, tracer: NewTracer(tp), stopTracing: stopTracing}
	alerter := NewAlerter(cfg.Alerts, log.With("component", "alerts"))
	d.alerter, d.alerts = alerter, NewAlertSender(store, alerter, log)
	d.keepalive = NewKeepalive(cfg.Queue, brokers.List(), queues, metrics, log)
	store.RegisterMetrics(metrics)
	var rotate func(ctx context.Context, h Holding, views []BudgetView, now time.Time) error
	if r := NewRotation(cfg, brokers, queues, store, d.alerter, log); r != nil {
		rotate = r.Check
	}
	d.usage = NewUsage(cfg, brokers, queues, store, d.alerter, metrics, log, rotate)
	d.retention = NewRetention(store, cfg, log.With("worker", "cleanup"))
	var hooks *Hooks
	ledgers, err := hookLedgers(cfg, log.With("component", "github"))
	if err != nil {
		queues.Close()
		return fail(err)
	}
	if len(ledgers) > 0 {
		hooks = NewHooks(cfg, ledgers, store, brokers, queues, alerter, tp, log.With("worker", "hooks"))
		hooks.RegisterMetrics(metrics)
	}
	d.healthChecks = NewHealthChecks(metrics, log)
	ws := workerParts{cfg: cfg, store: store, brokers: brokers, queues: queues, metrics: metrics, alerter: alerter,
		usage: d.usage, health: d.healthChecks, tracer: d.tracer, log: log}
	d.workers = []*Worker{ws.service(), ws.databaseService(), ws.cleanup()}
	if hooks != nil {
		d.hooks = ws.hooks(hooks)
		d.workers = append(d.workers, d.hooks)
	}
	d.api = NewAPI(cfg, store, brokers, queues, webhook, metrics, d.workers, d.usage, hooks, leases, log)
	if cfg.Server.TLS.On() {
		if d.tls, err = newServerTLS(cfg.Server.TLS, store, log); err != nil {
			queues.Close()
			return fail(err)
		}
		metrics.GaugesFunc("switchyard_tls_certificate_expiry_timestamp_seconds",
			"When the certificate served for the name expires, Unix seconds.", "name", d.tls.expiries)
		metrics.GaugesFunc("switchyard_tls_certificate_issued_timestamp_seconds",
			"When the certificate served for the name became valid (its not before), Unix seconds.", "name", d.tls.issued)
		d.api.ShowCertificates(d.tls.Certificates)
	}
	return d, nil
}

// Close closes what NewDaemon opened, once what uses it has ended: the
// API's last broker inspections, the broker connections (and the
// goroutines they own), then the database. Call it once Run has returned.
func (d *Daemon) Close() error {
	d.api.Close()
	if d.tls != nil {
		d.tls.stop()
	}
	return errors.Join(d.queues.Close(), d.store.Close())
}

// job is one of the daemon's jobs: what it runs, and the lease it runs
// under (everyNode: on every node, with the zero Holding). A job acts
// under its lease only through the Holding it is handed.
type job struct {
	lease string
	run   func(ctx context.Context, held Holding) error
}

// everyNode is the lease of a job every node runs.
const everyNode = ""

// jobs are the daemon's jobs, in the order they start.
func (d *Daemon) jobs() []job {
	plain := func(run func(ctx context.Context) error) func(context.Context, Holding) error {
		return func(ctx context.Context, _ Holding) error { return run(ctx) }
	}
	var jobs []job
	for _, w := range d.workers {
		lease := everyNode
		if w == d.hooks {
			lease = jobHooks
		}
		jobs = append(jobs, job{lease, w.Run})
	}
	jobs = append(jobs,
		job{everyNode, plain(d.leases.Run)},
		job{jobHealthChecks, d.healthChecks.Run},
		job{jobAlerts, d.alerts.Run},
		job{jobRetention, d.retention.Run},
		job{everyNode, plain(d.keepalive.Run)},
		job{jobKeepalive, d.keepalive.Keep},
		job{everyNode, plain(d.refused.Run)},
		job{everyNode, plain(d.outbox.Write)},
		job{outboxJob(d.cfg.Server.NodeName), d.outbox.Forward},
		job{jobSpool, d.outbox.MoveSpool},
		job{everyNode, plain(d.usage.Run)},
		job{jobBudget, d.usage.Budget},
	)
	if d.tls != nil && d.cfg.Server.TLS.ACME() {
		jobs = append(jobs, job{everyNode, plain(d.tls.Load)}, job{jobACME, d.tls.Order})
	}
	if d.store.Shared() {
		jobs = append(jobs, job{everyNode, plain(func(ctx context.Context) error { return d.brokers.Follow(ctx, followEvery) })})
	}
	if interval, err := daemon.SdWatchdogEnabled(false); err == nil && interval > 0 {
		jobs = append(jobs, job{everyNode, plain(func(ctx context.Context) error { d.watchdog(ctx, interval); return nil })})
	}
	return jobs
}

// Run serves HTTP on ln and runs the workers until ctx ends (or a server or a
// worker fails), then shuts down in order, within shutdown_timeout: stop
// taking webhooks, then stop the workers, each of which finishes and acks the
// message in hand. ready, if set, is called once the listener accepts. The
// Daemon stays open: Close closes it.
func (d *Daemon) Run(ctx context.Context, ls Listeners, ready func()) error {
	ln := ls.API
	var gate *gatedListener
	if tcp, ok := ln.(*net.TCPListener); ok {
		gate = newGatedListener(tcp)
		ln = gate
	}
	if d.tls != nil {
		// The issuer before the servers: the plain listener's handler
		// answers ACME's HTTP-01 through it.
		plain := ""
		if ls.HTTP != nil {
			plain = ls.HTTP.Addr().String()
		}
		if err := d.tls.prepare(ln.Addr().String(), plain); err != nil {
			d.log.Error("HTTPS: certificates not managed", "error", err)
		}
	}
	servers, listeners, err := d.httpServers(ln, ls.HTTP)
	if err != nil {
		return err
	}
	if gate != nil {
		servers[0].ConnState = gate.ConnState
	}

	// The workers' context does not follow ctx: they stop only after the
	// HTTP servers have stopped taking webhooks.
	workCtx, stopWork := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWork()
	work, wctx := errgroup.WithContext(workCtx)
	for _, j := range d.jobs() {
		// A job of no lease (everyNode) runs at once, with the zero
		// Holding; a job under one, whenever this node holds it.
		lease := d.leases.Lease(j.lease)
		if lease == nil && j.lease != everyNode {
			return fmt.Errorf("a job under lease %q, which this node does not keep (leaseJobs)", j.lease)
		}
		work.Go(func() error { return lease.Run(wctx, j.run) })
	}
	// The active broker dialed before the first webhook is taken, so that
	// one that waited in the socket's queue through a restart is answered
	// at once; a broker down now is the 503 of any other moment.
	if b, err := d.brokers.Get(d.brokers.Cached().Active); err == nil {
		dctx, cancel := context.WithTimeout(ctx, d.cfg.Queue.CallTimeout)
		if err := d.queues.Reachable(dctx, b); err != nil {
			d.log.Warn("the active broker is not reachable: webhooks are committed to the outbox, answered 202, and forwarded once it is",
				"broker", b.String(), "error", err)
		}
		cancel()
	}
	// Each server's Serve returns once Shutdown has closed its listener;
	// Run waits for them before it returns.
	served := make(chan error, len(servers))
	var serving sync.WaitGroup
	defer serving.Wait()
	for i, s := range servers {
		serving.Go(func() {
			if err := s.Serve(listeners[i]); !errors.Is(err, http.ErrServerClosed) {
				served <- err
			}
		})
	}
	d.log.Info("switchyard serving", "version", version, "node", d.cfg.Server.NodeName, "listen", ln.Addr().String(),
		"https", d.tls != nil, "database", d.store.Name(), "brokers", len(d.brokers.List()))
	if ready != nil {
		ready()
	}

	// Until a signal, or a server or a worker fails.
	var errs []error
	select {
	case <-ctx.Done():
	case err := <-served:
		errs = append(errs, fmt.Errorf("http: %w", err))
	case <-wctx.Done():
	}
	d.log.Info("shutting down")
	sdNotify(d.log, daemon.SdNotifyStopping)
	errs = append(errs, d.shutdown(servers, gate, stopWork, work)...)
	return errors.Join(errs...)
}

// shutdown stops the daemon in order, all of it within shutdown_timeout
// whatever the database does: the drain (server.drain_delay), then no
// more webhooks taken, then the workers and the leases, then the usage
// flush. It returns what failed on the way.
func (d *Daemon) shutdown(servers []*http.Server, gate *gatedListener, stopWork context.CancelFunc, work *errgroup.Group) (errs []error) {
	timeout := d.cfg.Server.ShutdownTimeout
	deadline := time.Now().Add(timeout)

	// 0. The drain: /readyz says so, every endpoint still serves, and a
	// balancer sends the next webhooks to another node.
	if drain := d.cfg.Server.DrainDelay; drain > 0 {
		d.api.Drain()
		d.log.Info("draining: /readyz answers 503 while webhooks are still taken", "drain_delay", drain.String())
		time.Sleep(drain)
	}

	// 1. Stop taking webhooks: every one answered 202 is on a broker. A
	// socket systemd passed stays open: what arrives now waits in its
	// queue for the next process. Every connection taken is answered.
	sctx, cancel := context.WithDeadline(context.Background(), deadline.Add(-timeout/4))
	if gate != nil {
		gate.Pause()
		servers[0].SetKeepAlivesEnabled(false)
		gate.WaitClosed(sctx)
	}
	for _, s := range servers {
		if err := s.Shutdown(sctx); err != nil {
			errs = append(errs, fmt.Errorf("http shutdown: %w", err))
		}
	}
	cancel()

	// 2. Stop the workers; each finishes and acks the message in hand, and
	// the leases are given up. Past the workers' share of the deadline,
	// what is still in hand is abandoned: its transaction (waiting on a
	// locked database, say) rolls back and the broker gives its messages
	// back. The workers end before Close closes the store under one.
	workDeadline := deadline.Add(-timeout / 10)
	d.leases.StopBy(workDeadline)
	stopWork()
	finished := make(chan error, 1)
	go func() { finished <- work.Wait() }()
	select {
	case err := <-finished:
		errs = append(errs, err)
	case <-time.After(time.Until(workDeadline)):
		d.log.Warn("server.shutdown_timeout nearly passed: the messages in hand are left unacknowledged, and the broker gives them back",
			"shutdown_timeout", timeout.String())
		d.queues.Abandon()
		errs = append(errs, <-finished)
	}

	// 3. What the brokers cost since the last write, within what is left.
	fctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	if err := d.usage.Flush(fctx); err != nil {
		d.log.Warn("broker usage since the last write not written at shutdown", "error", err)
	}
	// 4. The spans that wait for the collector, within what is left: one
	// that is down or slow holds the exit no longer.
	if err := d.stopTracing(fctx); err != nil {
		d.log.Warn("tracing: spans not exported at shutdown", "error", err)
	}
	return errs
}

// followEvery is how often a node sharing the database reads the broker
// state that another node may have changed.
const followEvery = time.Second

// httpServers are the API server on ln (HTTPS with server.tls), the plain
// HTTP server on plain when it is set, and, with server.metrics_listen,
// the metrics server on its own listener.
func (d *Daemon) httpServers(ln, plain net.Listener) ([]*http.Server, []net.Listener, error) {
	handler := d.tracer.requests(d.api.Handler())
	servers := []*http.Server{{
		Handler:           handler,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       2 * time.Minute,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(d.log.Handler(), slog.LevelWarn),
	}}
	listeners := []net.Listener{ln}
	if d.tls != nil {
		servers[0].TLSConfig = d.tls.config
		listeners[0] = tls.NewListener(ln, d.tls.config)
	}
	if plain != nil {
		_, port, _ := net.SplitHostPort(ln.Addr().String())
		servers = append(servers, &http.Server{Handler: d.tls.plainHandler(port), ReadHeaderTimeout: 10 * time.Second,
			ReadTimeout: 10 * time.Second, ErrorLog: servers[0].ErrorLog})
		listeners = append(listeners, plain)
	}
	if addr := d.cfg.Server.MetricsListen; !d.cfg.Server.metricsOnAPI() {
		mln, err := net.Listen("tcp", addr)
		if err != nil {
			ln.Close()
			return nil, nil, fmt.Errorf("listen %s (server.metrics_listen): %w", addr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", d.metrics.Handler())
		if d.cfg.Server.Pprof {
			// Profiles of the running daemon, for its operator only: this
			// listener is on loopback unless the operator moved it.
			mux.HandleFunc("/debug/pprof/", pprof.Index)
			mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
			mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
			mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
			mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		}
		servers = append(servers, &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second})
		listeners = append(listeners, mln)
	}
	return servers, listeners, nil
}

// watchdog proves to systemd (WatchdogSec) that the process is alive.
func (d *Daemon) watchdog(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			sdNotify(d.log, daemon.SdNotifyWatchdog)
		}
	}
}

// sdNotify tells systemd the daemon's state when NOTIFY_SOCKET is set
// (Type=notify); elsewhere it does nothing.
func sdNotify(log *slog.Logger, state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		log.Warn("cannot notify systemd", "state", state, "error", err)
	}
}

// gcPercentUnderLimit is the collector's GOGC while a soft memory limit
// holds the heap. The heap of a running daemon is small and turns over
// fast (every webhook is garbage once stored), so the default 100 collects
// often and spends a visible share of the CPU per webhook on it; a higher
// value collects less often but lets the heap, and the peak RSS a small
// VPS pays for, grow to that multiple of what is live. 150 is between the
// two; BENCHMARKS.md has the measurements.
const gcPercentUnderLimit = 150
