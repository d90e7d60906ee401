package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// The raw log read back in received order, for reprocess: each stored
// copy with its payload, a bounded batch at a time.

// RawCopy is one row of the raw log, as it was received.
type RawCopy struct {
	ID           int64
	GUID, Event  string
	Hook         int64
	TargetType   string
	TargetID     int64
	SourceIP     string
	Forbidden    bool
	ReceivedAt   time.Time
	receivedText string
	Payload      []byte
	Pruned       bool
	Unreadable   error // the payload does not decompress
}

// RawFilter picks the raw rows reprocess reads: received at or after
// Since (zero: all), of Event ("": every event).
type RawFilter struct {
	Since time.Time
	Event string
}

// where is f's condition, with ? for its arguments.
func (f RawFilter) where() (string, []any) {
	cond, args := "1 = 1", []any{}
	if !f.Since.IsZero() {
		cond += " AND received_at >= ?"
		args = append(args, formatTime(f.Since))
	}
	if f.Event != "" {
		cond += " AND event = ?"
		args = append(args, f.Event)
	}
	return cond, args
}

// CountRaw is how many raw rows f picks.
func (s *Store) CountRaw(ctx context.Context, f RawFilter) (int64, error) {
	cond, args := f.where()
	var n int64
	if err := s.pool().row(ctx, numberParams("SELECT count(*) FROM github WHERE "+cond), args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("count the raw log: %w", err)
	}
	return n, nil
}

// RawCopies reads the raw rows f picks that come after the row after
// (nil: from the first), in received order (received_at, then id): at
// most limit rows, and no more once their payloads pass maxBytes (the
// first row always comes). It returns none at the end of the log.
func (s *Store) RawCopies(ctx context.Context, f RawFilter, after *RawCopy, limit int, maxBytes int) ([]RawCopy, error) {
	cond, args := f.where()
	if after != nil {
		cond += " AND (received_at > ? OR (received_at = ? AND id > ?))"
		args = append(args, after.receivedText, after.receivedText, after.ID)
	}
	args = append(args, limit)
	rows, err := s.pool().rows(ctx, numberParams(`SELECT id, delivery_id, event, hook_id, target_type, target_id, source_ip,
		forbidden, received_at, payload, payload_zstd, payload_pruned_at IS NOT NULL
		FROM github WHERE `+cond+` ORDER BY received_at, id LIMIT ?`), args...)
	if err != nil {
		return nil, fmt.Errorf("read the raw log: %w", err)
	}
	defer rows.Close()
	var out []RawCopy
	size := 0
	for (len(out) == 0 || size < maxBytes) && rows.Next() {
		var c RawCopy
		var targetID sql.NullInt64
		var text string
		var compressed []byte
		if err := rows.Scan(&c.ID, &c.GUID, &c.Event, &c.Hook, &c.TargetType, &targetID, &c.SourceIP, &c.Forbidden,
			&c.receivedText, &text, &compressed, &c.Pruned); err != nil {
			return nil, fmt.Errorf("read the raw log: %w", err)
		}
		c.TargetID = targetID.Int64
		c.ReceivedAt, _ = time.Parse(time.RFC3339Nano, c.receivedText)
		c.Payload, c.Unreadable = rowPayload(text, compressed)
		size += len(c.Payload)
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the raw log: %w", err)
	}
	return out, nil
}
