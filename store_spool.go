package main

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// The spool: webhooks the broker did not confirm in time, committed to
// spooled_webhooks and answered 202, until the spool drain publishes them.
// A row published keeps its times (not its message) spoolKeptFor, for
// the delivery's story.

// spoolKeptFor is how long a published row's times are kept.
const spoolKeptFor = 7 * 24 * time.Hour

// SpooledWebhook is one webhook in the spool: the message as it would have
// been published, and what became of it.
type SpooledWebhook struct {
	ID         int64
	GUID       string
	Hook       HookID // -1: none
	Event      string
	ReceivedAt time.Time
	SpooledAt  time.Time
	Node       string
	Broker     int    // the broker it was meant for
	Reason     string // why the broker did not take it
	Exchange   string
	Key        string
	// Headers are the message's headers as a JSON object.
	Headers         string
	ContentEncoding string
	Body            []byte
	// PublishedAt is zero while it waits; PublishedTo is the broker it went to.
	PublishedAt time.Time
	PublishedTo int
}

// size is what the row counts against queue.spool_max_bytes.
func (w *SpooledWebhook) size() int64 { return int64(len(w.Body) + len(w.Headers)) }

// Spool commits ws to the spool in tx, in order.
func (tx *Tx) Spool(ctx context.Context, ws []SpooledWebhook) error {
	for i := range ws {
		w := &ws[i]
		var hook any
		if w.Hook >= 0 {
			hook = int64(w.Hook)
		}
		if _, err := tx.write(ctx, ahead(1), `INSERT INTO spooled_webhooks (delivery_id, hook_id, event, received_at, spooled_at, node,
				broker, reason, exchange, routing_key, headers, content_encoding, body, bytes)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)`,
			w.GUID, hook, w.Event, formatTime(w.ReceivedAt), formatTime(w.SpooledAt), w.Node, w.Broker, w.Reason,
			w.Exchange, w.Key, w.Headers, w.ContentEncoding, w.Body, w.size()); err != nil {
			return fmt.Errorf("spool delivery %s: %w", w.GUID, err)
		}
	}
	return nil
}

// SpoolPublished marks the spooled rows ids published to broker at at, in
// tx: their messages go, their times stay.
func (tx *Tx) SpoolPublished(ctx context.Context, ids []int64, broker int, at time.Time) error {
	if len(ids) == 0 {
		return nil
	}
	args := []any{formatTime(at), broker, []byte{}}
	marks := make([]string, len(ids))
	for i, id := range ids {
		args = append(args, id)
		marks[i] = "?"
	}
	res, err := tx.write(ctx, atOnce, numberParams(`UPDATE spooled_webhooks SET published_at = ?, published_to = ?, headers = '', body = ?
		WHERE published_at IS NULL AND id IN (`+strings.Join(marks, ", ")+`)`), args...)
	if err != nil {
		return fmt.Errorf("mark spooled webhooks published: %w", err)
	}
	if n, err := res.RowsAffected(); err == nil && n != int64(len(ids)) {
		// Another drain published some since they were read: a stale
		// holder of the spool's lease. Its copies are duplicates.
		return fmt.Errorf("%d of %d spooled webhooks were already marked published: %w", int64(len(ids))-n, len(ids), ErrStaleLease)
	}
	return nil
}

// SpoolGivenUp marks the spooled row id as given up, in tx: a message the
// broker refuses for good (over its size limit), which would hold every
// other behind it. Its times stay, published_to -1, reason why.
func (tx *Tx) SpoolGivenUp(ctx context.Context, id int64, why string, at time.Time) error {
	if len(why) > maxRejectionReason {
		why = why[:maxRejectionReason]
	}
	_, err := tx.write(ctx, atOnce, `UPDATE spooled_webhooks SET published_at = $1, published_to = -1, reason = $2, headers = '', body = $3
		WHERE id = $4 AND published_at IS NULL`, formatTime(at), why, []byte{}, id)
	if err != nil {
		return fmt.Errorf("give up a spooled webhook: %w", err)
	}
	return nil
}

// PruneSpool deletes, in tx, the published rows older than spoolKeptFor
// before now, at most retentionBatch of them.
func (tx *Tx) PruneSpool(ctx context.Context, now time.Time) (int64, error) {
	res, err := tx.write(ctx, atOnce, `DELETE FROM spooled_webhooks WHERE id IN (SELECT id FROM spooled_webhooks
		WHERE published_at IS NOT NULL AND published_at < $1 ORDER BY published_at LIMIT $2)`,
		formatTime(now.Add(-spoolKeptFor)), retentionBatch)
	if err != nil {
		return 0, fmt.Errorf("prune the spool's published rows: %w", err)
	}
	return res.RowsAffected()
}

// SpoolHead reads the oldest limit webhooks waiting in the spool, oldest
// first (received at the door, then spooled).
func (s *Store) SpoolHead(ctx context.Context, limit int) ([]SpooledWebhook, error) {
	rows, err := s.pool().rows(ctx, `SELECT id, delivery_id, hook_id, event, received_at, spooled_at, node, broker, reason,
			exchange, routing_key, headers, content_encoding, body
		FROM spooled_webhooks WHERE published_at IS NULL ORDER BY received_at, id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("read the spool: %w", s.health.observe(err))
	}
	defer rows.Close()
	var out []SpooledWebhook
	for rows.Next() {
		var w SpooledWebhook
		var hook sql.NullInt64
		var received, spooled string
		if err := rows.Scan(&w.ID, &w.GUID, &hook, &w.Event, &received, &spooled, &w.Node, &w.Broker, &w.Reason,
			&w.Exchange, &w.Key, &w.Headers, &w.ContentEncoding, &w.Body); err != nil {
			return nil, fmt.Errorf("read the spool: %w", err)
		}
		w.Hook = -1
		if hook.Valid {
			w.Hook = HookID(hook.Int64)
		}
		w.ReceivedAt, _ = time.Parse(time.RFC3339Nano, received)
		w.SpooledAt, _ = time.Parse(time.RFC3339Nano, spooled)
		out = append(out, w)
	}
	return out, rows.Err()
}

// SpoolState is what the spool holds now: for the gauges, the status and
// the endpoint's bound.
type SpoolState struct {
	Messages int64 `json:"messages"`
	Bytes    int64 `json:"bytes"`
	// Oldest is when the oldest webhook waiting was spooled; null when none waits.
	Oldest *time.Time `json:"oldest_spooled_at"`
	// Brokers are the brokers the waiting webhooks were meant for.
	Brokers []int `json:"brokers"`
}

// SpoolState reads what the spool holds.
func (s *Store) SpoolState(ctx context.Context) (SpoolState, error) {
	var st SpoolState
	rows, err := s.pool().rows(ctx, `SELECT broker, count(*), coalesce(sum(bytes), 0), min(spooled_at)
		FROM spooled_webhooks WHERE published_at IS NULL GROUP BY broker ORDER BY broker`)
	if err != nil {
		return st, fmt.Errorf("read the spool: %w", s.health.observe(err))
	}
	defer rows.Close()
	for rows.Next() {
		var broker int
		var n, bytes int64
		var oldest string
		if err := rows.Scan(&broker, &n, &bytes, &oldest); err != nil {
			return st, fmt.Errorf("read the spool: %w", err)
		}
		st.Messages += n
		st.Bytes += bytes
		st.Brokers = append(st.Brokers, broker)
		if t, err := time.Parse(time.RFC3339Nano, oldest); err == nil && (st.Oldest == nil || t.Before(*st.Oldest)) {
			st.Oldest = &t
		}
	}
	return st, rows.Err()
}

// SpoolStory is one spooling of a delivery, for its story.
type SpoolStory struct {
	Hook        HookID     `json:"hook_id"`
	Node        string     `json:"node"`
	Reason      string     `json:"reason"`
	SpooledAt   time.Time  `json:"spooled_at"`
	PublishedAt *time.Time `json:"published_at"` // null while it waits
	Broker      int        `json:"broker"`       // meant for, or published to
}

// maxStorySpoolings bounds the spoolings a story lists.
const maxStorySpoolings = 20

// spoolingsOf are guid's spoolings, oldest first, read in q.
func spoolingsOf(ctx context.Context, q dbReader, guid string) ([]SpoolStory, error) {
	rows, err := q.rows(ctx, `SELECT hook_id, node, reason, spooled_at, published_at, coalesce(published_to, broker)
		FROM spooled_webhooks WHERE delivery_id = $1 ORDER BY spooled_at, id LIMIT $2`, guid, maxStorySpoolings)
	if err != nil {
		return nil, fmt.Errorf("read spooled_webhooks: %w", err)
	}
	defer rows.Close()
	var out []SpoolStory
	for rows.Next() {
		var s SpoolStory
		var hook sql.NullInt64
		var spooled string
		var published sql.NullString
		if err := rows.Scan(&hook, &s.Node, &s.Reason, &spooled, &published, &s.Broker); err != nil {
			return nil, fmt.Errorf("read spooled_webhooks: %w", err)
		}
		s.Hook = -1
		if hook.Valid {
			s.Hook = HookID(hook.Int64)
		}
		s.SpooledAt, _ = time.Parse(time.RFC3339Nano, spooled)
		if published.Valid {
			t, _ := time.Parse(time.RFC3339Nano, published.String)
			s.PublishedAt = &t
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// spooledSince counts, read in q, the webhooks spooled since since, by
// why (status 202: they were answered so).
func spooledSince(ctx context.Context, q dbReader, since time.Time) ([]ReasonCount, error) {
	rows, err := q.rows(ctx, `SELECT reason, count(*) FROM spooled_webhooks WHERE spooled_at >= $1 GROUP BY reason`, formatTime(since))
	if err != nil {
		return nil, fmt.Errorf("read spooled_webhooks: %w", err)
	}
	defer rows.Close()
	counts := map[ReasonCount]int{}
	for rows.Next() {
		k := ReasonCount{Status: 202}
		var n int
		if err := rows.Scan(&k.Reason, &n); err != nil {
			return nil, fmt.Errorf("read spooled_webhooks: %w", err)
		}
		counts[k] = n
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read spooled_webhooks: %w", err)
	}
	return sortedCounts(counts), nil
}
