package main

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	_ "modernc.org/sqlite"
)

// Store is switchyard's database: an SQLite file (the default), or a
// PostgreSQL database that several nodes share (store_dialect.go).
//
// SQLite has one writer connection, so writes queue in Go instead of
// contending for the file lock, and a small pool of read-only connections
// for the API and health checks. PostgreSQL has one pool of at most
// database.max_conns connections for both.
type Store struct {
	w       *sql.DB
	r       *sql.DB
	dialect dialect
	path    string // the SQLite file; "" on PostgreSQL
	// name says which database this is, without secrets: the file, or
	// the URL without its password.
	name    string
	metrics *Metrics
	stmts   sync.Map // query -> *sql.Stmt prepared on the writer (see exec)
	wanted  sync.Map // query -> struct{}: to prepare before the next write
	// gapsOpen is whether delivery_gaps may hold an open gap: storing an
	// Event resolves its gap only then (see resolveGap). Migrate counts
	// them, RecordGap and the hooks poll keep it true.
	gapsOpen atomic.Bool
	// health follows the connection to PostgreSQL (store_health.go).
	health *dbHealth
	// claim holds the SQLite file's lock while serve runs (Claim).
	claim *os.File
	// codec compresses and inflates the raw log's payloads (store_codec.go).
	codec *payloadCodec
	// guesses are the answers a consumer's statements nearly always get,
	// sent ahead as if known (Tx.execGuess): a delivery's first copy
	// stored, a worker's mark new, an order-safe row written.
	guesses struct{ firstCopy, mark, row aheadGuess }
}

// OpenStore opens the database cfg names: the SQLite file at cfg.Path
// (created when needed) with the pragmas set on every connection, or the
// PostgreSQL database at cfg.URL. metrics may be nil (the commands that
// record none).
func OpenStore(ctx context.Context, cfg DatabaseConfig, metrics *Metrics) (*Store, error) {
	if cfg.Driver == "postgres" {
		db, err := openPostgres(ctx, cfg)
		if err != nil {
			return nil, err
		}
		s := &Store{w: db, r: db, dialect: dialectPostgres, name: redactDatabaseURL(cfg.URL), metrics: metrics,
			codec: newPayloadCodec()}
		s.health = newDBHealth(s.dialect, db.PingContext)
		return s, nil
	}
	return openSQLite(ctx, cfg, metrics)
}

// openSQLite opens (creating when needed) the SQLite file at cfg.Path, and
// checks that WAL mode really took.
func openSQLite(ctx context.Context, cfg DatabaseConfig, metrics *Metrics) (*Store, error) {
	dsn := func(extra string) string {
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
		if extra != "" {
			q.Add("_pragma", extra)
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
	s := &Store{w: w, r: r, dialect: dialectSQLite, path: cfg.Path, name: cfg.Path, metrics: metrics, codec: newPayloadCodec()}
	s.health = newDBHealth(s.dialect, w.PingContext)
	return s, nil
}

// Lost returns a channel closed once the database is lost (dbHealth.Lost).
func (s *Store) Lost() <-chan struct{} { return s.health.Lost() }

// Lose marks the database lost, for cause (dbHealth.Lose).
func (s *Store) Lose(cause error) { s.health.Lose(cause) }

// Down reports whether the database is lost now, since when and why.
func (s *Store) Down() (bool, time.Time, error) { return s.health.Down() }

// WaitAnswers waits while the database is lost (dbHealth.WaitAnswers).
func (s *Store) WaitAnswers(ctx context.Context) error { return s.health.WaitAnswers(ctx) }

// Name says which database the store is, without secrets.
func (s *Store) Name() string { return s.name }

// Shared reports whether several nodes may share the database: PostgreSQL.
func (s *Store) Shared() bool { return s.dialect == dialectPostgres }

// Close closes the pools once the prober of a lost database has ended;
// SQLite's WAL is checkpointed by the last connection.
func (s *Store) Close() error {
	s.health.close()
	s.codec.close()
	s.stmts.Range(func(_, st any) bool {
		st.(*sql.Stmt).Close()
		return true
	})
	var err error
	if s.r == s.w {
		err = s.w.Close()
	} else {
		err = errors.Join(s.r.Close(), s.w.Close())
	}
	if s.claim != nil {
		// Last: closing a descriptor of the file drops every POSIX lock
		// the process holds on it, SQLite's too.
		s.claim.Close()
	}
	return err
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
	// savepoints: Savepoint opens real ones. A transaction first runs
	// without them (see Savepoint).
	savepoints bool
	// changed counts the rows its statements changed (Changed).
	changed int64
	// conn is the PostgreSQL connection tx runs on, whose statements
	// execAhead queues in ahead, to send together (Pipeline).
	conn      *sql.Conn
	pipelined bool
	ahead     []aheadStmt
	aheadErr  error // the failure of a flush: every later one's
}

// Changed is how many rows tx's statements have inserted, updated or
// deleted so far: reprocess tells a delivery that changed nothing from
// one that did.
func (t *Tx) Changed() int64 { return t.changed }

// WriteTx runs fn in one write transaction and commits once, or rolls back when fn
// fails. One fsync then covers every message fn handles, which
// synchronous=FULL makes the costliest part of a message. Messages stay in
// order: fn handles them one after the other, each in a Savepoint.
//
// Statements fn queued ahead (Pipeline) are sent before the commit; one
// answered otherwise runs fn again, with savepoints.
//
// A failure of the connection to PostgreSQL (connectionLost) is
// ErrDatabaseLost: the store is lost until it answers again (Lost).
func (s *Store) WriteTx(ctx context.Context, fn func(tx *Tx) error) error {
	if s.dialect == dialectSQLite {
		s.prepareWanted(ctx)
	}
	start := time.Now()
	defer func() { s.metrics.dbWrite(time.Since(start)) }()
	savepoints := false
	for {
		t, err := s.begin(ctx, savepoints)
		if err != nil {
			return s.health.observe(fmt.Errorf("begin: %w", err))
		}
		err = fn(t)
		if err == nil {
			err = t.flush(ctx)
		}
		if err != nil {
			t.end(t.tx.Rollback())
			if errors.Is(err, ErrNeedSavepoints) && !savepoints {
				savepoints = true // once more, each part in its savepoint
				continue
			}
			return s.health.observe(err)
		}
		if err := t.end(t.tx.Commit()); err != nil {
			return s.health.observe(fmt.Errorf("commit: %w", err))
		}
		return nil
	}
}

// begin opens a write transaction: on PostgreSQL on a connection of its
// own, which Tx.flush sends queued statements on.
func (s *Store) begin(ctx context.Context, savepoints bool) (*Tx, error) {
	t := &Tx{s: s, savepoints: savepoints}
	if s.dialect == dialectSQLite {
		tx, err := s.w.BeginTx(ctx, nil)
		t.tx = tx
		return t, err
	}
	conn, err := s.w.Conn(ctx)
	if err != nil {
		return nil, err
	}
	if t.tx, err = conn.BeginTx(ctx, nil); err != nil {
		conn.Close()
		return nil, err
	}
	t.conn = conn
	return t, nil
}

// end gives t's connection back to the pool once its transaction has
// ended with err, and returns err.
func (t *Tx) end(err error) error {
	if t.conn != nil {
		t.conn.Close()
	}
	return err
}

// ErrNeedSavepoints is a part of a transaction that failed without a
// savepoint to undo it alone: the transaction's function returns it (as a
// *NeedSavepoints), and WriteTx runs the transaction again with
// savepoints.
var ErrNeedSavepoints = errors.New("a part failed: run again with savepoints")

// NeedSavepoints is ErrNeedSavepoints with the failed part's own error.
type NeedSavepoints struct{ Err error }

func (e *NeedSavepoints) Error() string   { return ErrNeedSavepoints.Error() + ": " + e.Err.Error() }
func (e *NeedSavepoints) Unwrap() []error { return []error{ErrNeedSavepoints, e.Err} }

// sqlArgs are args as both drivers take them: a bool is 1 or 0, as the
// tables keep flags (SQLite has no boolean; PostgreSQL's driver does not
// write a bool into an integer column).
func sqlArgs(args []any) []any {
	copied := false
	for i, a := range args {
		var v any
		switch b := a.(type) {
		case bool:
			v = boolInt(b)
		case *bool: // a flag the payload may leave out: NULL
			if b != nil {
				v = boolInt(*b)
			}
		default:
			continue
		}
		if !copied { // the caller's slice stays as it was
			args, copied = slices.Clone(args), true
		}
		args[i] = v
	}
	return args
}

// boolInt is 1 for true, 0 for false.
func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// readTx begins a read-only transaction whose queries see one state of
// the database: SQLite's read transaction does, PostgreSQL's needs
// REPEATABLE READ (READ COMMITTED sees each query's own).
func (s *Store) readTx(ctx context.Context) (*sql.Tx, error) {
	opts := &sql.TxOptions{ReadOnly: true}
	if s.dialect == dialectPostgres {
		opts.Isolation = sql.LevelRepeatableRead
	}
	return s.r.BeginTx(ctx, opts)
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
//
// On PostgreSQL a statement keeps its context, whose end cancels it: a
// database that stops answering must not hold a transaction open; and
// the driver keeps its own cache of prepared statements per connection.
// What tx queued ahead (Pipeline) is sent first, in order.
func (t *Tx) exec(ctx context.Context, query string, args ...any) (sql.Result, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	args = sqlArgs(args)
	var res sql.Result
	var err error
	if t.s.dialect == dialectPostgres {
		res, err = t.tx.ExecContext(ctx, query, args...)
	} else if st := t.stmt(context.WithoutCancel(ctx), query); st != nil {
		res, err = st.ExecContext(context.WithoutCancel(ctx), args...)
	} else {
		res, err = t.tx.ExecContext(context.WithoutCancel(ctx), query, args...)
	}
	if err == nil && changes(query) {
		if n, nerr := res.RowsAffected(); nerr == nil {
			t.changed += n
		}
	}
	return res, err
}

// changes reports whether query is one whose rows affected count: SQLite
// reports, after a SAVEPOINT or a RELEASE, the last INSERT's count again.
func changes(query string) bool {
	verb, _, _ := strings.Cut(strings.TrimSpace(query), " ")
	switch strings.ToUpper(verb) {
	case "INSERT", "UPDATE", "DELETE":
		return true
	}
	return false
}

// queryRow is exec's counterpart for one-row reads inside tx; they see
// what the statements queued before them wrote.
func (t *Tx) queryRow(ctx context.Context, query string, args ...any) scanner {
	if err := t.flush(ctx); err != nil {
		return failedRow{err}
	}
	args = sqlArgs(args)
	if t.s.dialect == dialectPostgres {
		return t.tx.QueryRowContext(ctx, query, args...)
	}
	ctx = context.WithoutCancel(ctx)
	if st := t.stmt(ctx, query); st != nil {
		return st.QueryRowContext(ctx, args...)
	}
	return t.tx.QueryRowContext(ctx, query, args...)
}

// scanner is a row read: *sql.Row, or failedRow.
type scanner interface{ Scan(dest ...any) error }

// failedRow is a read that failed before it was sent.
type failedRow struct{ err error }

func (r failedRow) Scan(...any) error { return r.err }

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

// Pipeline has t send the statements execAhead and execGuess are given
// together, on PostgreSQL: they are queued, and go to the database in one
// round trip when t needs an answer (a result read, another statement, a
// read, the commit). Each statement sent alone waits a round trip and
// costs both sides a write and a read on the socket, more than most of
// them cost to run. A consumer's batch writes four statements a message,
// whose answers are known or guessed: sent so, the whole batch takes a
// round trip or two. It is for a transaction that runs without
// savepoints; on SQLite, where a statement is a function call, it changes
// nothing.
func (t *Tx) Pipeline() { t.pipelined = t.conn != nil && !t.savepoints }

// anyRows is execAhead's rows for a statement whose result says how many
// rows it changed when it is read (which sends it), rather than being
// known ahead.
const anyRows = -1

// aheadStmt is a statement queued ahead: its text, its arguments, the
// rows it is known or guessed to change (or anyRows) and its result.
type aheadStmt struct {
	pipelined
	rows  int64
	guess *aheadGuess // set: rows is its guess
	res   *aheadResult
}

// aheadResult is the result of a statement sent ahead: reading it sends
// what is queued, up to it at least.
type aheadResult struct {
	ctx  context.Context
	tx   *Tx
	rows int64
	sent bool
}

func (r *aheadResult) RowsAffected() (int64, error) {
	if !r.sent {
		if err := r.tx.flush(r.ctx); err != nil {
			return 0, err
		}
	}
	return r.rows, nil
}

func (r *aheadResult) LastInsertId() (int64, error) {
	return 0, errors.New("a statement sent ahead has no last insert id")
}

// errAheadMissed is a statement sent ahead that failed, or changed other
// rows than its caller knew or guessed it would (a duplicate delivery): what
// the transaction did after it assumed otherwise, so it is run again, one
// statement at a time and each part in its savepoint (WriteTx), as when a
// part fails.
var errAheadMissed = fmt.Errorf("%w: a statement sent ahead was answered otherwise than expected", ErrNeedSavepoints)

// execAhead is exec for a statement whose answer its caller does not need
// before the next statement: rows is how many rows it changes, known
// ahead (a count's upsert changes one), or anyRows, which the result
// tells when read. In a pipelined transaction (Pipeline) it is queued; the
// flush that sends it checks a count known ahead.
func (t *Tx) execAhead(ctx context.Context, rows int64, query string, args ...any) (sql.Result, error) {
	return t.queueAhead(ctx, rows, nil, query, args)
}

// execGuess is execAhead for a statement that changes one row nearly
// always, which g guesses: while g is not resting (aheadGuess), the
// statements after it are sent with it, as if its answer were known, and
// a miss runs the transaction again.
func (t *Tx) execGuess(ctx context.Context, g *aheadGuess, query string, args ...any) (sql.Result, error) {
	return t.queueAhead(ctx, g.rows(), g, query, args)
}

func (t *Tx) queueAhead(ctx context.Context, rows int64, g *aheadGuess, query string, args []any) (sql.Result, error) {
	if !t.pipelined {
		return t.exec(ctx, query, args...)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	res := &aheadResult{ctx: ctx, tx: t, rows: max(rows, 0), sent: rows >= 0}
	t.ahead = append(t.ahead, aheadStmt{pipelined: pipelined{query: query, args: sqlArgs(args)}, rows: rows, guess: g, res: res})
	if rows > 0 && changes(query) {
		t.changed += rows
	}
	return res, nil
}

// aheadGuess guesses that a statement changes one row, as it nearly
// always does. A guess that missed cost its batch a second run, so it
// rests for guessRest after a miss (the statement's answer is read
// instead): a setup where it misses often (several hooks for one event,
// each copy after the first; a pull request labeled over and over, whose
// row does not change) pays a second run once in that time.
type aheadGuess struct{ missed atomic.Int64 } // the last miss, Unix nanoseconds

const guessRest = time.Minute

// rows is the guess, or anyRows while it rests.
func (g *aheadGuess) rows() int64 {
	if m := g.missed.Load(); m != 0 && time.Since(time.Unix(0, m)) < guessRest {
		return anyRows
	}
	return 1
}

func (g *aheadGuess) miss() { g.missed.Store(time.Now().UnixNano()) }

// flush sends the statements queued ahead in one round trip
// (sendPipeline) and reads their answers into their results. A statement
// that fails, or changes other rows than known or guessed ahead, is
// errAheadMissed, unless the connection is lost or ctx ended; and so is
// every flush after it.
func (t *Tx) flush(ctx context.Context) error {
	if len(t.ahead) == 0 || t.aheadErr != nil {
		return t.aheadErr
	}
	ahead := t.ahead
	t.ahead = nil
	stmts := make([]pipelined, len(ahead))
	for i, st := range ahead {
		stmts[i] = st.pipelined
	}
	var rows []int64
	err := t.conn.Raw(func(dc any) (err error) {
		rows, err = sendPipeline(ctx, dc, stmts)
		return err
	})
	for i, n := range rows {
		st := ahead[i]
		switch {
		case st.rows == anyRows:
			st.res.rows, st.res.sent = n, true
			if changes(st.query) {
				t.changed += n
			}
		case n != st.rows:
			if st.guess != nil {
				st.guess.miss()
			}
			t.aheadErr = fmt.Errorf("%w: %d rows changed where %d were expected", errAheadMissed, n, st.rows)
			return t.aheadErr
		}
	}
	switch {
	case err == nil:
	case connectionLost(err) || ctx.Err() != nil:
		t.aheadErr = err // no statement's answer: nothing to run again for
	default:
		t.aheadErr = fmt.Errorf("%w: %w", errAheadMissed, err)
	}
	return t.aheadErr
}

// Savepoint runs fn inside one savepoint of tx: a failure rolls back fn's
// writes only, so one message of a batch that fails leaves the others.
// Savepoints are released before the next begins, so one name serves them
// all, and its three statements are prepared once.
//
// A savepoint costs each message two statements more (on PostgreSQL two
// round trips), and every page it changes a copy in SQLite's sub-journal,
// while a message seldom fails: a transaction first runs fn without them,
// and only when one fails does WriteTx roll the whole back and run it
// again, each fn in its savepoint (fn must be one that may run again: it
// writes only through tx).
func (t *Tx) Savepoint(ctx context.Context, fn func() error) error {
	if !t.savepoints {
		if err := fn(); err != nil {
			if errors.Is(err, errAheadMissed) {
				return err // not fn's failure: an earlier part's, or none
			}
			return &NeedSavepoints{Err: err}
		}
		return nil
	}
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

// Writable proves the database takes a write (a lock on SQLite; on
// PostgreSQL, a primary that answers, not a read-only standby), for
// /readyz.
func (s *Store) Writable(ctx context.Context) error {
	if err := s.health.refusal(); err != nil {
		return err
	}
	return s.WriteTx(ctx, func(tx *Tx) error {
		_, err := tx.tx.ExecContext(ctx, "UPDATE settings SET value = value WHERE false")
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

// Settings reads the settings rows of keys in one query; a missing row
// reads as "".
func (s *Store) Settings(ctx context.Context, keys ...string) (map[string]string, error) {
	return getSettings(ctx, s.r, keys)
}

// Settings reads the settings rows of keys inside tx.
func (t *Tx) Settings(ctx context.Context, keys ...string) (map[string]string, error) {
	return getSettings(ctx, t.tx, keys)
}

func getSettings(ctx context.Context, q queryer, keys []string) (map[string]string, error) {
	args := make([]any, len(keys))
	for i, k := range keys {
		args[i] = k
	}
	rows, err := q.QueryContext(ctx, numberParams("SELECT key, value FROM settings WHERE key IN (?"+strings.Repeat(", ?", len(keys)-1)+")"), args...)
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

func getSetting(ctx context.Context, q queryer, key string) (string, error) {
	var v string
	err := q.QueryRowContext(ctx, "SELECT value FROM settings WHERE key = $1", key).Scan(&v)
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
	_, err := t.exec(ctx, `INSERT INTO settings (key, value, updated_at) VALUES ($1, $2, $3)
		ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at`,
		key, value, formatTime(now))
	if err != nil {
		return fmt.Errorf("write setting %s: %w", key, err)
	}
	return nil
}

// numberParams numbers a query's ? placeholders $1, $2, ... in order: a
// query built from parts (a search's filters) writes ? and numbers them
// once it is whole. Every query text runs on both dialects with $N.
func numberParams(q string) string {
	var b strings.Builder
	n := 0
	for {
		i := strings.IndexByte(q, '?')
		if i < 0 {
			b.WriteString(q)
			return b.String()
		}
		n++
		b.WriteString(q[:i])
		b.WriteString("$" + strconv.Itoa(n))
		q = q[i+1:]
	}
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
	if s.dialect == dialectPostgres {
		return errors.New("backup copies an SQLite file; this database is PostgreSQL: use pg_dump, or the provider's backups")
	}
	// VACUUM INTO only reads this database (in one read transaction, so the
	// copy is consistent while serve writes), but the query_only readers
	// refuse it; the writer connection does it without taking a write lock.
	if _, err := s.w.ExecContext(ctx, "VACUUM INTO $1", dest); err != nil {
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
