package main

import (
	"context"
	"fmt"
	"time"
)

// HookKnown reports whether a delivery's GUID is stored in github or queued
// for redelivery already.
func (s *Store) HookKnown(ctx context.Context, guid string) (bool, error) {
	var n int
	err := s.r.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM github WHERE delivery_id = ?) +
		(SELECT count(*) FROM hook_redeliveries WHERE guid = ?)`, guid, guid).Scan(&n)
	if err != nil {
		return false, fmt.Errorf("read hook_redeliveries: %w", err)
	}
	return n > 0, nil
}

// HookQueued remembers that a failed delivery was queued on github-hooks.
func (s *Store) HookQueued(ctx context.Context, guid string, githubID int64, event string) error {
	return s.Batch(ctx, func(tx *Tx) error {
		_, err := tx.exec(ctx, `INSERT INTO hook_redeliveries (guid, delivery_id, event, queued_at)
			VALUES (?, ?, ?, ?) ON CONFLICT (guid) DO NOTHING`, guid, githubID, event, formatTime(time.Now()))
		if err != nil {
			return fmt.Errorf("write hook_redeliveries: %w", err)
		}
		return nil
	})
}

// hookRepublished records, inside tx, that a queued delivery was published
// again.
func (tx *Tx) hookRepublished(ctx context.Context, guid string) error {
	_, err := tx.exec(ctx, `UPDATE hook_redeliveries SET republished_at = ? WHERE guid = ?`,
		formatTime(time.Now()), guid)
	if err != nil {
		return fmt.Errorf("write hook_redeliveries: %w", err)
	}
	return nil
}

// SetSetting writes one settings row in a transaction of its own.
func (s *Store) SetSetting(ctx context.Context, key, value string) error {
	return s.Batch(ctx, func(tx *Tx) error { return tx.SetSetting(ctx, key, value, time.Now()) })
}
