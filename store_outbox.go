package main

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// The outbox's rows: every webhook the endpoint accepted, committed before
// its 202 and forwarded to the broker after (outbox.go). A row published
// keeps its times (not its message) outboxKeptFor, for the delivery's
// story; one the broker refused for good keeps its message and why.

// outboxKeptFor is how long a published row's times are kept.
const outboxKeptFor = 7 * 24 * time.Hour

// OutboxRow is one webhook in the outbox: the message as it will be
// published, and what became of it.
type OutboxRow struct {
	ID         int64
	Node       string // the node that forwards it
	GUID       string
	Hook       HookID // -1: none
	Event      string
	ReceivedAt time.Time
	QueuedAt   time.Time
	Exchange   string
	Key        string
	// Headers are the message's headers as the outbox encodes them.
	Headers         string
	ContentEncoding string
	Body            []byte
}

// Size is what the row counts against queue.outbox_max_bytes.
func (r *OutboxRow) Size() int64 { return int64(len(r.Body) + len(r.Headers)) }

// Outbox commits rows to the outbox in tx, in their order (which their
// ids keep), each sent ahead of its answer.
func (tx *Tx) Outbox(ctx context.Context, rows []OutboxRow) error {
	for i := range rows {
		r := &rows[i]
		var hook any
		if r.Hook >= 0 {
			hook = int64(r.Hook)
		}
		if _, err := tx.write(ctx, ahead(1), `INSERT INTO outbox (node, delivery_id, hook_id, event, received_at, queued_at,
				exchange, routing_key, headers, content_encoding, body, bytes)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)`,
			r.Node, r.GUID, hook, r.Event, formatTime(r.ReceivedAt), formatTime(r.QueuedAt),
			r.Exchange, r.Key, r.Headers, r.ContentEncoding, r.Body, r.Size()); err != nil {
			return fmt.Errorf("queue delivery %s: %w", r.GUID, err)
		}
	}
	return nil
}

// OutboxHead reads the first limit rows node forwards that wait, in id
// (commit) order, past id after (0: from the first): not published, not
// refused. It stops early once the rows read hold maxBytes (0: no bound),
// the row that reached it read too.
func (s *Store) OutboxHead(ctx context.Context, node string, after int64, limit int, maxBytes int64) ([]OutboxRow, error) {
	rows, err := s.pool().rows(ctx, `SELECT id, node, delivery_id, hook_id, event, received_at, queued_at, exchange, routing_key,
			headers, content_encoding, body
		FROM outbox WHERE node = $1 AND published_at IS NULL AND refused_at IS NULL AND id > $2 ORDER BY id LIMIT $3`, node, after, limit)
	if err != nil {
		return nil, fmt.Errorf("read the outbox: %w", s.health.observe(err))
	}
	defer rows.Close()
	var out []OutboxRow
	var bytes int64
	for (maxBytes <= 0 || bytes < maxBytes) && rows.Next() {
		var r OutboxRow
		var hook sql.NullInt64
		var received, queued string
		if err := rows.Scan(&r.ID, &r.Node, &r.GUID, &hook, &r.Event, &received, &queued, &r.Exchange, &r.Key,
			&r.Headers, &r.ContentEncoding, &r.Body); err != nil {
			return nil, fmt.Errorf("read the outbox: %w", err)
		}
		r.Hook = -1
		if hook.Valid {
			r.Hook = HookID(hook.Int64)
		}
		r.ReceivedAt, _ = time.Parse(time.RFC3339Nano, received)
		r.QueuedAt, _ = time.Parse(time.RFC3339Nano, queued)
		out = append(out, r)
		bytes += r.Size()
	}
	return out, rows.Err()
}

// OutboxPublished marks node's rows ids published to broker at at, in tx:
// their messages go, their times stay. A row no longer node's (adopted by
// another node while this one was paused) or already marked fails the
// whole marking with ErrStaleLease.
func (tx *Tx) OutboxPublished(ctx context.Context, node string, ids []int64, broker int, at time.Time) error {
	if len(ids) == 0 {
		return nil
	}
	args := []any{formatTime(at), broker, node}
	marks := make([]string, len(ids))
	for i, id := range ids {
		args = append(args, id)
		marks[i] = "?"
	}
	res, err := tx.write(ctx, atOnce, numberParams(`UPDATE outbox SET published_at = ?, published_to = ?, headers = '', body = NULL
		WHERE node = ? AND published_at IS NULL AND id IN (`+strings.Join(marks, ", ")+`)`), args...)
	if err != nil {
		return fmt.Errorf("mark the outbox's rows published: %w", err)
	}
	if n, err := res.RowsAffected(); err == nil && n != int64(len(ids)) {
		return fmt.Errorf("%d of %d outbox rows were no longer this node's to mark: %w", int64(len(ids))-n, len(ids), ErrStaleLease)
	}
	return nil
}

// OutboxRefused marks node's row id refused for good at at, for why, in
// tx: the broker refuses it (over its size), and it would hold every row
// behind it. It keeps its message for `switchyard outbox retry`.
func (tx *Tx) OutboxRefused(ctx context.Context, node string, id int64, why string, at time.Time) error {
	if len(why) > maxRejectionReason {
		why = why[:maxRejectionReason]
	}
	_, err := tx.write(ctx, atOnce, `UPDATE outbox SET refused_at = $1, refused = $2 WHERE id = $3 AND node = $4 AND published_at IS NULL`,
		formatTime(at), why, id, node)
	if err != nil {
		return fmt.Errorf("mark an outbox row refused: %w", err)
	}
	return nil
}

// RetryRefused puts the rows the broker refused back in line, in tx:
// their node forwards them again, behind what waits (their ids are kept,
// so they go first). It returns how many.
func (tx *Tx) RetryRefused(ctx context.Context) (int64, error) {
	res, err := tx.write(ctx, atOnce, `UPDATE outbox SET refused_at = NULL, refused = '' WHERE refused_at IS NOT NULL AND published_at IS NULL`)
	if err != nil {
		return 0, fmt.Errorf("retry the outbox's refused rows: %w", err)
	}
	return res.RowsAffected()
}

// OthersWaiting reports whether rows of nodes other than node wait: what
// a forwarder reads, without a write, before it looks for rows to adopt.
func (s *Store) OthersWaiting(ctx context.Context, node string) (bool, error) {
	var any bool
	err := s.pool().row(ctx, `SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL AND node <> $1)`, node).Scan(&any)
	if err != nil {
		return false, fmt.Errorf("read the outbox: %w", s.health.observe(err))
	}
	return any, nil
}

// AdoptOutbox gives node, in tx, the waiting rows of every node whose
// outbox lease (jobOf) is gone: expired, or never taken for a row queued
// more than ttl ago. It returns how many rows it adopted, and their bytes.
// Of two nodes adopting at once, the database lets one have each row.
func (tx *Tx) AdoptOutbox(ctx context.Context, node string, jobOf func(node string) string, ttl time.Duration) (rows, bytes int64, err error) {
	d := tx.s.engine
	q, err := tx.rows(ctx, `SELECT node, min(queued_at) FROM outbox WHERE published_at IS NULL AND node <> $1 GROUP BY node`, node)
	if err != nil {
		return 0, 0, fmt.Errorf("read the outbox's nodes: %w", err)
	}
	oldest := map[string]string{}
	for q.Next() {
		var owner, queued string
		if err := q.Scan(&owner, &queued); err != nil {
			q.Close()
			return 0, 0, fmt.Errorf("read the outbox's nodes: %w", err)
		}
		oldest[owner] = queued
	}
	q.Close()
	if err := q.Err(); err != nil {
		return 0, 0, fmt.Errorf("read the outbox's nodes: %w", err)
	}
	for owner, queued := range oldest {
		var live bool
		err := tx.row(ctx, `SELECT EXISTS (SELECT 1 FROM leases WHERE job = $1 AND expires_at >= `+d.clock("0")+`)
			OR NOT EXISTS (SELECT 1 FROM leases WHERE job = $1) AND $2 >= `+d.clock("$3"),
			jobOf(owner), queued, -ttl.Milliseconds()).Scan(&live)
		if err != nil {
			return 0, 0, fmt.Errorf("read node %s's outbox lease: %w", owner, err)
		}
		if live {
			continue
		}
		adopted, err := tx.rows(ctx, `UPDATE outbox SET node = $1 WHERE node = $2 AND published_at IS NULL RETURNING bytes`, node, owner)
		if err != nil {
			return 0, 0, fmt.Errorf("adopt node %s's outbox: %w", owner, err)
		}
		for adopted.Next() {
			var n int64
			if err := adopted.Scan(&n); err != nil {
				adopted.Close()
				return 0, 0, fmt.Errorf("adopt node %s's outbox: %w", owner, err)
			}
			rows, bytes = rows+1, bytes+n
		}
		adopted.Close()
		if err := adopted.Err(); err != nil {
			return 0, 0, fmt.Errorf("adopt node %s's outbox: %w", owner, err)
		}
	}
	return rows, bytes, nil
}

// SpoolWaiting reports whether webhooks an older version left wait in its
// spool: read before MoveSpool's write.
func (s *Store) SpoolWaiting(ctx context.Context) (bool, error) {
	var any bool
	err := s.pool().row(ctx, `SELECT EXISTS (SELECT 1 FROM spooled_webhooks WHERE published_at IS NULL)`).Scan(&any)
	if err != nil {
		return false, fmt.Errorf("read the spool: %w", s.health.observe(err))
	}
	return any, nil
}

// MoveSpool moves the webhooks an older version left waiting in its spool
// (spooled_webhooks) into the outbox as node's, in tx, in the order that
// spool kept (received_at, id): their headers are strings, which the
// outbox's encoding reads as they are. The spool's rows are marked
// published to -2 (moved). It returns how many it moved, and their bytes.
func (tx *Tx) MoveSpool(ctx context.Context, node string, now time.Time) (rows, bytes int64, err error) {
	if err := tx.row(ctx, `SELECT count(*), coalesce(sum(bytes), 0) FROM spooled_webhooks WHERE published_at IS NULL`).Scan(&rows, &bytes); err != nil {
		return 0, 0, fmt.Errorf("read the spool: %w", err)
	}
	if rows == 0 {
		return 0, 0, nil
	}
	if _, err := tx.write(ctx, atOnce, `INSERT INTO outbox (node, delivery_id, hook_id, event, received_at, queued_at,
			exchange, routing_key, headers, content_encoding, body, bytes)
		SELECT $1, delivery_id, hook_id, event, received_at, spooled_at, exchange, routing_key, headers, content_encoding, body, bytes
		FROM spooled_webhooks WHERE published_at IS NULL ORDER BY received_at, id`, node); err != nil {
		return 0, 0, fmt.Errorf("move the spool's rows into the outbox: %w", err)
	}
	if _, err := tx.write(ctx, atOnce, `UPDATE spooled_webhooks SET published_at = $1, published_to = -2, headers = '', body = $2
		WHERE published_at IS NULL`, formatTime(now), []byte{}); err != nil {
		return 0, 0, fmt.Errorf("mark the spool's rows moved: %w", err)
	}
	return rows, bytes, nil
}

// PruneOutbox deletes, in tx, the published rows older than
// outboxKeptFor before now, at most retentionBatch of them, oldest first.
func (tx *Tx) PruneOutbox(ctx context.Context, now time.Time) (int64, error) {
	res, err := tx.write(ctx, atOnce, `DELETE FROM outbox WHERE id IN (SELECT id FROM outbox
		WHERE published_at IS NOT NULL AND published_at < $1 ORDER BY id LIMIT $2)`,
		formatTime(now.Add(-outboxKeptFor)), retentionBatch)
	if err != nil {
		return 0, fmt.Errorf("prune the outbox's published rows: %w", err)
	}
	return res.RowsAffected()
}

// OutboxBytes is what node's waiting rows hold (refused ones included):
// what counts against queue.outbox_max_bytes.
func (s *Store) OutboxBytes(ctx context.Context, node string) (int64, error) {
	var n int64
	err := s.pool().row(ctx, `SELECT coalesce(sum(bytes), 0) FROM outbox WHERE node = $1 AND published_at IS NULL`, node).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("read the outbox: %w", s.health.observe(err))
	}
	return n, nil
}

// OutboxState is what the outbox holds now: for the gauges and the
// status.
type OutboxState struct {
	// Messages and Bytes wait to be forwarded (refused ones not counted).
	Messages int64 `json:"messages"`
	Bytes    int64 `json:"bytes"`
	// Oldest is when the oldest waiting row was queued; null when none waits.
	Oldest *time.Time `json:"oldest_queued_at"`
	// Nodes are the nodes whose rows wait.
	Nodes []string `json:"nodes"`
	// Refused are the rows the broker refused for good, newest first
	// (at most maxRefusedShown), and RefusedCount how many there are.
	Refused      []RefusedRow `json:"refused"`
	RefusedCount int64        `json:"refused_count"`
}

// RefusedRow is a row the broker refused for good.
type RefusedRow struct {
	GUID      string    `json:"delivery_id"`
	Event     string    `json:"event"`
	Bytes     int64     `json:"bytes"`
	RefusedAt time.Time `json:"refused_at"`
	Reason    string    `json:"reason"`
}

// maxRefusedShown bounds the refused rows the state lists.
const maxRefusedShown = 20

// OutboxState reads what the outbox holds.
func (s *Store) OutboxState(ctx context.Context) (OutboxState, error) {
	st := OutboxState{Nodes: []string{}, Refused: []RefusedRow{}}
	rows, err := s.pool().rows(ctx, `SELECT node, count(*), coalesce(sum(bytes), 0), min(queued_at)
		FROM outbox WHERE published_at IS NULL AND refused_at IS NULL GROUP BY node ORDER BY node`)
	if err != nil {
		return st, fmt.Errorf("read the outbox: %w", s.health.observe(err))
	}
	defer rows.Close()
	for rows.Next() {
		var node, oldest string
		var n, bytes int64
		if err := rows.Scan(&node, &n, &bytes, &oldest); err != nil {
			return st, fmt.Errorf("read the outbox: %w", err)
		}
		st.Messages += n
		st.Bytes += bytes
		st.Nodes = append(st.Nodes, node)
		if t, err := time.Parse(time.RFC3339Nano, oldest); err == nil && (st.Oldest == nil || t.Before(*st.Oldest)) {
			st.Oldest = &t
		}
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("read the outbox: %w", err)
	}
	refused, err := s.pool().rows(ctx, `SELECT delivery_id, event, bytes, refused_at, refused, count(*) OVER ()
		FROM outbox WHERE refused_at IS NOT NULL AND published_at IS NULL ORDER BY refused_at DESC, id DESC LIMIT $1`, maxRefusedShown)
	if err != nil {
		return st, fmt.Errorf("read the outbox's refused rows: %w", s.health.observe(err))
	}
	defer refused.Close()
	for refused.Next() {
		var r RefusedRow
		var at string
		if err := refused.Scan(&r.GUID, &r.Event, &r.Bytes, &at, &r.Reason, &st.RefusedCount); err != nil {
			return st, fmt.Errorf("read the outbox's refused rows: %w", err)
		}
		r.RefusedAt, _ = time.Parse(time.RFC3339Nano, at)
		st.Refused = append(st.Refused, r)
	}
	return st, refused.Err()
}

// OutboxStory is one time a delivery went through the outbox, for its
// story.
type OutboxStory struct {
	Hook        HookID     `json:"hook_id"`
	Node        string     `json:"node"`
	QueuedAt    time.Time  `json:"queued_at"`
	PublishedAt *time.Time `json:"published_at"` // null while it waits
	Broker      int        `json:"broker"`       // published to; -1 while it waits
	Refused     string     `json:"refused,omitempty"`
}

// maxStoryQueued bounds the times a story lists a delivery queued.
const maxStoryQueued = 20

// queuedOf are guid's rows in the outbox, oldest first, read in q.
func queuedOf(ctx context.Context, q dbReader, guid string) ([]OutboxStory, error) {
	rows, err := q.rows(ctx, `SELECT hook_id, node, queued_at, published_at, coalesce(published_to, -1), refused
		FROM outbox WHERE delivery_id = $1 ORDER BY id LIMIT $2`, guid, maxStoryQueued)
	if err != nil {
		return nil, fmt.Errorf("read the outbox: %w", err)
	}
	defer rows.Close()
	var out []OutboxStory
	for rows.Next() {
		var s OutboxStory
		var hook sql.NullInt64
		var queued string
		var published sql.NullString
		if err := rows.Scan(&hook, &s.Node, &queued, &published, &s.Broker, &s.Refused); err != nil {
			return nil, fmt.Errorf("read the outbox: %w", err)
		}
		s.Hook = -1
		if hook.Valid {
			s.Hook = HookID(hook.Int64)
		}
		s.QueuedAt, _ = time.Parse(time.RFC3339Nano, queued)
		if published.Valid {
			t, _ := time.Parse(time.RFC3339Nano, published.String)
			s.PublishedAt = &t
		}
		out = append(out, s)
	}
	return out, rows.Err()
}
