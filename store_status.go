package main

import (
	"context"
	"fmt"
	"os"
	"time"
)

// DatabaseStatus is the database's part of the status page.
type DatabaseStatus struct {
	Path      string         `json:"path"`
	SizeBytes int64          `json:"size_bytes"` // the file and its WAL
	Rows      map[string]int `json:"rows"`
}

// statusTables are the tables whose rows the status page counts.
var statusTables = append([]string{"github", "worker_deliveries", "alert_outbox", "delivery_gaps",
	"github_releases", "github_release_workflow_runs", "github_branches", "github_pushes", "github_installations",
	"github_repositories"}, orderSafeTables...)

// DatabaseStatus reads the file sizes and the row counts.
func (s *Store) DatabaseStatus(ctx context.Context) (DatabaseStatus, error) {
	st := DatabaseStatus{Path: s.path, Rows: map[string]int{}}
	for _, p := range []string{s.path, s.path + "-wal"} {
		if fi, err := os.Stat(p); err == nil {
			st.SizeBytes += fi.Size()
		}
	}
	for _, t := range statusTables {
		var n int
		if err := s.r.QueryRowContext(ctx, "SELECT count(*) FROM "+t).Scan(&n); err != nil {
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

// Statistics returns the 6-hour buckets from since on, oldest first, with
// the empty ones filled in.
func (s *Store) Statistics(ctx context.Context, since, now time.Time) ([]StatisticsBucket, error) {
	rows, err := s.r.QueryContext(ctx, `SELECT bucket, sum(count) FROM github_statistics_6h
		WHERE bucket >= ? GROUP BY bucket`, statisticsBucket(since))
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
