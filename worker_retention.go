package main

import (
	"context"
	"log/slog"
	"time"
)

// Retention keeps the database's size in hand without breaking
// idempotency: a VPS disk is not bottomless, and the payloads are most of
// the database. Payloads older than database.raw_retention are emptied;
// each delivery's identity (its github row without the payload, and the
// records of which workers finished it) stays until
// database.delivery_retention, and never less long than the payload, so a
// redelivery of a pruned delivery is still a duplicate. The cleanup worker
// runs under the retention lease (Run): compressing what older versions
// stored as text, and pruning every cleanup_every.
type Retention struct {
	store        *Store
	keepPayload  time.Duration // 0 keeps everything
	keepIdentity time.Duration
	// every is how often Compress looks again once none is left;
	// compressPause the pause between its batches.
	every, compressPause time.Duration
	log                  *slog.Logger
}

// NewRetention is the retention of cfg.
func NewRetention(store *Store, cfg *Config, log *slog.Logger) *Retention {
	return &Retention{store: store, keepPayload: time.Duration(cfg.Database.RawRetention),
		keepIdentity: max(time.Duration(cfg.Database.RawRetention), time.Duration(cfg.Database.DeliveryRetention)),
		every:        cfg.Workers.CleanupEvery, compressPause: 20 * time.Millisecond, log: log}
}

// Run prunes what is past its retention every cleanup_every (Prune), and
// compresses the payloads stored as text (by a version before
// the raw log was compressed, or by such a node beside this one), a batch
// at a time in short transactions, pausing between them so that writers
// never wait long, until ctx ends. Once none is left, it looks again every
// cleanup_every at the rows stored since, never again at the whole table
// (a million compressed rows would be read through each time).
// Interrupted anywhere, it loses nothing: each batch commits whole, and
// the next run goes on from the first row left.
func (r *Retention) Run(ctx context.Context, h Holding) error {
	write := func(ctx context.Context, fn func(tx *Tx) error) error { return h.WriteTx(ctx, r.store, fn) }
	var after int64
	var pruned time.Time
	mark := int64(-1) // the last id stored when this pass began; -1: none begun
	total := 0
	for {
		// Every row up to mark is stored when the pass begins: once it
		// finds none left, the next pass begins after mark. (On
		// PostgreSQL an older node's row still committing may hold an id
		// below it; the next start of serve looks at the whole table.)
		var err error
		if mark < 0 {
			if mark, err = r.store.LastStoredID(ctx); err != nil {
				mark = -1
			}
		}
		last, n := after, 0
		if err == nil {
			last, n, err = r.store.CompressOlderPayloads(ctx, after, write)
		}
		wait := r.compressPause
		switch {
		case err != nil:
			if ctx.Err() == nil {
				r.log.Warn("payloads not compressed; trying again", "error", err)
			}
			wait = r.every
		case last == after: // none left
			if total > 0 {
				r.log.Info("payloads stored before compression now compressed", "rows", total)
			}
			after, mark, total, wait = max(after, mark), -1, 0, r.every
		default:
			after, total = last, total+n
		}
		if time.Since(pruned) >= r.every {
			pruned = time.Now()
			if _, _, err := r.Prune(ctx, h); err != nil && ctx.Err() == nil {
				r.log.Warn("retention: rows past their retention not pruned; trying again", "error", err)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// Prune empties payloads, then deletes identities, batch after batch, each
// in its own short transaction, until nothing past its retention is left.
// It returns how many payloads it emptied and identities it deleted.
func (r *Retention) Prune(ctx context.Context, h Holding) (payloads, identities int64, err error) {
	if r.keepPayload <= 0 {
		return 0, 0, nil
	}
	now := time.Now()
	payloads, err = r.batches(ctx, h, now.Add(-r.keepPayload), (*Tx).PrunePayloadsBefore)
	if payloads > 0 {
		r.log.Info("payloads past database.raw_retention emptied", "rows", payloads)
	}
	if err != nil {
		return payloads, 0, err
	}
	identities, err = r.batches(ctx, h, now.Add(-r.keepIdentity), (*Tx).DeleteIdentitiesBefore)
	if identities > 0 {
		r.log.Info("deliveries past database.delivery_retention forgotten", "rows", identities)
	}
	return payloads, identities, err
}

// batches runs step, each time in a transaction of its own, until it does
// less than a batch.
func (r *Retention) batches(ctx context.Context, h Holding, cutoff time.Time, step func(*Tx, context.Context, time.Time) (int64, error)) (int64, error) {
	var total int64
	for ctx.Err() == nil {
		var n int64
		err := h.WriteTx(ctx, r.store, func(tx *Tx) (err error) { n, err = step(tx, ctx, cutoff); return err })
		total += n
		if err != nil || n < retentionBatch {
			return total, err
		}
	}
	return total, ctx.Err()
}
