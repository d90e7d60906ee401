package main

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// RejectLog keeps the refused webhooks (Rejection) in rejected_webhooks.
// The webhook endpoint notes each refusal without waiting; once a second
// the log writes what it holds in one short transaction, and prunes the
// table to the newest rejectionsKept of rejectionsKeptFor once a minute. It
// holds at most rejectsPerFlush a second: a flood of refused requests
// costs one transaction and that many rows a second, the rest only
// counted (switchyard_webhook_rejections_unrecorded_total, and a warning).
type RejectLog struct {
	store   *Store
	metrics *Metrics
	log     *slog.Logger
	every   time.Duration

	mu      sync.Mutex
	pending []Rejection
	dropped int64
}

const (
	// rejectsPerFlush bounds the refusals written a flush (a second).
	rejectsPerFlush = 100
	// rejectsPruneEvery is how often the table is pruned.
	rejectsPruneEvery = time.Minute
)

// NewRejectLog writes refusals into store.
func NewRejectLog(store *Store, metrics *Metrics, log *slog.Logger) *RejectLog {
	return &RejectLog{store: store, metrics: metrics, log: log, every: time.Second}
}

// Note keeps r for the next flush, or counts it when this second's are
// taken. It never waits.
func (l *RejectLog) Note(r Rejection) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.pending) >= rejectsPerFlush {
		l.dropped++
		return
	}
	l.pending = append(l.pending, r)
}

// Run flushes every second until ctx ends, then once more: the refusals
// of the last second, once the webhook endpoint has stopped. A flush is
// not cut short by ctx's end (it takes what is pending out of the log
// first, and would lose it): each has rejectsFlushTimeout of its own.
func (l *RejectLog) Run(ctx context.Context) error {
	tick := time.NewTicker(l.every)
	defer tick.Stop()
	flush := func(prune bool) bool {
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rejectsFlushTimeout)
		defer cancel()
		return l.flush(fctx, prune)
	}
	var pruned time.Time
	for {
		select {
		case <-ctx.Done():
			flush(false)
			return nil
		case now := <-tick.C:
			prune := now.Sub(pruned) >= rejectsPruneEvery && ctx.Err() == nil
			if flush(prune) && prune {
				pruned = now
			}
		}
	}
}

// rejectsFlushTimeout bounds one flush's transaction.
const rejectsFlushTimeout = 5 * time.Second

// flush writes what is pending, pruning too when asked, and reports
// whether the transaction went through. What it could not write is
// logged and let go: a refusal is worth a row, not a retry.
func (l *RejectLog) flush(ctx context.Context, prune bool) bool {
	l.mu.Lock()
	rs, dropped := l.pending, l.dropped
	l.pending, l.dropped = nil, 0
	l.mu.Unlock()
	if dropped > 0 {
		l.metrics.rejectionsUnrecorded(dropped)
		l.log.Warn("refused webhooks over the recorded rate: counted, not recorded", "recorded", len(rs), "unrecorded", dropped,
			"per_second", rejectsPerFlush)
	}
	if len(rs) == 0 && !prune {
		return true
	}
	err := l.store.WriteTx(ctx, func(tx *Tx) error {
		if err := tx.RecordRejections(ctx, rs); err != nil {
			return err
		}
		if prune {
			return tx.PruneRejections(ctx, time.Now())
		}
		return nil
	})
	if err != nil && len(rs) == 0 {
		l.log.Warn("refused webhooks not pruned", "error", err)
		return false
	}
	if err != nil {
		l.metrics.rejectionsUnrecorded(int64(len(rs)))
		l.log.Warn("refused webhooks not recorded", "count", len(rs), "error", err)
		return false
	}
	return true
}
