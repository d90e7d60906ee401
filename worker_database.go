package main

import (
	"context"
	"log/slog"
)

// databaseHandler is the database-service worker's handler (queue
// github-database): release tracking for every repository, then the typed
// tables for the bot App's Events, all in one transaction that also records
// the delivery as done, so a redelivered or retried Event changes nothing the
// second time. The payload is decoded before the transaction: a payload that
// lacks a field the tables need is a permanent failure and holds no lock.
func databaseHandler(store *Store, botAppID int64, log *slog.Logger) Handler {
	return func(ctx context.Context, tx *Tx, ev *Event) error {
		rows, err := decodeTableRows(ev, botAppID)
		if err != nil {
			return err
		}
		if rows.SkippedReason != "" {
			loggerFrom(ctx, log).Debug("event not used by the typed tables", "reason", rows.SkippedReason)
		}
		m := newRowMeta(ev)
		done, err := store.MarkDelivery(ctx, tx, "database-service", ev.DeliveryID, func(tx *Tx) error {
			return tx.writeTableRows(ctx, m, rows)
		})
		if err != nil {
			return err
		}
		if !done {
			return ErrDuplicate
		}
		return nil
	}
}
