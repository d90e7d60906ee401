package main

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	_ "modernc.org/sqlite"
)

// The SQLite engine: one file, one writer connection (writes queue in Go
// instead of contending for the file lock), a small pool of read-only
// connections for the API and health checks, and a cache of prepared
// statements.

// sqliteEngine is the store's engine on an SQLite file.
type sqliteEngine struct {
	path   string
	turns  writerTurns // who has the one writer connection next
	stmts  sync.Map    // query -> *sql.Stmt prepared on the writer (see exec)
	wanted sync.Map    // query -> struct{}: to prepare before the next write
}

// openSQLite opens (creating when needed) the SQLite file at cfg.Path:
// its writer and its readers, and checks that WAL mode really took.
func openSQLite(ctx context.Context, cfg DatabaseConfig) (w, r *sql.DB, e *sqliteEngine, err error) {
	dsn := func(extra ...string) string {
		q := url.Values{}
		q.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", cfg.BusyTimeout.Milliseconds()))
		q.Add("_pragma", "journal_mode(WAL)")
		q.Add("_pragma", "foreign_keys(1)")
		q.Add("_pragma", "synchronous("+strings.ToUpper(cfg.Synchronous)+")")
		// Savepoints and statements that may need undoing keep the pages
		// they change in a sub-journal: a temporary file, written page by
		// page, unless temporary storage is memory. A batch's are a few
		// megabytes at most.
		q.Add("_pragma", "temp_store(MEMORY)")
		for _, p := range extra {
			q.Add("_pragma", p)
		}
		// A deferred transaction that later writes fails with SQLITE_BUSY
		// without waiting; immediate ones wait busy_timeout for the lock.
		q.Set("_txlock", "immediate")
		return "file:" + cfg.Path + "?" + q.Encode()
	}
	// The file holds every payload: created readable by its owner only
	// (SQLite gives its -wal and -shm files the same mode).
	if f, err := os.OpenFile(cfg.Path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600); err == nil {
		f.Close()
	}
	// The writer's page cache holds the leaf pages of the delivery_id
	// indexes that inserts touch, for a big github table. Each 4 KiB page
	// takes an 8 KiB slot of the driver's allocator (page and headers,
	// rounded up to a power of two), so n MiB of cache hold 2n MB of RSS:
	// 4 MiB is where a larger cache stopped speeding up inserts into a
	// table of a million rows (BENCHMARKS.md). Readers keep the default.
	w, err = sql.Open("sqlite", dsn("cache_size(-4096)"))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("open %s: %w", cfg.Path, err)
	}
	w.SetMaxOpenConns(1)
	w.SetMaxIdleConns(1)
	w.SetConnMaxIdleTime(0)
	w.SetConnMaxLifetime(0)

	var mode string
	if err := w.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		w.Close()
		return nil, nil, nil, fmt.Errorf("open %s: %w", cfg.Path, err)
	}
	if mode != "wal" {
		w.Close()
		return nil, nil, nil, fmt.Errorf("open %s: journal_mode is %q, want wal", cfg.Path, mode)
	}

	r, err = sql.Open("sqlite", dsn("query_only(1)"))
	if err != nil {
		w.Close()
		return nil, nil, nil, fmt.Errorf("open %s: %w", cfg.Path, err)
	}
	r.SetMaxOpenConns(4)
	return w, r, &sqliteEngine{path: cfg.Path}, nil
}

func (e *sqliteEngine) driver() string { return "sqlite" }
func (e *sqliteEngine) shared() bool   { return false }

// readOptions: SQLite's read transaction sees one state of the file.
func (e *sqliteEngine) readOptions() *sql.TxOptions { return &sql.TxOptions{ReadOnly: true} }

// begin takes the writer's turn (first: before the writes that wait and
// are not), prepares the statements exec asked for, outside any
// transaction (the one writer connection would be the transaction's),
// then begins.
func (e *sqliteEngine) begin(ctx context.Context, w *sql.DB, first bool) (*txConn, error) {
	if err := e.turns.take(ctx, first); err != nil {
		return nil, err
	}
	e.wanted.Range(func(k, _ any) bool {
		e.wanted.Delete(k)
		if st, err := w.PrepareContext(ctx, k.(string)); err == nil {
			if _, loaded := e.stmts.LoadOrStore(k, st); loaded {
				st.Close()
			}
		}
		return true
	})
	tx, err := w.BeginTx(ctx, nil)
	if err != nil {
		e.turns.pass()
		return nil, err
	}
	return &txConn{tx: tx}, nil
}

// end passes the writer's turn on.
func (e *sqliteEngine) end(*txConn) { e.turns.pass() }

// writerTurns hands SQLite's one writer connection to the store's write
// transactions one at a time: first to those a client waits on (the
// outbox's, whose commit a 202 waits for), each in the order it came,
// then to the others in theirs. database/sql would hand the connection
// to any of its waiters, and a webhook's answer would wait behind every
// consumer's batch that happened to be waiting with it; in turns it
// waits for the one transaction under way at most.
type writerTurns struct {
	mu          sync.Mutex
	busy        bool
	first, rest []chan struct{} // waiting, each closed when its turn comes
}

// take waits for the turn, or ctx's end.
func (w *writerTurns) take(ctx context.Context, first bool) error {
	w.mu.Lock()
	if !w.busy {
		w.busy = true
		w.mu.Unlock()
		return nil
	}
	turn := make(chan struct{})
	if first {
		w.first = append(w.first, turn)
	} else {
		w.rest = append(w.rest, turn)
	}
	w.mu.Unlock()
	select {
	case <-turn:
		return nil
	case <-ctx.Done():
	}
	w.mu.Lock()
	waiting := len(w.first) + len(w.rest)
	w.first = slices.DeleteFunc(w.first, func(c chan struct{}) bool { return c == turn })
	w.rest = slices.DeleteFunc(w.rest, func(c chan struct{}) bool { return c == turn })
	given := waiting == len(w.first)+len(w.rest) // it came as ctx ended
	w.mu.Unlock()
	if given {
		w.pass()
	}
	return ctx.Err()
}

// pass ends the turn: the next waiting takes it.
func (w *writerTurns) pass() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, q := range []*[]chan struct{}{&w.first, &w.rest} {
		if len(*q) > 0 {
			close((*q)[0])
			*q = (*q)[1:]
			return
		}
	}
	w.busy = false
}

// exec runs one statement in tc, prepared once: modernc.org/sqlite has no
// statement cache of its own, and preparing was a twentieth of a
// consumer's CPU. A statement cannot be prepared inside a transaction (the
// transaction holds the one writer connection), so the first use runs it
// unprepared and asks for it, and the next transaction prepares it before
// it begins.
//
// The statement runs without its context's cancellation: for a context
// that can end, modernc.org/sqlite starts a goroutine per statement to
// interrupt it, a tenth of the writer's CPU per message
// (BenchmarkBatchWrite), for statements that take microseconds. A context
// that has ended fails the next statement (Tx.write), and database/sql
// rolls the transaction back (BeginTx).
func (e *sqliteEngine) exec(ctx context.Context, tc *txConn, query string, args []any) (sql.Result, error) {
	ctx = context.WithoutCancel(ctx)
	if st := e.stmt(ctx, tc, query); st != nil {
		return st.ExecContext(ctx, args...)
	}
	return tc.tx.ExecContext(ctx, query, args...)
}

// queryRow is exec's counterpart for a one-row read.
func (e *sqliteEngine) queryRow(ctx context.Context, tc *txConn, query string, args []any) *sql.Row {
	ctx = context.WithoutCancel(ctx)
	if st := e.stmt(ctx, tc, query); st != nil {
		return st.QueryRowContext(ctx, args...)
	}
	return tc.tx.QueryRowContext(ctx, query, args...)
}

// stmt is query's prepared statement bound to tc, or nil (and asked for)
// when it is not prepared yet. database/sql binds a statement to a
// transaction anew on every Tx.StmtContext, and keeps each binding until
// the end; a batch binds each of its statements once.
func (e *sqliteEngine) stmt(ctx context.Context, tc *txConn, query string) *sql.Stmt {
	if st, ok := tc.stmts[query]; ok {
		return st
	}
	st, ok := e.stmts.Load(query)
	if !ok {
		e.wanted.Store(query, struct{}{})
		return nil
	}
	if tc.stmts == nil {
		tc.stmts = map[string]*sql.Stmt{}
	}
	bound := tc.tx.StmtContext(ctx, st.(*sql.Stmt))
	tc.stmts[query] = bound
	return bound
}

// pipelines: a statement is a function call; nothing to send together.
func (e *sqliteEngine) pipelines() bool { return false }

func (e *sqliteEngine) sendAhead(context.Context, *txConn, []pipelined) ([]int64, error) {
	return nil, errors.New("SQLite sends no statement ahead")
}

// lost: a file is never lost.
func (e *sqliteEngine) lost(error) bool { return false }

func (e *sqliteEngine) ping(ctx context.Context, w *sql.DB) error { return w.PingContext(ctx) }
func (e *sqliteEngine) idle(*sql.DB, bool)                        {}

// lock: SQLite's write transactions are serial already (BEGIN IMMEDIATE).
func (e *sqliteEngine) lock(context.Context, *txConn, string) error { return nil }

// holdFor: one process holds an SQLite file; nothing waits on another.
func (e *sqliteEngine) holdFor(context.Context, *txConn, time.Duration) error { return nil }

func (e *sqliteEngine) lockShared() string { return "" }

func (e *sqliteEngine) clock(ms string) string {
	// %f is seconds with three fraction digits; timeFormat has six.
	return `strftime('%Y-%m-%dT%H:%M:%f', 'now', (CAST(` + ms + ` AS BIGINT) / 1000.0) || ' seconds') || '000Z'`
}

func (e *sqliteEngine) schema() string { return schemaSQL }
func (e *sqliteEngine) tracked() string {
	return "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
}

// legacyVersion: SQLite kept the version in PRAGMA user_version before
// schema_migrations, and still does.
func (e *sqliteEngine) legacyVersion(ctx context.Context, q dbReader) (int, error) {
	var v int
	err := q.row(ctx, "PRAGMA user_version").Scan(&v)
	return v, err
}

func (e *sqliteEngine) migrated(ctx context.Context, tx *sql.Tx, version int) error {
	_, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", version))
	return err
}

func (e *sqliteEngine) tablesQuery() string {
	return "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
}

// size is the file and its WAL.
func (e *sqliteEngine) size(context.Context, dbReader) (int64, error) {
	var n int64
	for _, p := range []string{e.path, e.path + "-wal"} {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Size()
		}
	}
	return n, nil
}

// claim takes the file for this process's serve: an SQLite file has one
// serve. An exclusive lock on it (flock, beside SQLite's own locks),
// which the kernel releases when the process ends however it ends, so
// that a second serve is refused, naming the node that serves it, and a
// restart after a crash is not. Closing it (last: closing a descriptor
// of the file drops every POSIX lock the process holds on it, SQLite's
// too) lets it go.
func (e *sqliteEngine) claim(ctx context.Context, r *sql.DB) (io.Closer, error) {
	f, err := os.Open(e.path)
	if err != nil {
		return nil, fmt.Errorf("claim %s: %w", e.path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("claim %s: %w", e.path, err)
		}
		who := "another switchyard serve"
		var name, seen string
		if r.QueryRowContext(ctx, "SELECT name, seen_at FROM nodes ORDER BY seen_at DESC LIMIT 1").Scan(&name, &seen) == nil {
			who = fmt.Sprintf("node %q (last seen %s)", name, seen)
		}
		return nil, fmt.Errorf("database %s is served by %s: one serve per SQLite file; several nodes share a PostgreSQL database (database.driver = \"postgres\")", e.path, who)
	}
	return f, nil
}

// afterCopy: SQLite's rowids need nothing.
func (e *sqliteEngine) afterCopy(context.Context, *sql.Tx, string) error { return nil }

// backup writes a consistent snapshot of the live database to dest with
// VACUUM INTO, then checks the copy with integrity_check.
func (e *sqliteEngine) backup(ctx context.Context, w *sql.DB, dest string) error {
	// VACUUM INTO only reads this database (in one read transaction, so the
	// copy is consistent while serve writes), but the query_only readers
	// refuse it; the writer connection does it without taking a write lock.
	if _, err := w.ExecContext(ctx, "VACUUM INTO $1", dest); err != nil {
		return fmt.Errorf("vacuum into %s: %w", dest, err)
	}
	db, err := sql.Open("sqlite", "file:"+dest+"?mode=ro")
	if err != nil {
		return fmt.Errorf("open backup: %w", err)
	}
	defer db.Close()
	var res string
	if err := db.QueryRowContext(ctx, "PRAGMA integrity_check").Scan(&res); err != nil {
		return fmt.Errorf("integrity_check %s: %w", dest, err)
	}
	if res != "ok" {
		return fmt.Errorf("integrity_check %s: %s", dest, res)
	}
	return nil
}

func (e *sqliteEngine) unprepared() *time.Time { return nil }

// schemaSQL is SQLite's schema, as its numbered migrations.
//
//go:embed schema.sql
var schemaSQL string

func (e *sqliteEngine) close() {
	e.stmts.Range(func(_, st any) bool {
		st.(*sql.Stmt).Close()
		return true
	})
}
