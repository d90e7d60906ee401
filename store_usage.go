package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// usageRow is what one broker cost in one hour, as broker_usage keeps it.
type usageRow struct {
	Broker               string // usageKey
	Published, Delivered int64
}

// usageKey names a broker in broker_usage by its host and vhost, so that a
// reordered [[brokers]] list keeps each broker's spending its own.
func usageKey(host, vhost string) string { return host + "/" + vhost }

// AddBrokerUsage adds rows to the hour of at, in tx; a row of nothing
// writes nothing.
func (tx *Tx) AddBrokerUsage(ctx context.Context, at time.Time, rows []usageRow) error {
	hour := formatTime(at.UTC().Truncate(time.Hour))
	for _, r := range rows {
		if r.Published == 0 && r.Delivered == 0 {
			continue
		}
		if _, err := tx.write(ctx, ahead(1), `INSERT INTO broker_usage (broker, hour, published, delivered) VALUES ($1, $2, $3, $4)
			ON CONFLICT (broker, hour) DO UPDATE SET published = broker_usage.published + excluded.published,
			delivered = broker_usage.delivered + excluded.delivered`, r.Broker, hour, r.Published, r.Delivered); err != nil {
			return fmt.Errorf("write broker_usage: %w", err)
		}
	}
	return nil
}

// BrokerUsageSince sums what broker cost in the hours from since on.
func (s *Store) BrokerUsageSince(ctx context.Context, broker string, since time.Time) (published, delivered int64, err error) {
	err = s.pool().row(ctx, `SELECT coalesce(sum(published), 0), coalesce(sum(delivered), 0) FROM broker_usage
		WHERE broker = $1 AND hour >= $2`, broker, formatTime(since.UTC().Truncate(time.Hour))).Scan(&published, &delivered)
	if err != nil {
		return 0, 0, fmt.Errorf("read broker_usage: %w", err)
	}
	return published, delivered, nil
}

// BrokerUsageFirst is the first hour broker's spending was counted in;
// ok is false when none has been.
func (s *Store) BrokerUsageFirst(ctx context.Context, broker string) (first time.Time, ok bool, err error) {
	var hour sql.NullString
	if err := s.pool().row(ctx, `SELECT min(hour) FROM broker_usage WHERE broker = $1`, broker).Scan(&hour); err != nil {
		return first, false, fmt.Errorf("read broker_usage: %w", err)
	}
	if !hour.Valid {
		return first, false, nil
	}
	first, err = time.Parse(time.RFC3339Nano, hour.String)
	return first, err == nil, err
}

// QueueOwnAlert queues, once, an alert of switchyard's own (a budget
// passing its line) on each of channels; id names it, and a second call
// with the same id changes nothing. It reports whether it was new.
func (tx *Tx) QueueOwnAlert(ctx context.Context, id string, channels []string) (queued bool, err error) {
	var n int
	if err := tx.row(ctx, "SELECT count(*) FROM alert_outbox WHERE delivery_id = $1", id).Scan(&n); err != nil {
		return false, err
	}
	if n > 0 {
		return false, nil
	}
	return true, tx.queueAlerts(ctx, id, channels)
}
