package main

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	_ "modernc.org/sqlite"
)

// Store is switchyard's database: an SQLite file (the default), or a
// PostgreSQL database that several nodes share, each through its engine
// (store_engine.go).
//
// SQLite has one writer connection, so writes queue in Go instead of
// contending for the file lock, and a small pool of read-only connections
// for the API and health checks. PostgreSQL has one pool of at most
// database.max_conns connections for both.
type Store struct {
	w      *sql.DB
	r      *sql.DB
	engine engine
	path   string // the SQLite file; "" on PostgreSQL
	// name says which database this is, without secrets: the file, or
	// the URL without its password.
	name    string
	metrics *Metrics
	tracer  Tracer
	// gapsOpen is whether delivery_gaps may hold an open gap: storing an
	// Event resolves its gap only then (see resolveGap). Migrate counts
	// them, RecordGap and the hooks poll keep it true.
	gapsOpen atomic.Bool
	// health follows the connection to PostgreSQL (store_health.go).
	health *dbHealth
	// claim holds the SQLite file's lock while serve runs (Claim).
	claim io.Closer
	// guesses are the answers a consumer's statements nearly always get,
	// sent ahead as if known (guessed): a delivery's first copy
	// stored, a worker's mark new, an order-safe row written.
	guesses struct{ firstCopy, mark, row aheadGuess }
}

// OpenStore opens the database cfg names: the SQLite file at cfg.Path
// (created when needed) with the pragmas set on every connection, or the
// PostgreSQL database at cfg.URL. metrics may be nil (the commands that
// record none). Its transactions are not traced (OpenTracedStore).
func OpenStore(ctx context.Context, cfg DatabaseConfig, metrics *Metrics) (*Store, error) {
	return OpenTracedStore(ctx, cfg, metrics, noop.NewTracerProvider())
}

// OpenTracedStore is OpenStore whose transactions, and PostgreSQL's
// statements, are spans of tp when they run in a trace (a message's batch).
func OpenTracedStore(ctx context.Context, cfg DatabaseConfig, metrics *Metrics, tp trace.TracerProvider) (*Store, error) {
	s := &Store{metrics: metrics, tracer: NewTracer(tp)}
	if cfg.Driver == "postgres" {
		db, e, err := openPostgres(ctx, cfg, s.tracer)
		if err != nil {
			return nil, err
		}
		s.w, s.r, s.engine, s.name = db, db, e, redactDatabaseURL(cfg.URL)
	} else {
		w, r, e, err := openSQLite(ctx, cfg)
		if err != nil {
			return nil, err
		}
		s.w, s.r, s.engine, s.path, s.name = w, r, e, cfg.Path, cfg.Path
	}
	s.health = newDBHealth(s.engine, s.w)
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

// LogTo has the store say to log what it finds of the database while it
// runs (a pooler in transaction mode in front of PostgreSQL).
func (s *Store) LogTo(log *slog.Logger) {
	if pg, ok := s.engine.(postgresEngine); ok {
		pg.pooler.warn = log.With("database", s.name).Warn
	}
}

// Name says which database the store is, without secrets.
func (s *Store) Name() string { return s.name }

// Shared reports whether several nodes may share the database: PostgreSQL.
func (s *Store) Shared() bool { return s.engine.shared() }

// Driver is the database.driver the store was opened with.
func (s *Store) Driver() string { return s.engine.driver() }

// Close closes the pools once the prober of a lost database has ended;
// SQLite's WAL is checkpointed by the last connection.
func (s *Store) Close() error {
	s.health.close()
	s.engine.close()
	var err error
	if s.r == s.w {
		err = s.w.Close()
	} else {
		err = errors.Join(s.r.Close(), s.w.Close())
	}
	if s.claim != nil {
		s.claim.Close() // last: see sqliteEngine.claim
	}
	return err
}

// Tx is one write transaction: every write is a method of Tx, opened by
// WriteTx (or WriteTxUnder), and passed along as a value, never in a
// context. No network I/O while one is open. It writes one way (write)
// and reads as a dbReader (row, rows); raw is for migrations and copy-db.
type Tx struct {
	s  *Store
	tc *txConn
	// changed counts the rows its statements changed (Changed).
	changed int64
	// pipelined: statements whose answers can wait are queued in ahead,
	// to send together (Pipeline).
	pipelined bool
	// guesses: a guessed statement is sent as if its guess were its
	// answer (a RerunRerunBatch's first run).
	guesses  bool
	ahead    []aheadStmt
	aheadErr error // the failure of a flush: every later one's
}

// Changed is how many rows tx's statements have inserted, updated or
// deleted so far, what was queued ahead sent first: reprocess tells a
// delivery that changed nothing from one that did.
func (t *Tx) Changed(ctx context.Context) (int64, error) {
	err := t.flush(ctx)
	return t.changed, err
}

// WriteTx runs fn once in one write transaction and commits, or rolls
// back when fn fails: one fsync covers every message fn handles, in order.
// Statements fn queued ahead (Pipeline) are sent before the commit; one
// answered otherwise fails the transaction. A batch of parts is
// WriteRerunBatch's. A failure of the connection to PostgreSQL is
// ErrDatabaseLost (Lost).
func (s *Store) WriteTx(ctx context.Context, fn func(tx *Tx) error) error {
	return s.writeTx(ctx, nil, false, fn)
}

// WriteTxFirst is WriteTx for a write a client waits on (the outbox's
// commit, before a 202): on SQLite, whose one writer connection the
// writes take in turn, it goes before every write waiting that is not
// one (writerTurns).
func (s *Store) WriteTxFirst(ctx context.Context, fn func(tx *Tx) error) error {
	return s.writeTx(ctx, nil, true, fn)
}

// WriteTxUnder is WriteTx for a once-only job's write, made under f (its
// lease's holding, from Lease.Run: never from its context).
func (s *Store) WriteTxUnder(ctx context.Context, f Fence, fn func(tx *Tx) error) error {
	return s.writeTx(ctx, &f, false, fn)
}

// writeTx runs fn in one write transaction, under fence when it is set,
// before the other writes waiting when first.
func (s *Store) writeTx(ctx context.Context, fence *Fence, first bool, fn func(tx *Tx) error) error {
	start := time.Now()
	defer func() { s.metrics.dbWrite(time.Since(start)) }()
	ctx, span := s.tracer.startTransaction(ctx, s.engine.driver())
	err := s.runTx(ctx, fence, first, fn)
	endSpan(span, err)
	return err
}

// runTx is writeTx's transaction.
func (s *Store) runTx(ctx context.Context, fence *Fence, first bool, fn func(tx *Tx) error) error {
	t, err := s.begin(ctx, first)
	if err != nil {
		return s.health.observe(fmt.Errorf("begin: %w", err))
	}
	err = t.fence(ctx, fence)
	if err == nil {
		err = fn(t)
	}
	if err == nil {
		err = t.flush(ctx)
	}
	if err != nil {
		t.end(t.tc.tx.Rollback())
		return s.health.observe(err)
	}
	if err := t.end(t.tc.tx.Commit()); err != nil {
		return s.health.observe(fmt.Errorf("commit: %w", err))
	}
	return nil
}

// Fence is the holding of a lease a once-only job's writes are made under
// (WriteTxUnder): unless node holds job's lease in that term when the
// transaction begins, it fails with ErrStaleLease, changing nothing; on
// PostgreSQL the lease's row stays locked shared, so a takeover waits.
type Fence struct {
	Job, Node string
	Term      int64
	// Hold bounds how long the lock may wait on a holder paused inside
	// the transaction (a frozen VM): past it the database ends the
	// transaction, so that a takeover is not held back (engine.holdFor).
	Hold time.Duration
}

// ErrStaleLease is a write of a job whose lease another node took since.
var ErrStaleLease = errors.New("the lease was taken by another node")

// fence checks f, when set, in t.
func (t *Tx) fence(ctx context.Context, f *Fence) error {
	if f == nil {
		return nil
	}
	if err := t.s.engine.holdFor(ctx, t.tc, f.Hold); err != nil {
		return err
	}
	var term int64
	err := t.row(ctx, "SELECT term FROM leases WHERE job = $1 AND node = $2 AND term = $3"+t.s.engine.lockShared(),
		f.Job, f.Node, f.Term).Scan(&term)
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("%w: job %s, term %d of node %s", ErrStaleLease, f.Job, f.Term, f.Node)
	}
	return err
}

// begin opens a write transaction (engine.begin).
func (s *Store) begin(ctx context.Context, first bool) (*Tx, error) {
	tc, err := s.engine.begin(ctx, s.w, first)
	if err != nil {
		return nil, err
	}
	return &Tx{s: s, tc: tc}, nil
}

// end gives t's connection back to the pool once its transaction has
// ended with err, and returns err.
func (t *Tx) end(err error) error {
	t.s.engine.end(t.tc)
	return err
}

// raw is t's transaction itself, for migrations and copy-db: no statement
// cache, nothing queued ahead sent first, no rows counted.
func (t *Tx) raw() *sql.Tx { return t.tc.tx }

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

// expect is what a write's caller knows of its answer before it reads
// it: nothing (atOnce: the statement is sent now), or, in a pipelined
// transaction (Pipeline), that it can wait: the rows it changes known
// ahead, or guessed.
type expect struct {
	ahead bool
	rows  int64
	guess *aheadGuess
}

// atOnce is a write whose answer its caller reads at once.
var atOnce = expect{}

// ahead is a write whose answer its caller does not need before the next
// statement: rows is how many rows it changes, known ahead (a count's
// upsert changes one), or anyRows, which the result tells when read. The
// flush that sends it checks a count known ahead.
func ahead(rows int64) expect { return expect{ahead: true, rows: rows} }

// guessed is ahead for a statement that changes one row nearly always,
// which g guesses: in a RerunRerunBatch's first run, while g is not resting
// (aheadGuess), the statements after it are sent with it, as if its
// answer were known, and a miss writes the batch again (WriteRerunBatch).
// Elsewhere its answer is read when asked for (anyRows).
func guessed(g *aheadGuess) expect { return expect{ahead: true, rows: g.rows(), guess: g} }

// write is the one way a transaction writes: one statement, sent now
// (after what was queued ahead, in order), or queued ahead of its answer
// in a pipelined transaction (e). On SQLite it runs prepared, on
// PostgreSQL with its context (engine.exec).
func (t *Tx) write(ctx context.Context, e expect, query string, args ...any) (sql.Result, error) {
	if e.ahead && t.pipelined {
		if e.guess != nil && !t.guesses {
			e.rows = anyRows
		}
		return t.queueAhead(ctx, e, query, args)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	res, err := t.s.engine.exec(ctx, t.tc, query, sqlArgs(args))
	if err != nil {
		// The database lost under a statement is no fault of its
		// caller's: the whole transaction fails so (ErrDatabaseLost).
		return res, t.s.health.observe(err)
	}
	if changes(query) {
		if n, nerr := res.RowsAffected(); nerr == nil {
			t.changed += n
		}
	}
	return res, err
}

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

// Pipeline has t send the statements written ahead of their answers
// (ahead, guessed) together, on PostgreSQL: they are queued, and go to the database in one
// round trip when t needs an answer (a result read, another statement, a
// read, the commit). Each statement sent alone waits a round trip and
// costs both sides a write and a read on the socket, more than most of
// them cost to run. A consumer's batch writes four statements a message,
// whose answers are known or guessed: sent so, the whole batch takes a
// round trip or two (WriteRerunBatch pipelines its first run). On SQLite,
// where a statement is a function call, it changes nothing.
func (t *Tx) Pipeline() { t.pipelined = t.s.engine.pipelines() }

// anyRows is ahead's rows for a statement whose result says how many
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
// rows than its caller knew or guessed it would (a duplicate delivery):
// what the transaction did after it assumed otherwise, so it fails (and a
// RerunBatch's first run is written again: WriteRerunBatch).
var errAheadMissed = errors.New("a statement sent ahead was answered otherwise than expected")

func (t *Tx) queueAhead(ctx context.Context, e expect, query string, args []any) (sql.Result, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	rows := e.rows
	res := &aheadResult{ctx: ctx, tx: t, rows: max(rows, 0), sent: rows >= 0}
	t.ahead = append(t.ahead, aheadStmt{pipelined: pipelined{query: query, args: sqlArgs(args)}, rows: rows, guess: e.guess, res: res})
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
// (engine.sendAhead) and reads their answers into their results. A statement
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
	rows, err := t.s.engine.sendAhead(ctx, t.tc, stmts)
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
	case t.s.engine.lost(err) || ctx.Err() != nil:
		t.aheadErr = t.s.health.observe(err) // no statement's answer: nothing to run again for
	default:
		t.aheadErr = fmt.Errorf("%w: %w", errAheadMissed, err)
	}
	return t.aheadErr
}

// Writable proves the database takes a write (a lock on SQLite; on
// PostgreSQL, a primary that answers, not a read-only standby), for
// /readyz.
func (s *Store) Writable(ctx context.Context) error {
	if err := s.health.refusal(); err != nil {
		return err
	}
	if down, _, cause := s.health.Down(); down {
		return fmt.Errorf("%w: %w", ErrDatabaseLost, cause) // until the prober finds it answering
	}
	return s.WriteTx(ctx, func(tx *Tx) error {
		_, err := tx.write(ctx, atOnce, "UPDATE settings SET value = value WHERE false")
		return err
	})
}

// numberParams numbers a query's ? placeholders $1, $2, ... in order: a
// query built from parts (a search's filters) writes ? and numbers them
// once it is whole. Every query text runs on both databases with $N.
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

// nullText stores "" as NULL.
func nullText(v string) any {
	if v == "" {
		return nil
	}
	return v
}

// nullInt stores 0 as NULL: GitHub ids are never 0, so 0 means "not given".
func nullInt(v int64) any {
	if v == 0 {
		return nil
	}
	return v
}

// Backup writes a consistent snapshot of the live database to dest
// (engine.backup): SQLite's VACUUM INTO, checked.
func (s *Store) Backup(ctx context.Context, dest string) error {
	return s.engine.backup(ctx, s.w, dest)
}
