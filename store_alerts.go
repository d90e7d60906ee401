package main

import (
	"context"
	"fmt"
	"time"
)

// queueAlerts writes one alert_outbox row per channel for a delivery, inside
// the transaction that stores it.
func (t *Tx) queueAlerts(ctx context.Context, deliveryID string, channels []string) error {
	now := formatTime(time.Now())
	for _, c := range channels {
		if _, err := t.write(ctx, ahead(anyRows), `INSERT INTO alert_outbox (delivery_id, channel, created_at, next_at)
			VALUES ($1, $2, $3, $4) ON CONFLICT (delivery_id, channel) DO NOTHING`, deliveryID, c, now, now); err != nil {
			return fmt.Errorf("queue alert: %w", err)
		}
	}
	return nil
}

// outboxAlert is an alert due to be sent: its row and the Event it announces.
type outboxAlert struct {
	ID        int64
	Attempts  int
	Forbidden bool
	Event     *Event
}

// DueAlerts reads up to limit unsent alerts of channel whose time has come,
// oldest first, with their Events. A gap's alert (gapAlertID) reads as an
// Event named "gap" whose action is the missing delivery's event, the alert
// that a gap was given up on (unrecoverableAlertID) as one named
// "unrecoverable", with the reason as its payload; a broker's budget and
// block alerts as "budget" and "blocked", a refused ledger's as "ledger",
// their id telling the rest.
func (s *Store) DueAlerts(ctx context.Context, channel string, now time.Time, limit int) ([]outboxAlert, error) {
	rows, err := s.pool().rows(ctx, `SELECT o.id, o.attempts, coalesce(g.forbidden, 0),
			coalesce(g.delivery_id, dg.guid, o.delivery_id),
			coalesce(g.event, CASE WHEN o.delivery_id LIKE 'gap:%' THEN 'gap' WHEN o.delivery_id LIKE 'budget:%' THEN 'budget'
				WHEN o.delivery_id LIKE 'blocked:%' THEN 'blocked' WHEN o.delivery_id LIKE 'ledger:%' THEN 'ledger' ELSE 'unrecoverable' END),
			coalesce(g.action, dg.event, ''), coalesce(g.repository, ''), coalesce(g.sender, ''), coalesce(g.source_ip, ''),
			coalesce(g.payload, dg.last_error, '{}'), g.payload_zstd, coalesce(g.received_at, dg.delivered_at, o.created_at)
		FROM alert_outbox o
		LEFT JOIN github g ON g.id = (SELECT min(id) FROM github WHERE delivery_id = o.delivery_id)
		LEFT JOIN delivery_gaps dg ON ((o.delivery_id LIKE 'gap:%' AND dg.guid = substr(o.delivery_id, 5))
			OR (o.delivery_id LIKE 'unrecoverable:%' AND dg.guid = substr(o.delivery_id, 15)))
			AND NOT EXISTS (SELECT 1 FROM delivery_gaps d2 WHERE d2.guid = dg.guid AND d2.hook_id < dg.hook_id)
		WHERE o.channel = $1 AND o.sent_at IS NULL AND o.next_at <= $2
			AND (g.id IS NOT NULL OR dg.guid IS NOT NULL OR o.delivery_id LIKE 'budget:%' OR o.delivery_id LIKE 'blocked:%'
				OR o.delivery_id LIKE 'ledger:%')
		ORDER BY o.next_at, o.id LIMIT $3`,
		channel, formatTime(now), limit)
	if err != nil {
		return nil, fmt.Errorf("read due alerts: %w", err)
	}
	defer rows.Close()
	var out []outboxAlert
	for rows.Next() {
		var a outboxAlert
		var ev Event
		var payload, received string
		var compressed []byte
		if err := rows.Scan(&a.ID, &a.Attempts, &a.Forbidden, &ev.DeliveryID, &ev.Name, &ev.Action,
			&ev.Repository, &ev.Sender, &ev.SourceIP, &payload, &compressed, &received); err != nil {
			return nil, fmt.Errorf("read due alerts: %w", err)
		}
		// An alert goes out even when its payload does not inflate: what
		// it says comes from the row; the payload adds a link.
		if ev.Payload, err = rowPayload(payload, compressed); err != nil {
			ev.Payload = []byte("{}")
		}
		ev.ReceivedAt, _ = time.Parse(time.RFC3339Nano, received)
		a.Event = &ev
		out = append(out, a)
	}
	return out, rows.Err()
}

// AlertSent marks an alert sent, and the event's first copy, the one it
// was queued for, alerted once none of its alerts waits any more. (A gap's
// alert has no github row to mark.)
func (tx *Tx) AlertSent(ctx context.Context, id int64, deliveryID string) error {
	// The channels' senders mark their rows at once: each must see the
	// other's, or neither marks the copy alerted.
	if err := tx.Lock(ctx, "alert:"+deliveryID); err != nil {
		return err
	}
	now := formatTime(time.Now())
	if _, err := tx.write(ctx, atOnce, "UPDATE alert_outbox SET sent_at = $1 WHERE id = $2", now, id); err != nil {
		return fmt.Errorf("mark alert sent: %w", err)
	}
	_, err := tx.write(ctx, atOnce, `UPDATE github SET alerted_at = $1 WHERE id = (SELECT min(id) FROM github WHERE delivery_id = $2)
		AND alerted_at IS NULL AND NOT EXISTS (SELECT 1 FROM alert_outbox WHERE delivery_id = $3 AND sent_at IS NULL)`,
		now, deliveryID, deliveryID)
	if err != nil {
		return fmt.Errorf("set alerted_at: %w", err)
	}
	return nil
}

// AlertFailed records a failed send and when to try again.
func (tx *Tx) AlertFailed(ctx context.Context, id int64, cause error, next time.Time) error {
	_, err := tx.write(ctx, atOnce, "UPDATE alert_outbox SET attempts = attempts + 1, last_error = $1, next_at = $2 WHERE id = $3",
		cause.Error(), formatTime(next), id)
	if err != nil {
		return fmt.Errorf("record alert failure: %w", err)
	}
	return nil
}

// AlertsPending counts the alerts not sent yet, for the metric.
func (s *Store) AlertsPending(ctx context.Context) (int, error) {
	var n int
	if err := s.pool().row(ctx, "SELECT count(*) FROM alert_outbox WHERE sent_at IS NULL").Scan(&n); err != nil {
		return 0, fmt.Errorf("count pending alerts: %w", err)
	}
	return n, nil
}
