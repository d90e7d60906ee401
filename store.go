package main

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	_ "modernc.org/sqlite"
)

//go:embed schema.sql
var schemaSQL string

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
	// 8 MiB held 16 MB, and bought nothing over 4 MiB in the million-row
	// row (BENCHMARKS.md). Readers keep the default.
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

// migration is one "-- migration N: ..." block of schema.sql.
type migration struct {
	version int
	name    string
	sql     string
}

var migrationHeader = regexp.MustCompile(`(?m)^-- migration (\d+): (.*)$`)

// parseMigrations splits schema.sql into its numbered blocks, which must count
// up from 1 without gaps.
func parseMigrations(src string) ([]migration, error) {
	locs := migrationHeader.FindAllStringSubmatchIndex(src, -1)
	var ms []migration
	for i, loc := range locs {
		end := len(src)
		if i+1 < len(locs) {
			end = locs[i+1][0]
		}
		v, _ := strconv.Atoi(src[loc[2]:loc[3]])
		if v != i+1 {
			return nil, fmt.Errorf("schema.sql: migration %d out of order (want %d)", v, i+1)
		}
		ms = append(ms, migration{version: v, name: src[loc[4]:loc[5]], sql: src[loc[1]:end]})
	}
	return ms, nil
}

// Migrate brings the schema up to date, each migration in its own transaction
// together with the user_version that records it. It returns the versions
// before and after.
func (s *Store) Migrate(ctx context.Context) (from, to int, err error) {
	ms, err := parseMigrations(schemaSQL)
	if err != nil {
		return 0, 0, err
	}
	if err := s.w.QueryRowContext(ctx, "PRAGMA user_version").Scan(&from); err != nil {
		return 0, 0, fmt.Errorf("read schema version: %w", err)
	}
	if from > len(ms) {
		return from, from, fmt.Errorf("database schema version %d is newer than this binary knows (%d): upgrade switchyard", from, len(ms))
	}
	to = from
	for _, m := range ms[from:] {
		err := s.Batch(ctx, func(tx *Tx) error {
			if _, err := tx.tx.ExecContext(ctx, m.sql); err != nil {
				return err
			}
			_, err := tx.tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", m.version))
			return err
		})
		if err != nil {
			return from, to, fmt.Errorf("migration %d (%s): %w", m.version, m.name, err)
		}
		to = m.version
	}
	if n, err := s.OpenGapCount(ctx); err == nil {
		s.gapsOpen.Store(n > 0)
	}
	return from, to, nil
}

// Tx is one write transaction on the writer connection. Store methods that
// write take one, or open their own when given nil; nothing else reaches the
// writer. It is a value passed along, never carried in a context, so that a
// callee writes inside a transaction only when its caller hands it one. No
// network I/O may happen while one is open.
type Tx struct {
	s     *Store
	tx    *sql.Tx
	stmts map[string]*sql.Stmt // the prepared statements bound to tx, by query
}

// Batch runs fn in one transaction and commits once, or rolls back when fn
// fails. One fsync then covers every message fn handles, which
// synchronous=FULL makes the costliest part of a message. Messages stay in
// order: fn handles them one after the other, each in a Savepoint.
func (s *Store) Batch(ctx context.Context, fn func(tx *Tx) error) error {
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

// inTx runs fn in tx, or in a transaction of its own when tx is nil.
func (s *Store) inTx(ctx context.Context, tx *Tx, fn func(tx *Tx) error) error {
	if tx != nil {
		return fn(tx)
	}
	return s.Batch(ctx, fn)
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
	return s.Batch(ctx, func(tx *Tx) error {
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

// payloadText is the payload as the TEXT it is stored as, without a copy:
// string(payload) copied every 25 KB webhook on the Go heap, a sixth of all
// the daemon allocated end to end, only for the driver to copy it again into
// SQLite's memory when it binds it (sqlite3_bind_text). The bytes are the
// delivery's body, which nothing writes to. (A []byte would be bound, and
// stored, as a BLOB, not as the TEXT the column holds.)
func payloadText(payload []byte) string {
	return unsafe.String(unsafe.SliceData(payload), len(payload))
}

// InsertEvent writes the raw Event, counts it in its 6-hour bucket and
// queues its alert on each of channels (alert_outbox), in one transaction. It
// reports false, and changes nothing, when the delivery is already stored: a
// retried or redelivered message must not count or alert twice.
func (s *Store) InsertEvent(ctx context.Context, tx *Tx, ev *Event, forbidden bool, channels ...string) (inserted bool, err error) {
	err = s.inTx(ctx, tx, func(tx *Tx) error {
		res, err := tx.exec(ctx, `INSERT INTO github (delivery_id, event, action, hook_id, target_type,
			target_id, installation_id, repository, sender, source_ip, forbidden, payload, received_at, processed_at)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (delivery_id) DO NOTHING`,
			ev.DeliveryID, ev.Name, ev.Action, nullInt(ev.HookID), ev.TargetType, nullInt(ev.TargetID),
			nullInt(ev.InstallationID), ev.Repository, ev.Sender, ev.SourceIP, forbidden,
			payloadText(ev.Payload), formatTime(ev.ReceivedAt), formatTime(time.Now()))
		if err != nil {
			return fmt.Errorf("insert github: %w", err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			// Stored before: the story of the delivery says it came again.
			if _, err := tx.exec(ctx, "UPDATE github SET duplicates = duplicates + 1, last_duplicate_at = ? WHERE delivery_id = ?",
				formatTime(time.Now()), ev.DeliveryID); err != nil {
				return fmt.Errorf("count a duplicate: %w", err)
			}
			return nil
		}
		inserted = true
		if err := tx.resolveGap(ctx, ev.DeliveryID); err != nil {
			return err
		}
		_, err = tx.exec(ctx, `INSERT INTO github_statistics_6h (bucket, event, action, count) VALUES (?, ?, ?, 1)
			ON CONFLICT (bucket, event, action) DO UPDATE SET count = count + 1`,
			statisticsBucket(ev.ReceivedAt), ev.Name, ev.Action)
		if err != nil {
			return fmt.Errorf("count statistics: %w", err)
		}
		return tx.queueAlerts(ctx, ev.DeliveryID, channels)
	})
	return inserted, err
}

// MarkDelivery runs fn and records that worker finished the delivery, in tx
// or a transaction of its own, with the outcome fn returns ("" is done). It
// reports false, without running fn, when the worker already finished it.
func (s *Store) MarkDelivery(ctx context.Context, tx *Tx, worker, deliveryID string, fn func(tx *Tx) (outcome string, err error)) (done bool, err error) {
	err = s.inTx(ctx, tx, func(tx *Tx) error {
		res, err := tx.exec(ctx, `INSERT INTO worker_deliveries (worker, delivery_id, processed_at)
			VALUES (?, ?, ?) ON CONFLICT DO NOTHING`, worker, deliveryID, formatTime(time.Now()))
		if err != nil {
			return fmt.Errorf("mark delivery: %w", err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return nil
		}
		done = true
		if fn == nil {
			return nil
		}
		outcome, err := fn(tx)
		if err != nil || outcome == "" {
			return err
		}
		_, err = tx.exec(ctx, "UPDATE worker_deliveries SET outcome = ? WHERE worker = ? AND delivery_id = ?", outcome, worker, deliveryID)
		return err
	})
	return done, err
}

// Finished reports whether worker finished the delivery (MarkDelivery).
func (s *Store) Finished(ctx context.Context, worker, deliveryID string) (bool, error) {
	var n int
	err := s.r.QueryRowContext(ctx, "SELECT count(*) FROM worker_deliveries WHERE worker = ? AND delivery_id = ?",
		worker, deliveryID).Scan(&n)
	if err != nil {
		return false, fmt.Errorf("read worker_deliveries: %w", err)
	}
	return n > 0, nil
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
// github rows received before cutoff, in one transaction, and returns how
// many it pruned. The rows stay, as the deliveries' identities.
func (s *Store) PrunePayloadsBefore(ctx context.Context, cutoff time.Time) (int64, error) {
	var n int64
	err := s.Batch(ctx, func(tx *Tx) error {
		res, err := tx.exec(ctx, `UPDATE github SET payload = '', payload_pruned_at = ? WHERE id IN
			(SELECT id FROM github WHERE received_at < ? AND payload_pruned_at IS NULL ORDER BY received_at LIMIT ?)`,
			formatTime(time.Now()), formatTime(cutoff), retentionBatch)
		if err != nil {
			return fmt.Errorf("prune raw payloads: %w", err)
		}
		n, err = res.RowsAffected()
		return err
	})
	return n, err
}

// DeleteIdentitiesBefore deletes at most retentionBatch deliveries received
// before cutoff, in one transaction: their github rows and the records of
// which workers finished them. Statistics and typed tables stay. It returns
// how many github rows it deleted.
func (s *Store) DeleteIdentitiesBefore(ctx context.Context, cutoff time.Time) (int64, error) {
	var n int64
	err := s.Batch(ctx, func(tx *Tx) error {
		res, err := tx.exec(ctx, `DELETE FROM github WHERE id IN
			(SELECT id FROM github WHERE received_at < ? ORDER BY received_at LIMIT ?)`, formatTime(cutoff), retentionBatch)
		if err != nil {
			return fmt.Errorf("delete delivery identities: %w", err)
		}
		n, err = res.RowsAffected()
		if err != nil {
			return err
		}
		_, err = tx.exec(ctx, `DELETE FROM worker_deliveries WHERE (worker, delivery_id) IN
			(SELECT worker, delivery_id FROM worker_deliveries WHERE processed_at < ? LIMIT ?)`, formatTime(cutoff), retentionBatch)
		if err != nil {
			return fmt.Errorf("delete worker records: %w", err)
		}
		return nil
	})
	return n, err
}
