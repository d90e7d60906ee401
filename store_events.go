package main

import (
	"context"
	"fmt"
	"time"
)

// Storing a delivery: its raw row, with its statistics, gap and alerts, and
// each worker's mark that it finished it.

// InsertEvent writes the raw Event, counts it in its 6-hour bucket and
// queues its alert on each of channels (alert_outbox), in tx. A delivery is
// one hook's copy of an event (hook, GUID): the first copy of an event is
// counted and alerted, a copy for another hook is stored and changes
// neither. It reports false, and changes nothing but the copy's duplicate
// count, when this hook's copy is already stored: a retried or redelivered
// message must not count or alert twice.
func (tx *Tx) InsertEvent(ctx context.Context, ev *Event, forbidden bool, channels ...string) (inserted bool, err error) {
	// As the event's first copy: any unique key that conflicts (this
	// hook's copy stored, or another hook's first) stores nothing. The
	// unique first_copy key decides, inside the transaction, even when
	// two nodes store two copies at once.
	args := []any{ev.DeliveryID, ev.Name, ev.Action, ev.HookID, ev.TargetType, nullInt(ev.TargetID),
		nullInt(ev.InstallationID), ev.Repository, ev.Sender, ev.SourceIP, forbidden,
		packedPayload(ev), formatTime(ev.ReceivedAt), formatTime(time.Now()), ev.Broker, nullText(ev.TraceID)}
	res, err := tx.write(ctx, guessed(&tx.s.guesses.firstCopy), insertGitHub+"1) ON CONFLICT DO NOTHING", args...)
	if err != nil {
		return false, fmt.Errorf("insert github: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 1 {
		if _, err = tx.write(ctx, ahead(1), `INSERT INTO github_statistics_6h (bucket, event, action, count) VALUES ($1, $2, $3, 1)
			ON CONFLICT (bucket, event, action) DO UPDATE SET count = github_statistics_6h.count + 1`,
			statisticsBucket(ev.ReceivedAt), ev.Name, ev.Action); err != nil {
			return false, fmt.Errorf("count statistics: %w", err)
		}
		return true, tx.queueAlerts(ctx, ev.DeliveryID, channels)
	}
	// A copy for another hook after the first: stored, neither counted
	// nor alerted.
	if res, err = tx.write(ctx, atOnce, insertGitHub+"NULL) ON CONFLICT (delivery_id, hook_id) DO NOTHING", args...); err != nil {
		return false, fmt.Errorf("insert github: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 1 {
		return true, nil
	}
	// Stored before: the story of the delivery says it came again.
	if _, err := tx.write(ctx, atOnce, "UPDATE github SET duplicates = duplicates + 1, last_duplicate_at = $1 WHERE delivery_id = $2 AND hook_id = $3",
		formatTime(time.Now()), ev.DeliveryID, ev.HookID); err != nil {
		return false, fmt.Errorf("count a duplicate: %w", err)
	}
	return false, nil
}

// insertGitHub is the insert of a github row but for its first_copy value
// and what follows.
const insertGitHub = `INSERT INTO github (delivery_id, event, action, hook_id, target_type,
	target_id, installation_id, repository, sender, source_ip, forbidden, payload, payload_zstd, received_at, processed_at, broker, trace_id, first_copy)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, '', $12, $13, $14, $15, $16, `

// MarkDelivery runs fn and records that worker finished the delivery, in tx,
// with the outcome fn returns ("" is done). It reports false, without
// running fn, when the worker already finished it.
func (tx *Tx) MarkDelivery(ctx context.Context, worker string, key DeliveryKey, fn func(tx *Tx) (outcome string, err error)) (done bool, err error) {
	res, err := tx.write(ctx, guessed(&tx.s.guesses.mark), `INSERT INTO worker_deliveries (worker, delivery_id, hook_id, processed_at)
		VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING`, worker, key.GUID, key.Hook, formatTime(time.Now()))
	if err != nil {
		return false, fmt.Errorf("mark delivery: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return false, nil
	}
	if fn == nil {
		return true, nil
	}
	outcome, err := fn(tx)
	if err != nil || outcome == "" {
		return true, err
	}
	_, err = tx.write(ctx, atOnce, "UPDATE worker_deliveries SET outcome = $1 WHERE worker = $2 AND delivery_id = $3 AND hook_id = $4",
		outcome, worker, key.GUID, key.Hook)
	return true, err
}

// Finished reports whether worker finished the delivery (MarkDelivery).
func (s *Store) Finished(ctx context.Context, worker string, key DeliveryKey) (bool, error) {
	var n int
	err := s.pool().row(ctx, "SELECT count(*) FROM worker_deliveries WHERE worker = $1 AND delivery_id = $2 AND hook_id = $3",
		worker, key.GUID, key.Hook).Scan(&n)
	if err != nil {
		return false, fmt.Errorf("read worker_deliveries: %w", err)
	}
	return n > 0, nil
}
