package main

import (
	"context"
	"fmt"
	"time"
)

// What the raw log keeps over time: payloads compressed, then emptied
// after raw_retention, and identities deleted after delivery_retention,
// each in short transactions of bounded batches, so that writers never
// wait long behind them.

// retentionBatch is the most raw rows one retention transaction changes, so
// that writers never wait long behind it.
const retentionBatch = 1000

// PrunePayloadsBefore empties the payload of at most retentionBatch raw
// github rows received before cutoff, in tx, and returns how many it
// pruned. The rows stay, as the deliveries' identities.
func (tx *Tx) PrunePayloadsBefore(ctx context.Context, cutoff time.Time) (int64, error) {
	res, err := tx.write(ctx, atOnce, `UPDATE github SET payload = '', payload_zstd = NULL, payload_pruned_at = $1 WHERE id IN
		(SELECT id FROM github WHERE received_at < $2 AND payload_pruned_at IS NULL ORDER BY received_at LIMIT $3)`,
		formatTime(time.Now()), formatTime(cutoff), retentionBatch)
	if err != nil {
		return 0, fmt.Errorf("prune raw payloads: %w", err)
	}
	return res.RowsAffected()
}

// DeleteIdentitiesBefore deletes at most retentionBatch deliveries received
// before cutoff, in tx: their github rows and the records of
// which workers finished them. Statistics and typed tables stay. It returns
// how many github rows it deleted.
func (tx *Tx) DeleteIdentitiesBefore(ctx context.Context, cutoff time.Time) (int64, error) {
	res, err := tx.write(ctx, atOnce, `DELETE FROM github WHERE id IN
		(SELECT id FROM github WHERE received_at < $1 ORDER BY received_at LIMIT $2)`, formatTime(cutoff), retentionBatch)
	if err != nil {
		return 0, fmt.Errorf("delete delivery identities: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, err
	}
	_, err = tx.write(ctx, atOnce, `DELETE FROM worker_deliveries WHERE (worker, delivery_id, hook_id) IN
		(SELECT worker, delivery_id, hook_id FROM worker_deliveries WHERE processed_at < $1 LIMIT $2)`, formatTime(cutoff), retentionBatch)
	if err != nil {
		return 0, fmt.Errorf("delete worker records: %w", err)
	}
	return n, nil
}

// compressBatch is the most rows one transaction of CompressOlderPayloads
// rewrites: a few megabytes of payloads, so that writers never wait long.
const compressBatch = 200

// CompressOlderPayloads compresses the payloads of at most compressBatch
// rows stored as text, with ids above after, in id order: read, then
// compressed outside any transaction, then written in one short one that
// write opens (WriteTx, or a leased job's). It returns the last id it
// looked at and how many it compressed; none left is (after, 0). A row
// pruned meanwhile is left as it is.
func (s *Store) CompressOlderPayloads(ctx context.Context, after int64,
	write func(ctx context.Context, fn func(tx *Tx) error) error) (last int64, n int, err error) {
	rows, err := s.pool().rows(ctx, `SELECT id, payload FROM github WHERE id > $1 AND payload_zstd IS NULL
		AND payload_pruned_at IS NULL ORDER BY id LIMIT $2`, after, compressBatch)
	if err != nil {
		return after, 0, fmt.Errorf("read payloads to compress: %w", err)
	}
	type row struct {
		id         int64
		compressed []byte
	}
	var batch []row
	last = after
	for rows.Next() {
		var r row
		var text string
		if err := rows.Scan(&r.id, &text); err != nil {
			rows.Close()
			return after, 0, fmt.Errorf("read payloads to compress: %w", err)
		}
		r.compressed = compressZstd([]byte(text))
		batch, last = append(batch, r), r.id
	}
	rows.Close()
	if err := rows.Err(); err != nil || len(batch) == 0 {
		return after, 0, err
	}
	err = write(ctx, func(tx *Tx) error {
		n = 0
		for _, r := range batch {
			res, err := tx.write(ctx, atOnce, `UPDATE github SET payload = '', payload_zstd = $1
				WHERE id = $2 AND payload_zstd IS NULL AND payload_pruned_at IS NULL`, r.compressed, r.id)
			if err != nil {
				return err
			}
			k, _ := res.RowsAffected()
			n += int(k)
		}
		return nil
	})
	if err != nil {
		return after, 0, fmt.Errorf("compress payloads: %w", err)
	}
	return last, n, nil
}

// LastStoredID is the highest id in github (0 when it is empty), a
// look at the end of its primary key.
func (s *Store) LastStoredID(ctx context.Context) (int64, error) {
	var id int64
	err := s.pool().row(ctx, "SELECT coalesce(max(id), 0) FROM github").Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("read the last github id: %w", err)
	}
	return id, nil
}

// UncompressedPayloads counts the rows whose payload is stored as text.
func (s *Store) UncompressedPayloads(ctx context.Context) (int, error) {
	var n int
	err := s.pool().row(ctx, "SELECT count(*) FROM github WHERE payload_zstd IS NULL AND payload_pruned_at IS NULL AND payload != ''").Scan(&n)
	return n, err
}
