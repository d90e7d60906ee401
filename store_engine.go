package main

import (
	"context"
	"database/sql"
	"io"
	"time"
)

// The seam between what the store does and the database it does it on:
// one engine per database, chosen once when the store opens, as River's
// driver is: store_sqlite.go's (embedded, the default) or
// store_postgres.go's (shared by several nodes). One query text serves
// both where they agree ($N placeholders, ON CONFLICT, RETURNING); what
// differs is an engine's, and nothing else in the store asks which
// database it is on.

// engine is what the store does differently on each database.
type engine interface {
	// driver is the database.driver that opened it: "sqlite" or
	// "postgres".
	driver() string
	// shared reports whether several nodes may share the database.
	shared() bool
	// readOptions are the options of a read transaction whose queries
	// see one state of the database.
	readOptions() *sql.TxOptions

	// begin opens a write transaction on w (first: before the others
	// that wait for a connection, when they wait in turn); end gives its
	// connection back once it ended.
	begin(ctx context.Context, w *sql.DB, first bool) (*txConn, error)
	end(tc *txConn)
	// exec and queryRow run one statement in tc now.
	exec(ctx context.Context, tc *txConn, query string, args []any) (sql.Result, error)
	queryRow(ctx context.Context, tc *txConn, query string, args []any) *sql.Row
	// pipelines reports whether statements queued ahead of their answers
	// are sent together (sendAhead), in one round trip.
	pipelines() bool
	sendAhead(ctx context.Context, tc *txConn, stmts []pipelined) ([]int64, error)
	// lost reports whether err is the connection to the database failing
	// (never on a file), not a statement the database refused.
	lost(err error) bool
	// ping asks whether the database answers and takes writes; idle
	// keeps the pool's idle connections (true) or drops them, while the
	// database is lost, so that each ping dials anew.
	ping(ctx context.Context, w *sql.DB) error
	idle(w *sql.DB, keep bool)
	// lock serializes, among the nodes, transactions that read and then
	// write key.
	lock(ctx context.Context, tc *txConn, key string) error
	// holdFor has the database end tc's transaction should it wait idle
	// for longer than d (a client paused inside it), so that the locks it
	// holds do not hold others back for ever; 0: no bound.
	holdFor(ctx context.Context, tc *txConn, d time.Duration) error
	// lockShared is what a SELECT ends with to lock its rows shared until
	// the transaction ends ("" where writers are serial anyway).
	lockShared() string

	// clock is the database's clock ms milliseconds from now (a
	// parameter, or a number), as a time in timeFormat: leases are timed
	// by the database, so that nodes whose clocks differ agree.
	clock(ms string) string
	// schema is the file of numbered migrations for this database;
	// tracked asks whether schema_migrations exists; legacyVersion reads
	// a version kept before it; migrated records version where that was
	// kept.
	schema() string
	tracked() string
	legacyVersion(ctx context.Context, q dbReader) (int, error)
	migrated(ctx context.Context, tx *sql.Tx, version int) error
	// tablesQuery lists the store's tables, in name order.
	tablesQuery() string
	// size is the database's size in bytes.
	size(ctx context.Context, q dbReader) (int64, error)

	// claim takes the database for this process's serve (nil: nothing
	// to take); its Close lets it go.
	claim(ctx context.Context, r *sql.DB) (io.Closer, error)
	// afterCopy readies a table copy-db filled (PostgreSQL's identity
	// columns go on after the greatest id copied).
	afterCopy(ctx context.Context, tx *sql.Tx, table string) error
	// backup writes a consistent copy of the live database to dest.
	backup(ctx context.Context, w *sql.DB, dest string) error
	// close lets go of what the engine keeps (prepared statements).
	close()
	// unprepared is since when statements run unprepared because a
	// pooler in transaction mode was found (PostgreSQL); nil when not.
	unprepared() *time.Time
}

// txConn is a write transaction as an engine runs it: the transaction,
// the connection it runs on (PostgreSQL's, which statements queued ahead
// are sent on) and the prepared statements bound to it (SQLite's).
type txConn struct {
	tx    *sql.Tx
	conn  *sql.Conn
	stmts map[string]*sql.Stmt
}

// pipelined is a statement sent ahead of its answer: its text and
// arguments.
type pipelined struct {
	query string
	args  []any
}

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
