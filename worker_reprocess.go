package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"
)

// Reprocess derives the typed tables and release tracking again from the
// raw log's payloads: each stored copy, in received order, decoded as
// database-service decodes its message (DecodeEvent, tableRows) and
// written by the same order-safe upserts (writeTableRows), a bounded batch
// per short transaction. The upserts change a row only when the delivery
// brings something it does not hold and no later-received delivery wrote
// it, so a second run changes nothing, and a run beside serve never steps
// a row back. It writes no worker records: the deliveries stay as
// database-service recorded them.

// Reasons a raw row is skipped, as the summary groups them.
const (
	skipPruned     = "payload pruned by retention (database.raw_retention)"
	skipForbidden  = "from outside the allowed sources (github-forbidden)"
	skipNotBot     = "not the bot App's copy (github.bot_app_id)"
	skipUndecoded  = "undecodable"
	skipNoTable    = "no typed table uses the event"
	skipWriteError = "could not be written"
)

// reprocessBatch is the most raw rows one transaction writes, and
// reprocessBatchBytes the most payload bytes one batch reads: short
// transactions, so that serve's writers wait little behind them, and a
// bounded memory whatever the payloads' sizes.
const (
	reprocessBatch      = 200
	reprocessBatchBytes = 16 << 20
)

// ReprocessOptions say what reprocess reads and whether it writes.
type ReprocessOptions struct {
	Filter RawFilter
	// DryRun rolls each batch back: it tells what a run would write, each
	// batch as if the ones before it had not been written.
	DryRun bool
	// Batch is the most raw rows one transaction writes (0:
	// reprocessBatch); Pause the rest between batches, in which serve's
	// writers go first.
	Batch int
	Pause time.Duration
	// Progress, when set, is told after every batch.
	Progress func(ReprocessSummary)
}

// ReprocessSummary is what a run did: rows seen of Total, those whose
// typed rows changed (Written) or were already as the delivery makes them,
// or newer (Unchanged), and the ones skipped, by reason.
type ReprocessSummary struct {
	Total, Seen, Written, Unchanged int64
	Skipped                         map[string]int64
	Started                         time.Time
}

// Reprocess runs over the raw log that o picks, until its end or ctx's.
func Reprocess(ctx context.Context, store *Store, botAppID int64, o ReprocessOptions, log *slog.Logger) (ReprocessSummary, error) {
	sum := ReprocessSummary{Skipped: map[string]int64{}, Started: time.Now()}
	total, err := store.CountRaw(ctx, o.Filter)
	if err != nil {
		return sum, err
	}
	sum.Total = total
	if o.Batch <= 0 {
		o.Batch = reprocessBatch
	}
	var after *RawCopy
	for {
		batch, err := store.RawCopies(ctx, o.Filter, after, o.Batch, reprocessBatchBytes)
		if err != nil || len(batch) == 0 {
			return sum, err
		}
		after = &batch[len(batch)-1]
		var events []reprocessed
		for i := range batch {
			ev, rows, reason := reprocessEvent(&batch[i], botAppID)
			if reason != "" {
				sum.Skipped[reason]++
				continue
			}
			events = append(events, reprocessed{ev, rows})
		}
		written, unchanged, failed, err := writeReprocessed(ctx, store, events, o.DryRun, log)
		if err != nil {
			return sum, err
		}
		sum.Seen += int64(len(batch))
		sum.Written += written
		sum.Unchanged += unchanged
		if failed > 0 {
			sum.Skipped[skipWriteError] += failed
		}
		if o.Progress != nil {
			o.Progress(sum)
		}
		select {
		case <-ctx.Done():
			return sum, ctx.Err()
		case <-time.After(o.Pause):
		}
	}
}

// reprocessed is a raw row's Event and the typed rows it writes.
type reprocessed struct {
	ev   *Event
	rows *tableRows
}

// reprocessEvent is the Event a raw row makes and its typed rows, or why
// the row is skipped.
func reprocessEvent(c *RawCopy, botAppID int64) (*Event, *tableRows, string) {
	switch {
	case c.Forbidden:
		return nil, nil, skipForbidden
	case c.Pruned:
		return nil, nil, skipPruned
	case c.Unreadable != nil:
		return nil, nil, skipUndecoded
	}
	headers := map[string]string{hdrDelivery: c.GUID, hdrEvent: c.Event, hdrTargetType: c.TargetType,
		hdrSourceIP: c.SourceIP, hdrReceivedAt: formatTime(c.ReceivedAt)}
	if c.Hook != 0 {
		headers[hdrHookID] = strconv.FormatInt(c.Hook, 10)
	}
	if c.TargetID != 0 {
		headers[hdrTargetID] = strconv.FormatInt(c.TargetID, 10)
	}
	d, err := DecodeTableRows(Delivery{MessageID: c.GUID, Type: c.Event, Body: c.Payload, Timestamp: c.ReceivedAt,
		Header: func(k string) string { return headers[k] }}, botAppID)
	if err != nil || d.RowsErr != nil {
		return nil, nil, skipUndecoded
	}
	ev, rows := d.Event, d.Rows
	if rows.empty() {
		if d, ok := tableDecoders[ev.Name]; ok && !d.everyApp && !isBotEvent(ev, botAppID) {
			return nil, nil, skipNotBot
		}
		return nil, nil, skipNoTable
	}
	return ev, rows, ""
}

// errDryRun rolls a dry run's batch back.
var errDryRun = errors.New("dry run: rolled back")

// writeReprocessed writes the typed rows of events as one RerunBatch: one
// that fails is counted, and logged, and the others are written.
func writeReprocessed(ctx context.Context, store *Store, events []reprocessed, dryRun bool, log *slog.Logger) (written, unchanged, failed int64, err error) {
	changed := make([]bool, len(events))
	fails, err := store.WriteRerunBatch(ctx, RerunBatch{
		Parts: len(events),
		Part: func(ctx context.Context, tx *Tx, i int) error {
			before, err := tx.Changed(ctx)
			if err == nil {
				_, err = tx.writeTableRows(ctx, newRowMeta(events[i].ev), events[i].rows)
			}
			after, cerr := tx.Changed(ctx)
			changed[i] = after > before
			return errors.Join(err, cerr)
		},
		Last: func(context.Context, *Tx) error {
			if dryRun {
				return errDryRun
			}
			return nil
		},
	})
	if errors.Is(err, errDryRun) {
		err = nil
	}
	if err != nil {
		return 0, 0, 0, fmt.Errorf("reprocess: write a batch: %w", err)
	}
	for i, e := range events {
		switch {
		case fails[i] != nil:
			failed++
			log.Warn("reprocess: a delivery's typed rows could not be written", "delivery_id", e.ev.DeliveryID,
				"hook_id", e.ev.HookID, "event", e.ev.Name, "error", fails[i])
		case changed[i]:
			written++
		default:
			unchanged++
		}
	}
	return written, unchanged, failed, nil
}
