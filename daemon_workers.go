// The daemon's workers, one constructor a kind: what each consumes, how it
// handles its messages, its cadence and its HealthChecks URL.

package main

import (
	"context"
	"log/slog"
)

// workerParts are what the workers are built from.
type workerParts struct {
	cfg     *Config
	store   *Store
	brokers *Brokers
	queues  *Queues
	metrics *Metrics
	alerter *Alerter
	usage   *Usage
	health  *HealthChecks
	tracer  Tracer // each consumed message's span
	log     *slog.Logger
}

// options are a worker's common options: its name and queue, the queues
// every worker reads, the metrics, and its HealthChecks ping (under the
// healthchecks lease).
func (p workerParts) options(name, queue, healthURL string) WorkerOptions {
	return WorkerOptions{Name: name, Queue: queue, Window: p.cfg.Workers.Window, Consumed: consumedQueues(p.cfg), Metrics: p.metrics,
		Health: p.health.For(healthURL, name)}
}

// events builds an Event worker whose batches commit in the store, with
// the brokers' counts.
func (p workerParts) events(o WorkerOptions, e EventOptions) *Worker {
	e.Batch, e.Usage, e.Tracer = p.store, p.usage, p.tracer
	return NewEventWorker(o, e, p.cfg.Workers, p.brokers, p.queues, p.log)
}

// service stores every Event of queue github in the raw log, with its
// statistics and alerts.
func (p workerParts) service() *Worker {
	return p.events(p.options("service", queueGitHub, p.cfg.HealthChecks.Service),
		EventOptions{Handle: serviceHandler(p.alerter, p.cfg.GitHub.AppID, false)})
}

// databaseService writes the typed tables of queue github-database.
func (p workerParts) databaseService() *Worker {
	bot := p.cfg.GitHub.BotAppID
	return p.events(p.options("database-service", queueDatabase, p.cfg.HealthChecks.DatabaseService),
		EventOptions{Handle: databaseHandler(bot), Decode: databaseDecode(bot), Record: databaseRecord(p.metrics)})
}

// cleanup stores github-forbidden's Events once every cleanup_every.
func (p workerParts) cleanup() *Worker {
	w := p.cfg.Workers
	o := p.options("cleanup", queueForbidden, p.cfg.HealthChecks.Cleanup)
	o.Window, o.Every, o.PollEvery = w.CleanupWindow, w.CleanupEvery, w.CleanupEvery
	return p.events(o, EventOptions{Handle: serviceHandler(p.alerter, p.cfg.GitHub.AppID, true)})
}

// hooks handles github-hooks' messages and polls GitHub's record of the
// App's deliveries. It talks to GitHub per message: no transaction of the
// worker's (no network I/O inside one). Its poll runs between windows: a
// window longer than hooks_poll_every would stretch it.
func (p workerParts) hooks(h *Hooks) *Worker {
	w := p.cfg.Workers
	o := p.options("hooks", queueHooks, p.cfg.HealthChecks.Hooks)
	o.Window, o.PollEvery = min(w.Window, w.HooksPollEvery), w.HooksPollEvery
	o.Poll = func(ctx context.Context, held Holding) error {
		n, err := h.Poll(ctx, held)
		if n > 0 {
			p.log.Info("hooks poll queued failed deliveries", "worker", "hooks", "queued", n)
		}
		return err
	}
	return NewMessageWorker(o, h.HandleMessages, w, p.brokers, p.queues, p.log)
}
