package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// The settings table: the broker state and the marks the jobs keep, a
// key and its value each.

// Setting reads one settings row from the read pool; a missing row reads
// as "".
func (s *Store) Setting(ctx context.Context, key string) (string, error) {
	return getSetting(ctx, s.pool(), key)
}

// Setting reads one settings row inside tx.
func (t *Tx) Setting(ctx context.Context, key string) (string, error) {
	return getSetting(ctx, t, key)
}

// Settings reads the settings rows of keys from the read pool in one
// query; a missing row reads as "".
func (s *Store) Settings(ctx context.Context, keys ...string) (map[string]string, error) {
	return getSettings(ctx, s.pool(), keys)
}

// Settings reads the settings rows of keys inside tx, in one query.
func (t *Tx) Settings(ctx context.Context, keys ...string) (map[string]string, error) {
	return getSettings(ctx, t, keys)
}

func getSettings(ctx context.Context, q dbReader, keys []string) (map[string]string, error) {
	args := make([]any, len(keys))
	for i, k := range keys {
		args[i] = k
	}
	rows, err := q.rows(ctx, numberParams("SELECT key, value FROM settings WHERE key IN (?"+strings.Repeat(", ?", len(keys)-1)+")"), args...)
	if err != nil {
		return nil, fmt.Errorf("read settings: %w", err)
	}
	defer rows.Close()
	vals := make(map[string]string, len(keys))
	for rows.Next() {
		var k, v string
		if err := rows.Scan(&k, &v); err != nil {
			return nil, fmt.Errorf("read settings: %w", err)
		}
		vals[k] = v
	}
	return vals, rows.Err()
}

const settingQuery = "SELECT value FROM settings WHERE key = $1"

func getSetting(ctx context.Context, q dbReader, key string) (string, error) {
	return scanSetting(q.row(ctx, settingQuery, key), key)
}

// scanSetting reads one settings row's value; a missing row reads as "".
func scanSetting(row scanner, key string) (string, error) {
	var v string
	err := row.Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read setting %s: %w", key, err)
	}
	return v, nil
}

// SetSetting writes one settings row inside tx.
func (t *Tx) SetSetting(ctx context.Context, key, value string, now time.Time) error {
	_, err := t.write(ctx, atOnce, `INSERT INTO settings (key, value, updated_at) VALUES ($1, $2, $3)
		ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at`,
		key, value, formatTime(now))
	if err != nil {
		return fmt.Errorf("write setting %s: %w", key, err)
	}
	return nil
}
