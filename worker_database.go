package main

import (
	"context"
	"log/slog"
)

// databaseHandler is the database-service worker's handler (queue
// github-database): release tracking for every repository, then the typed
// tables for the bot App's Events, all in one transaction that also records
// the delivery as done, so a redelivered or retried Event changes nothing the
// second time. The payload is decoded for the tables with the Event, ahead
// of the transaction (databaseDecode): a payload that lacks a field the
// tables need is a permanent failure that writes nothing.
//
// An Event whose object is older than the typed row it maps to (a late
// synchronize after closed) leaves the row alone and is recorded with
// outcome stale; the handler says so (Found), and databaseRecord logs and
// counts it once the transaction committed.
func databaseHandler(botAppID int64) Handler {
	return func(ctx context.Context, tx *Tx, d Decoded) (Found, error) {
		rows, err := d.TableRows(botAppID)
		if err != nil {
			return Found{}, err
		}
		found := Found{Skipped: rows.SkippedReason}
		m := newRowMeta(d.Event)
		done, err := tx.MarkDelivery(ctx, "database-service", d.Event.Key(), func(tx *Tx) (string, error) {
			var err error
			if found.Stale, err = tx.writeTableRows(ctx, m, rows); err != nil || found.Stale == "" {
				return "", err
			}
			return "stale", nil
		})
		if err != nil {
			return Found{}, err
		}
		if !done {
			return Found{}, ErrDuplicate
		}
		return found, nil
	}
}

// databaseDecode reads a message with the rows of the typed tables, ahead
// of databaseHandler's transaction.
func databaseDecode(botAppID int64) func(Delivery) (Decoded, error) {
	return func(d Delivery) (Decoded, error) { return DecodeTableRows(d, botAppID) }
}

// databaseRecord records what databaseHandler found of a message whose
// transaction committed: a stale Event's counter and log line.
func databaseRecord(metrics *Metrics) func(log *slog.Logger, f Found) {
	return func(log *slog.Logger, f Found) {
		if f.Skipped != "" {
			log.Debug("event not used by the typed tables", "reason", f.Skipped)
		}
		if f.Stale != "" {
			log.Info("event older than the stored row, row kept", "table", f.Stale)
			metrics.staleEvent(f.Stale)
		}
	}
}
