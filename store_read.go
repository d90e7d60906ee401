package main

import (
	"context"
	"database/sql"
)

// The one way the store reads: a dbReader, which says where it reads by
// what gives it. Store.pool reads the read pool (what is committed),
// Store.snapshot a read-only transaction (one state of the database for
// several queries), and a Tx its own transaction (what it wrote so far,
// what it queued ahead sent first). Each takes arguments as both drivers
// take them (sqlArgs).
type dbReader interface {
	// row reads one row.
	row(ctx context.Context, query string, args ...any) scanner
	// rows reads every row; the caller closes them.
	rows(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// scanner is a row read: *sql.Row, or failedRow.
type scanner interface{ Scan(dest ...any) error }

// failedRow is a read that failed before it was sent.
type failedRow struct{ err error }

func (r failedRow) Scan(...any) error { return r.err }

// poolReader reads a pool of connections, each query on whichever is free.
type poolReader struct{ db *sql.DB }

// pool is the read pool's reader: what is committed.
func (s *Store) pool() dbReader { return poolReader{s.r} }

func (p poolReader) row(ctx context.Context, query string, args ...any) scanner {
	return p.db.QueryRowContext(ctx, query, sqlArgs(args)...)
}

func (p poolReader) rows(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return p.db.QueryContext(ctx, query, sqlArgs(args)...)
}

// snapshot is a read-only transaction whose queries see one state of the
// database (engine.readOptions); done ends it.
type snapshot struct{ tx *sql.Tx }

// snapshot begins a snapshot on the read pool.
func (s *Store) snapshot(ctx context.Context) (snapshot, error) {
	tx, err := s.r.BeginTx(ctx, s.engine.readOptions())
	return snapshot{tx}, err
}

func (r snapshot) row(ctx context.Context, query string, args ...any) scanner {
	return r.tx.QueryRowContext(ctx, query, sqlArgs(args)...)
}

func (r snapshot) rows(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return r.tx.QueryContext(ctx, query, sqlArgs(args)...)
}

// done ends the snapshot: it changed nothing to keep.
func (r snapshot) done() { _ = r.tx.Rollback() }

// row reads one row in t, which sees what the statements queued before
// it wrote.
func (t *Tx) row(ctx context.Context, query string, args ...any) scanner {
	if err := t.flush(ctx); err != nil {
		return failedRow{err}
	}
	return t.s.engine.queryRow(ctx, t.tc, query, sqlArgs(args))
}

// rows reads every row of query in t, what was queued before it sent
// first.
func (t *Tx) rows(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	return t.tc.tx.QueryContext(ctx, query, sqlArgs(args)...)
}
