package main

import (
	"context"
	"log/slog"
	"time"
)

// Retention deletes raw github rows older than database.raw_retention:
// a VPS disk is not bottomless, and the payloads are most of
// the database. The cleanup worker runs it once a cycle.
type Retention struct {
	store *Store
	keep  time.Duration // 0 keeps every row
	log   *slog.Logger
}

// Prune deletes batch after batch, each in its own short transaction, until
// no row older than the retention is left, and returns how many it deleted.
func (r *Retention) Prune(ctx context.Context) (int64, error) {
	if r.keep <= 0 {
		return 0, nil
	}
	cutoff := time.Now().Add(-r.keep)
	var total int64
	for ctx.Err() == nil {
		n, err := r.store.DeleteRawBefore(ctx, cutoff)
		total += n
		if err != nil || n < retentionBatch {
			if total > 0 {
				r.log.Info("raw rows past database.raw_retention deleted", "rows", total, "before", formatTime(cutoff))
			}
			return total, err
		}
	}
	return total, ctx.Err()
}
