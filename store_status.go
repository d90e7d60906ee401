package main

import (
	"context"
	"fmt"
	"time"
)

// DatabaseStatus is the database's part of the status page.
type DatabaseStatus struct {
	Driver string `json:"driver"` // sqlite or postgres
	// Path is the SQLite file, or the PostgreSQL URL without its password.
	Path      string         `json:"path"`
	SizeBytes int64          `json:"size_bytes"` // the file and its WAL, or the PostgreSQL database
	Rows      map[string]int `json:"rows"`
	// Unprepared is since when statements run unprepared, a pooler in
	// transaction mode found in front of PostgreSQL without
	// default_query_exec_mode=exec in database.url; null otherwise.
	Unprepared *time.Time `json:"pooler_found_at"`
}

// statusTables are the tables whose rows the status page counts.
var statusTables = append([]string{"github", "worker_deliveries", "alert_outbox", "delivery_gaps",
	"github_releases", "github_release_workflow_runs", "github_branches", "github_pushes", "github_installations",
	"github_repositories"}, orderSafeTables...)

// StoreStatus is what the status page reads of the database: the last
// days' statistics, the file and its row counts, and the open gaps.
type StoreStatus struct {
	Statistics    []StatisticsBucket
	Database      DatabaseStatus
	Gaps          []deliveryGap
	GapsTotal     int
	Unrecoverable int
	// Refused are the webhooks of the last hour refused, by reason.
	Refused []ReasonCount
}

// Status reads the status page's part of the database in one read
// transaction, so that its counts agree with each other: the statistics
// from since to now, the row counts, and at most gapLimit open gaps.
func (s *Store) Status(ctx context.Context, since, now time.Time, gapLimit int) (st StoreStatus, err error) {
	tx, err := s.snapshot(ctx)
	if err != nil {
		return st, fmt.Errorf("read the status: %w", err)
	}
	defer tx.done()
	if st.Statistics, err = statistics(ctx, tx, since, now); err != nil {
		return st, err
	}
	if st.Database, err = s.databaseStatus(ctx, tx); err != nil {
		return st, err
	}
	if st.Gaps, st.GapsTotal, err = openGaps(ctx, tx, gapLimit); err != nil {
		return st, err
	}
	if st.GapsTotal > 0 {
		if st.Unrecoverable, err = countUnrecoverableGaps(ctx, tx); err != nil {
			return st, err
		}
	}
	hourAgo := now.Add(-time.Hour)
	st.Refused, err = refusalsSince(ctx, tx, hourAgo)
	return st, err
}

// databaseStatus reads the file sizes and, through q, the row counts.
func (s *Store) databaseStatus(ctx context.Context, q dbReader) (DatabaseStatus, error) {
	st := DatabaseStatus{Driver: s.engine.driver(), Path: s.name, Rows: map[string]int{}, Unprepared: s.engine.unprepared()}
	var err error
	if st.SizeBytes, err = s.engine.size(ctx, q); err != nil {
		return st, err
	}
	for _, t := range statusTables {
		var n int
		if err := q.row(ctx, "SELECT count(*) FROM "+t).Scan(&n); err != nil {
			return st, fmt.Errorf("count %s: %w", t, err)
		}
		st.Rows[t] = n
	}
	return st, nil
}

// StatisticsBucket is one 6-hour bucket of github_statistics_6h, all events.
type StatisticsBucket struct {
	Start time.Time `json:"start"`
	Count int       `json:"count"`
}

// statistics returns, through q, the 6-hour buckets from since on, oldest
// first, with the empty ones filled in.
func statistics(ctx context.Context, q dbReader, since, now time.Time) ([]StatisticsBucket, error) {
	rows, err := q.rows(ctx, `SELECT bucket, sum(count) FROM github_statistics_6h
		WHERE bucket >= $1 GROUP BY bucket`, statisticsBucket(since))
	if err != nil {
		return nil, fmt.Errorf("read statistics: %w", err)
	}
	defer rows.Close()
	counts := map[string]int{}
	for rows.Next() {
		var b string
		var n int
		if err := rows.Scan(&b, &n); err != nil {
			return nil, fmt.Errorf("read statistics: %w", err)
		}
		counts[b] = n
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var out []StatisticsBucket
	for t, _ := time.Parse(time.RFC3339, statisticsBucket(since)); !t.After(now); t = t.Add(6 * time.Hour) {
		out = append(out, StatisticsBucket{Start: t, Count: counts[t.Format(time.RFC3339)]})
	}
	return out, nil
}
