package main

import (
	"context"
	"log/slog"
)

// databaseHandler is the database-service worker's handler (queue
// github-database): release tracking for every repository, then the typed
// tables for the bot App's Events, all in one transaction that also records
// the delivery as done, so a redelivered or retried Event changes nothing the
// second time. The payload is decoded for the tables before the handler's
// statements, by databasePrepare ahead of the transaction when the consumer
// batches: a payload that lacks a field the tables need is a permanent
// failure that writes nothing.
//
// An Event whose object is older than the typed row it maps to (a late
// synchronize after closed) leaves the row alone and is recorded with
// outcome stale.
func databaseHandler(botAppID int64, metrics *Metrics, log *slog.Logger) Handler {
	return func(ctx context.Context, tx *Tx, ev *Event) error {
		rows, err := ev.tableRows(botAppID)
		if err != nil {
			return err
		}
		if rows.SkippedReason != "" {
			loggerFrom(ctx, log).Debug("event not used by the typed tables", "reason", rows.SkippedReason)
		}
		m := newRowMeta(ev)
		var stale string
		done, err := tx.MarkDelivery(ctx, "database-service", ev.Key(), func(tx *Tx) (string, error) {
			var err error
			if stale, err = tx.writeTableRows(ctx, m, rows); err != nil || stale == "" {
				return "", err
			}
			return "stale", nil
		})
		if err != nil {
			return err
		}
		if stale != "" {
			loggerFrom(ctx, log).Info("event older than the stored row, row kept", "table", stale)
			metrics.staleEvent(stale)
		}
		if !done {
			return ErrDuplicate
		}
		return nil
	}
}

// databasePrepare decodes an Event for the typed tables ahead of
// databaseHandler (Event.tableRows).
func databasePrepare(botAppID int64) Preparer {
	return func(ev *Event) { _, _ = ev.tableRows(botAppID) }
}
