package main

import (
	"context"
	"database/sql"
)

// The readers of dbReader (store_engine.go) besides a Tx (store.go): the
// read pool and a snapshot.

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
