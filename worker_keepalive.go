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
	// lease is the keepalive job's: the depths are every node's gauges,
	// the keepalive itself its holder's.
	lease *Lease
	log   *slog.Logger
}

// NewKeepalive watches brokers through queues, refreshing the depths every
// depthEvery (or every keepalive, when that is shorter).
// The keepalive itself runs while lease is held (nil: always).
func NewKeepalive(cfg QueueConfig, brokers []*Broker, queues *Queues, lease *Lease, metrics *Metrics, log *slog.Logger) *Keepalive {
	return &Keepalive{brokers: brokers, queues: queues, lease: lease, metrics: metrics, declare: cfg.DeclareTopology,
		every: min(depthEvery, cfg.KeepaliveEvery), keepalive: cfg.KeepaliveEvery, log: log.With("worker", "keepalive")}
}

// Run refreshes and keeps alive until ctx ends; the first pass runs at once.
func (f *Keepalive) Run(ctx context.Context) error {
	t := time.NewTicker(f.every)
	defer t.Stop()
	var lastKeepalive time.Time
	for {
		keepalive := time.Since(lastKeepalive) >= f.keepalive && f.lease.Held()
		if keepalive {
			lastKeepalive = time.Now()
		}
		for _, b := range f.brokers {
			f.look(ctx, b, keepalive)
		}
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
