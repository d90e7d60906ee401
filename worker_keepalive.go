package main

import (
	"context"
	"log/slog"
	"time"
)

// depthEvery is how often the queue-depth gauges of every broker are
// refreshed.
const depthEvery = time.Minute

// Keepalive looks after every configured broker, read or not: the
// depths of its 12 queues for the gauges, refreshed every depthEvery, and
// every keepalive a check that none of them is missing. Free plans delete a
// queue that nobody declared, consumed or read for 28 days, and a spare
// broker may sit idle for months: with declare_topology on, the topology is
// declared again at each keepalive, so that a producer rotating to the spare
// finds its queues; with it off, a missing queue is a warning each time.
type Keepalive struct {
	brokers   []*Broker
	queues    *Queues
	metrics   *Metrics
	declare   bool
	every     time.Duration // depth refresh
	keepalive time.Duration
	log       *slog.Logger
}

// NewKeepalive watches brokers through queues: the depths every
// depthEvery (or every keepalive, when that is shorter) on every node
// (Run), the keepalive itself under its lease (Keep).
func NewKeepalive(cfg QueueConfig, brokers []*Broker, queues *Queues, metrics *Metrics, log *slog.Logger) *Keepalive {
	return &Keepalive{brokers: brokers, queues: queues, metrics: metrics, declare: cfg.DeclareTopology,
		every: min(depthEvery, cfg.KeepaliveEvery), keepalive: cfg.KeepaliveEvery, log: log.With("worker", "keepalive")}
}

// Run refreshes the depths until ctx ends; the first pass runs at once.
func (f *Keepalive) Run(ctx context.Context) error {
	return repeat(ctx, f.every, func() {
		for _, b := range f.brokers {
			f.look(ctx, b, false)
		}
	})
}

// Keep is the keepalive lease's job: every keepalive until ctx ends, the
// first at once, each broker's queues checked and, with declare_topology,
// declared again, while h is held.
func (f *Keepalive) Keep(ctx context.Context, h Holding) error {
	return repeat(ctx, f.keepalive, func() {
		for _, b := range f.brokers {
			if h.Held() {
				f.look(ctx, b, true)
			}
		}
	})
}

// repeat runs step at once and then every d until ctx ends.
func repeat(ctx context.Context, d time.Duration, step func()) error {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		step()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// look reads broker b's queues (Inspect records their depths) and, at a
// keepalive, puts back what is missing.
func (f *Keepalive) look(ctx context.Context, b *Broker, keepalive bool) {
	log := f.log.With("broker", b.String())
	_, missing, err := f.queues.Inspect(ctx, b)
	f.metrics.brokerSeen(b.Index, err)
	if err != nil {
		if ctx.Err() == nil {
			log.Warn("cannot read the broker's queues", "error", err)
		}
		return
	}
	if keepalive && len(missing) > 0 && !f.declare {
		log.Warn("queues missing on the broker, and declare_topology is off: declare them there", "missing", missing)
	}
	if keepalive && f.declare {
		if err := f.queues.Redeclare(ctx, b); err != nil {
			log.Warn("keepalive could not declare the topology", "missing", missing, "error", err)
		} else if len(missing) > 0 {
			log.Warn("queues were missing on the broker, declared again", "missing", missing)
		} else {
			log.Debug("keepalive declared the topology")
		}
	}
}
