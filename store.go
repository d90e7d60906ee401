package main

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	_ "modernc.org/sqlite"
)

// Store is switchyard's SQLite database: one writer connection, so writes queue
// in Go instead of contending for the file lock, and a small pool of read-only
// connections for the API and health checks.
type Store struct {
	w       *sql.DB
	r       *sql.DB
	path    string
	metrics *Metrics
	stmts   sync.Map // query -> *sql.Stmt prepared on the writer (see exec)
	wanted  sync.Map // query -> struct{}: to prepare before the next write
	// gapsOpen is whether delivery_gaps may hold an open gap: storing an
	// Event resolves its gap only then (see resolveGap). Migrate counts
	// them, RecordGap and the hooks poll keep it true.
	gapsOpen atomic.Bool
}

// OpenStore opens (creating when needed) the database at cfg.Path with the
// pragmas set on every connection, and checks that WAL mode really took.
// metrics may be nil (the commands that record none).
func OpenStore(ctx context.Context, cfg DatabaseConfig, metrics *Metrics) (*Store, error) {
	dsn := func(extra string) string {
		q := url.Values{}
		q.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", cfg.BusyTimeout.Milliseconds()))
		q.Add("_pragma", "journal_mode(WAL)")
		q.Add("_pragma", "foreign_keys(1)")
		q.Add("_pragma", "synchronous("+strings.ToUpper(cfg.Synchronous)+")")
		if extra != "" {
			q.Add("_pragma", extra)
		}
		// A deferred transaction that later writes fails with SQLITE_BUSY
		// without waiting; immediate ones wait busy_timeout for the lock.
		q.Set("_txlock", "immediate")
		return "file:" + cfg.Path + "?" + q.Encode()
	}
	// The writer's page cache holds the leaf pages of the delivery_id
	// indexes that inserts touch, for a big github table. Each 4 KiB page
	// takes an 8 KiB slot of the driver's allocator (page and headers,
	// rounded up to a power of two), so n MiB of cache hold 2n MB of RSS:
	// 4 MiB is where a larger cache stopped speeding up inserts into a
	// table of a million rows (BENCHMARKS.md). Readers keep the default.
	// The file holds every payload: created readable by its owner only
	// (SQLite gives its -wal and -shm files the same mode).
	if f, err := os.OpenFile(cfg.Path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600); err == nil {
		f.Close()
	}
	w, err := sql.Open("sqlite", dsn("cache_size(-4096)"))
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", cfg.Path, err)
	}
	w.SetMaxOpenConns(1)
	w.SetMaxIdleConns(1)
	w.SetConnMaxIdleTime(0)
	w.SetConnMaxLifetime(0)

	var mode string
	if err := w.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		w.Close()
		return nil, fmt.Errorf("open %s: %w", cfg.Path, err)
	}
	if mode != "wal" {
		w.Close()
		return nil, fmt.Errorf("open %s: journal_mode is %q, want wal", cfg.Path, mode)
	}

	r, err := sql.Open("sqlite", dsn("query_only(1)"))
	if err != nil {
		w.Close()
		return nil, fmt.Errorf("open %s: %w", cfg.Path, err)
	}
	r.SetMaxOpenConns(4)
	return &Store{w: w, r: r, path: cfg.Path, metrics: metrics}, nil
}

// Close closes both pools; the WAL is checkpointed by the last connection.
func (s *Store) Close() error {
	s.stmts.Range(func(_, st any) bool {
		st.(*sql.Stmt).Close()
		return true
	})
	return errors.Join(s.r.Close(), s.w.Close())
}

// Tx is one write transaction on the writer connection. Every write is a
// method of Tx, and Store.WriteTx is the one way to open one: the caller says
// what commits together. Nothing else reaches the writer. It is a value passed along, never carried in a context, so that a
// callee writes inside a transaction only when its caller hands it one. No
// network I/O may happen while one is open.
type Tx struct {
	s     *Store
	tx    *sql.Tx
	stmts map[string]*sql.Stmt // the prepared statements bound to tx, by query
}

// WriteTx runs fn in one write transaction and commits once, or rolls back when fn
// fails. One fsync then covers every message fn handles, which
// synchronous=FULL makes the costliest part of a message. Messages stay in
// order: fn handles them one after the other, each in a Savepoint.
func (s *Store) WriteTx(ctx context.Context, fn func(tx *Tx) error) error {
	s.prepareWanted(ctx)
	start := time.Now()
	defer func() { s.metrics.dbWrite(time.Since(start)) }()
	tx, err := s.w.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	if err := fn(&Tx{s: s, tx: tx}); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// queryer is what reads need: a pool or a transaction.
type queryer interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}

// exec runs one statement in tx, prepared once: modernc.org/sqlite has no
// statement cache of its own, and preparing was a twentieth of a consumer's
// CPU. A statement cannot be prepared inside a transaction (the transaction
// holds the one writer connection), so the first use runs it unprepared and
// asks for it, and the next transaction prepares it before it begins
// (prepareWanted).
//
// The statement runs without its context's cancellation: for a context
// that can end, modernc.org/sqlite starts a goroutine per statement to
// interrupt it, a tenth of the writer's CPU per message (BenchmarkBatchWrite),
// for statements that take microseconds. A context that has ended fails the
// next statement, and database/sql rolls the transaction back (BeginTx).
func (t *Tx) exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ctx = context.WithoutCancel(ctx)
	if st := t.stmt(ctx, query); st != nil {
		return st.ExecContext(ctx, args...)
	}
	return t.tx.ExecContext(ctx, query, args...)
}

// queryRow is exec's counterpart for one-row reads inside tx.
func (t *Tx) queryRow(ctx context.Context, query string, args ...any) *sql.Row {
	ctx = context.WithoutCancel(ctx)
	if st := t.stmt(ctx, query); st != nil {
		return st.QueryRowContext(ctx, args...)
	}
	return t.tx.QueryRowContext(ctx, query, args...)
}

// stmt is query's prepared statement bound to tx, or nil (and asked for)
// when it is not prepared yet. database/sql binds a statement to a
// transaction anew on every Tx.StmtContext, and keeps each binding until
// the end; a batch binds each of its statements once.
func (t *Tx) stmt(ctx context.Context, query string) *sql.Stmt {
	if st, ok := t.stmts[query]; ok {
		return st
	}
	st, ok := t.s.stmts.Load(query)
	if !ok {
		t.s.wanted.Store(query, struct{}{})
		return nil
	}
	if t.stmts == nil {
		t.stmts = map[string]*sql.Stmt{}
	}
	bound := t.tx.StmtContext(ctx, st.(*sql.Stmt))
	t.stmts[query] = bound
	return bound
}

// prepareWanted prepares the statements exec asked for. It runs outside any
// transaction, before one begins; a statement that fails to prepare stays
// unprepared.
func (s *Store) prepareWanted(ctx context.Context) {
	s.wanted.Range(func(k, _ any) bool {
		s.wanted.Delete(k)
		if st, err := s.w.PrepareContext(ctx, k.(string)); err == nil {
			if _, loaded := s.stmts.LoadOrStore(k, st); loaded {
				st.Close()
			}
		}
		return true
	})
}

// Savepoint runs fn inside one savepoint of tx: a failure rolls back fn's
// writes only, so one message of a batch that fails leaves the others.
// Savepoints are released before the next begins, so one name serves them
// all, and its three statements are prepared once.
func (t *Tx) Savepoint(ctx context.Context, fn func() error) error {
	if _, err := t.exec(ctx, "SAVEPOINT msg"); err != nil {
		return fmt.Errorf("savepoint: %w", err)
	}
	if err := fn(); err != nil {
		ctx := context.WithoutCancel(ctx) // undo the message even when its time is up
		if _, rerr := t.exec(ctx, "ROLLBACK TO msg"); rerr != nil {
			return errors.Join(err, fmt.Errorf("rollback to savepoint: %w", rerr))
		}
		_, _ = t.exec(ctx, "RELEASE msg")
		return err
	}
	if _, err := t.exec(ctx, "RELEASE msg"); err != nil {
		return fmt.Errorf("release savepoint: %w", err)
	}
	return nil
}

// Writable proves the database takes a write lock, for /readyz.
func (s *Store) Writable(ctx context.Context) error {
	return s.WriteTx(ctx, func(tx *Tx) error {
		_, err := tx.tx.ExecContext(ctx, "UPDATE settings SET value = value WHERE 0")
		return err
	})
}

// Setting reads one settings row from a reader; a missing row reads as "".
func (s *Store) Setting(ctx context.Context, key string) (string, error) {
	return getSetting(ctx, s.r, key)
}

// Setting reads one settings row inside tx.
func (t *Tx) Setting(ctx context.Context, key string) (string, error) {
	return getSetting(ctx, t.tx, key)
}

func getSetting(ctx context.Context, q queryer, key string) (string, error) {
	var v string
	err := q.QueryRowContext(ctx, "SELECT value FROM settings WHERE key = ?", key).Scan(&v)
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
	_, err := t.exec(ctx, `INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?)
		ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at`,
		key, value, formatTime(now))
	if err != nil {
		return fmt.Errorf("write setting %s: %w", key, err)
	}
	return nil
}

// statisticsBucket is the start of the 6-hour UTC bucket holding t.
func statisticsBucket(t time.Time) string {
	t = t.UTC()
	return time.Date(t.Year(), t.Month(), t.Day(), t.Hour()/6*6, 0, 0, 0, time.UTC).Format(time.RFC3339)
}

// nullInt stores 0 as NULL: GitHub ids are never 0, so 0 means "not given".
func nullInt(v int64) any {
	if v == 0 {
		return nil
	}
	return v
}

// Backup writes a consistent snapshot of the live database to dest with
// VACUUM INTO, then checks the copy with integrity_check.
func (s *Store) Backup(ctx context.Context, dest string) error {
	// VACUUM INTO only reads this database (in one read transaction, so the
	// copy is consistent while serve writes), but the query_only readers
	// refuse it; the writer connection does it without taking a write lock.
	if _, err := s.w.ExecContext(ctx, "VACUUM INTO ?", dest); err != nil {
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

// retentionBatch is the most raw rows one retention transaction changes, so
// that writers never wait long behind it.
const retentionBatch = 1000

// PrunePayloadsBefore empties the payload of at most retentionBatch raw
// github rows received before cutoff, in tx, and returns how many it
// pruned. The rows stay, as the deliveries' identities.
func (tx *Tx) PrunePayloadsBefore(ctx context.Context, cutoff time.Time) (int64, error) {
	res, err := tx.exec(ctx, `UPDATE github SET payload = '', payload_pruned_at = ? WHERE id IN
		(SELECT id FROM github WHERE received_at < ? AND payload_pruned_at IS NULL ORDER BY received_at LIMIT ?)`,
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
	res, err := tx.exec(ctx, `DELETE FROM github WHERE id IN
		(SELECT id FROM github WHERE received_at < ? ORDER BY received_at LIMIT ?)`, formatTime(cutoff), retentionBatch)
	if err != nil {
		return 0, fmt.Errorf("delete delivery identities: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, err
	}
	_, err = tx.exec(ctx, `DELETE FROM worker_deliveries WHERE (worker, delivery_id, hook_id) IN
		(SELECT worker, delivery_id, hook_id FROM worker_deliveries WHERE processed_at < ? LIMIT ?)`, formatTime(cutoff), retentionBatch)
	if err != nil {
		return 0, fmt.Errorf("delete worker records: %w", err)
	}
	return n, nil
}
