package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
)

// Copying a whole database into an empty one of the other kind (copy-db):
// users move up from SQLite to PostgreSQL, or back, with their whole
// history, every row as it was, duplicates still duplicates.

// notCopied are the tables copy-db leaves out: each database keeps its own
// migration history, and leases and nodes are the running nodes' state,
// not history.
var notCopied = []string{"schema_migrations", "leases", "nodes"}

// TableCopy is one table copied: its name and its rows.
type TableCopy struct {
	Table string
	Rows  int64
}

// ErrTargetNotEmpty is a copy refused because the target holds rows.
var ErrTargetNotEmpty = fmt.Errorf("the target database holds rows: copy-db fills an empty database only")

// tables are the store's tables, in name order.
func (s *Store) tables(ctx context.Context, q dbReader) ([]string, error) {
	query := s.engine.tablesQuery()
	rows, err := q.rows(ctx, query)
	if err != nil {
		return nil, fmt.Errorf("list tables: %w", err)
	}
	defer rows.Close()
	var names []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, err
		}
		names = append(names, n)
	}
	return names, rows.Err()
}

// CheckEmpty reports ErrTargetNotEmpty, naming the table, when any table
// of the database holds a row.
func (s *Store) CheckEmpty(ctx context.Context) error {
	tables, err := s.tables(ctx, s.pool())
	if err != nil {
		return err
	}
	for _, t := range tables {
		var n int64
		if err := s.pool().row(ctx, "SELECT count(*) FROM "+t).Scan(&n); err != nil {
			return fmt.Errorf("count %s: %w", t, err)
		}
		if n > 0 {
			return fmt.Errorf("%w (%s has %d)", ErrTargetNotEmpty, t, n)
		}
	}
	return nil
}

// copyBatchValues bounds the values one insert carries: under SQLite's
// 32,766 parameters and PostgreSQL's 65,535.
const copyBatchValues = 2000

// CopyTo copies every table of s, read in one read transaction, into dst,
// an empty database of the same schema version, in one transaction on
// dst; progress, when set, hears of every batch. A PostgreSQL target's
// identities go on after the greatest id copied.
func (s *Store) CopyTo(ctx context.Context, dst *Store, progress func(table string, rows int64)) ([]TableCopy, error) {
	from, err := s.SchemaVersion(ctx)
	if err != nil {
		return nil, err
	}
	to, err := dst.SchemaVersion(ctx)
	if err != nil {
		return nil, err
	}
	if from != to {
		return nil, fmt.Errorf("the source database is at schema version %d, the target at %d: migrate both with this binary first", from, to)
	}
	src, err := s.snapshot(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the source: %w", err)
	}
	defer src.done()
	tables, err := s.tables(ctx, src)
	if err != nil {
		return nil, err
	}
	var out []TableCopy
	err = dst.WriteTx(ctx, func(tx *Tx) error {
		for _, table := range tables {
			if slices.Contains(notCopied, table) {
				continue
			}
			n, err := copyTable(ctx, src, tx, table, progress)
			if err != nil {
				return fmt.Errorf("copy %s: %w", table, err)
			}
			out = append(out, TableCopy{Table: table, Rows: n})
		}
		return dst.resetIdentities(ctx, tx, out)
	})
	return out, err
}

// copyTable copies one table's rows from src into tx, several rows an
// insert, by column name.
func copyTable(ctx context.Context, src snapshot, tx *Tx, table string, progress func(string, int64)) (int64, error) {
	rows, err := src.rows(ctx, "SELECT * FROM "+table)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return 0, err
	}
	perInsert := max(1, copyBatchValues/len(cols))
	row := "(?" + strings.Repeat(", ?", len(cols)-1) + ")"
	var batch []any
	var n int64
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		k := len(batch) / len(cols)
		query := numberParams("INSERT INTO " + table + " (" + strings.Join(cols, ", ") + ") VALUES " +
			row + strings.Repeat(", "+row, k-1))
		if _, err := tx.raw().ExecContext(ctx, query, batch...); err != nil {
			return err
		}
		n += int64(k)
		batch = batch[:0]
		if progress != nil {
			progress(table, n)
		}
		return nil
	}
	vals := make([]any, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	for rows.Next() {
		if err := rows.Scan(ptrs...); err != nil {
			return n, err
		}
		batch = append(batch, vals...)
		if len(batch)/len(cols) >= perInsert {
			if err := flush(); err != nil {
				return n, err
			}
		}
	}
	if err := rows.Err(); err != nil {
		return n, err
	}
	return n, flush()
}

// resetIdentities makes each PostgreSQL identity column of the copied
// tables go on after the greatest id copied, so that the next row a node
// writes takes a new one. SQLite's rowids need nothing.
func (s *Store) resetIdentities(ctx context.Context, tx *Tx, copied []TableCopy) error {
	for _, c := range copied {
		if c.Rows == 0 {
			continue
		}
		if err := s.engine.afterCopy(ctx, tx.raw(), c.Table); err != nil {
			return err
		}
	}
	return nil
}
