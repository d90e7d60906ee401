package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// The PostgreSQL engine: one pool of at most database.max_conns
// connections that several nodes share the database through, statements
// sent ahead of their answers in one round trip, transaction-level
// advisory locks.

// postgresEngine is the store's engine on a PostgreSQL database: maxConns
// is database.max_conns, the pool's idle connections while it answers.
type postgresEngine struct {
	maxConns int
	pooler   *poolerFound
}

// poolerFound is whether a pooler in transaction mode (PgBouncer) was
// found in front of the database: a statement's "prepared statement ...
// already exists" (42P05) or "does not exist" (26000) says that the
// pooler gave the connection's server to another client, with the
// statements prepared on it. Found, every connection dialed after it runs
// its statements unprepared (pgx's exec mode, what the URL's
// default_query_exec_mode=exec asks for), and the pool's idle connections
// are dropped: a node whose URL lacks the option stores on, slower by a
// round trip per statement, and says so.
type poolerFound struct {
	db       *sql.DB
	maxConns int
	warn     func(msg string, args ...any)
	at       atomic.Pointer[time.Time]
}

// found records the pooler, once: the connections to come run unprepared.
func (p *poolerFound) found(err error) {
	now := time.Now().UTC()
	if !p.at.CompareAndSwap(nil, &now) {
		return
	}
	p.db.SetMaxIdleConns(0) // the connections that prepared go as they come back
	p.db.SetMaxIdleConns(p.maxConns)
	p.warn("a pooler in transaction mode is in front of the database: statements now run unprepared; "+
		"add default_query_exec_mode=exec to database.url to start so", "error", err)
}

// since is when the pooler was found; nil before.
func (p *poolerFound) since() *time.Time { return p.at.Load() }

// preparedClash reports whether err is a prepared statement that already
// exists or does not (42P05, 26000): a pooler in transaction mode.
func preparedClash(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42P05" || pgErr.Code == "26000")
}

// openPostgres opens a pool of at most cfg.MaxConns connections to the
// PostgreSQL database at cfg.URL, and checks that it answers.
func openPostgres(ctx context.Context, cfg DatabaseConfig, tracer Tracer) (*sql.DB, postgresEngine, error) {
	cc, err := pgx.ParseConfig(cfg.URL)
	if err != nil {
		var pe *pgconn.ParseConfigError
		if errors.As(err, &pe) {
			return nil, postgresEngine{}, fmt.Errorf("database.url: %v", pe.Unwrap())
		}
		return nil, postgresEngine{}, errors.New("database.url: not a PostgreSQL URL")
	}
	if cc.ConnectTimeout == 0 {
		cc.ConnectTimeout = 10 * time.Second
	}
	// A primary that dies without a word (a host gone, a partition) is
	// noticed within deadPeer: keepalive probes on an idle connection,
	// TCP_USER_TIMEOUT on one whose writes go unanswered. Every host of a
	// multi-host URL is dialed so; target_session_attrs=read-write picks
	// the writable one, as pgx reads it.
	d := &net.Dialer{KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3},
		Control: userTimeout(deadPeer)}
	cc.DialFunc = d.DialContext
	cc.Tracer = tracer.pgx()
	pooler := &poolerFound{maxConns: cfg.MaxConns, warn: func(string, ...any) {}}
	db := stdlib.OpenDB(*cc, stdlib.OptionBeforeConnect(func(_ context.Context, c *pgx.ConnConfig) error {
		if pooler.since() != nil {
			c.DefaultQueryExecMode = pgx.QueryExecModeExec
		}
		return nil
	}))
	pooler.db = db
	db.SetMaxOpenConns(cfg.MaxConns)
	db.SetMaxIdleConns(cfg.MaxConns)
	// A connection is closed after a while, so that a database that
	// failed over is found again by every connection.
	db.SetConnMaxLifetime(30 * time.Minute)
	pctx, cancel := context.WithTimeout(ctx, cc.ConnectTimeout)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		db.Close()
		return nil, postgresEngine{}, fmt.Errorf("database %s: %w", redactDatabaseURL(cfg.URL), err)
	}
	return db, postgresEngine{maxConns: cfg.MaxConns, pooler: pooler}, nil
}

// deadPeer is how long a connection to a silent database lives: the
// keepalive probes (5 s idle, then 3 every 2 s) and TCP_USER_TIMEOUT end
// it within this.
const deadPeer = 15 * time.Second

// userTimeout sets TCP_USER_TIMEOUT on a socket before it connects: data
// unacknowledged for d ends the connection.
func userTimeout(d time.Duration) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, unix_TCP_USER_TIMEOUT, int(d.Milliseconds()))
		})
		return errors.Join(err, serr)
	}
}

// unix_TCP_USER_TIMEOUT is Linux's TCP_USER_TIMEOUT socket option
// (linux/tcp.h), which package syscall does not name.
const unix_TCP_USER_TIMEOUT = 0x12

func (postgresEngine) driver() string { return "postgres" }
func (postgresEngine) shared() bool   { return true }

// readOptions: READ COMMITTED sees each query's own state, REPEATABLE
// READ one for the whole transaction.
func (postgresEngine) readOptions() *sql.TxOptions {
	return &sql.TxOptions{ReadOnly: true, Isolation: sql.LevelRepeatableRead}
}

// begin opens a write transaction on a connection of its own, which
// statements queued ahead are sent on. The pool's connections are many:
// no write waits on another's turn, first or not.
func (postgresEngine) begin(ctx context.Context, w *sql.DB, _ bool) (*txConn, error) {
	conn, err := w.Conn(ctx)
	if err != nil {
		return nil, err
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		conn.Close()
		return nil, err
	}
	return &txConn{tx: tx, conn: conn}, nil
}

func (postgresEngine) end(tc *txConn) { tc.conn.Close() }

// exec runs one statement, which keeps its context: a database that
// stops answering must not hold a transaction open. The driver keeps its
// own cache of prepared statements per connection.
func (postgresEngine) exec(ctx context.Context, tc *txConn, query string, args []any) (sql.Result, error) {
	return tc.tx.ExecContext(ctx, query, args...)
}

func (postgresEngine) queryRow(ctx context.Context, tc *txConn, query string, args []any) *sql.Row {
	return tc.tx.QueryRowContext(ctx, query, args...)
}

func (postgresEngine) pipelines() bool { return true }

// sendAhead sends stmts on tc's connection in one round trip (a pipeline
// that one Sync ends) and reads their answers in order: the rows each
// changed, up to the first that failed, and that one's failure.
func (postgresEngine) sendAhead(ctx context.Context, tc *txConn, stmts []pipelined) (rows []int64, err error) {
	err = tc.conn.Raw(func(dc any) error {
		conn, ok := dc.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("send a pipeline: not a pgx connection: %T", dc)
		}
		var b pgx.Batch
		for _, st := range stmts {
			b.Queue(st.query, st.args...)
		}
		results := conn.Conn().SendBatch(ctx, &b)
		rows = make([]int64, 0, len(stmts))
		for range stmts {
			tag, err := results.Exec()
			if err != nil {
				return errors.Join(err, results.Close())
			}
			rows = append(rows, tag.RowsAffected())
		}
		return results.Close()
	})
	return rows, err
}

// lost reports whether err is the connection to PostgreSQL failing
// (refused, dropped, reset, closed under a statement), not a statement
// the database refused nor a failure of the caller's own: a node that
// loses the database stops consuming, while a statement's error is the
// message's own failure.
func (e postgresEngine) lost(err error) bool {
	if preparedClash(err) {
		e.pooler.found(err)
	}
	return connectionLost(err)
}

// ping asks for a connection that takes writes: SELECT 1 answers on a
// standby too.
func (postgresEngine) ping(ctx context.Context, w *sql.DB) error {
	var ro string
	if err := w.QueryRowContext(ctx, "SHOW transaction_read_only").Scan(&ro); err != nil {
		return err
	}
	if ro != "off" {
		return errors.New("the database is read-only")
	}
	return nil
}

// idle drops the pool's idle connections (keep false: each later one is
// dialed anew, to the host that takes writes now), or keeps them again.
func (e postgresEngine) idle(w *sql.DB, keep bool) {
	if keep {
		w.SetMaxIdleConns(e.maxConns)
	} else {
		w.SetMaxIdleConns(0)
	}
}

func connectionLost(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57P01", "57P02", "57P03":
			// The server shutting down, or not accepting connections yet.
			return true
		case "25006":
			// A read-only server: a primary demoted, or turned read-only
			// without closing its connections, or a standby reached.
			return true
		case "42P05", "26000":
			// A prepared statement that already exists or does not: a
			// pooler in transaction mode gave the connection's statements
			// to another (README: default_query_exec_mode). No fault of
			// the message's.
			return true
		}
		// Class 08 is a connection exception.
		return strings.HasPrefix(pgErr.Code, "08")
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	return errors.As(err, &ce) || errors.As(err, &ne) || errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone)
}

// lock is a transaction-level advisory lock, which a pooler in
// transaction mode keeps and a dropped connection releases with the
// transaction; never a session lock.
func (e postgresEngine) lock(ctx context.Context, tc *txConn, key string) error {
	_, err := e.exec(ctx, tc, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", []any{"switchyard:" + key})
	return err
}

func (postgresEngine) lockShared() string { return " FOR SHARE" }

// holdFor sets idle_in_transaction_session_timeout for the transaction
// alone: a node paused inside it (SIGSTOP, a frozen VM) has its session
// ended past d, its locks with it, and another node takes its lease.
func (e postgresEngine) holdFor(ctx context.Context, tc *txConn, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	_, err := e.exec(ctx, tc, fmt.Sprintf("SET LOCAL idle_in_transaction_session_timeout = %d", max(d.Milliseconds(), 1)), nil)
	return err
}

func (postgresEngine) clock(ms string) string {
	return `to_char((clock_timestamp() + CAST(` + ms + ` AS BIGINT) * interval '1 millisecond') AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`
}

func (postgresEngine) schema() string { return schemaPostgresSQL }

// tracked reads pg_tables, not to_regclass: to_regclass looks in the
// backend's catalog cache, which, just after the migration lock was
// granted, may not have taken in the node's commit that released it
// (seen: a second node found no schema_migrations there and ran the
// first migration again). A query on pg_tables reads the catalog as its
// snapshot does.
func (postgresEngine) tracked() string {
	return "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = current_schema() AND tablename = 'schema_migrations')"
}

// legacyVersion: a PostgreSQL database kept schema_migrations from its
// first migration; without it, it has none.
func (postgresEngine) legacyVersion(context.Context, dbReader) (int, error) { return 0, nil }
func (postgresEngine) migrated(context.Context, *sql.Tx, int) error         { return nil }

func (postgresEngine) tablesQuery() string {
	return "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' ORDER BY table_name"
}

func (postgresEngine) size(ctx context.Context, q dbReader) (int64, error) {
	var n int64
	if err := q.row(ctx, "SELECT pg_database_size(current_database())").Scan(&n); err != nil {
		return 0, fmt.Errorf("database size: %w", err)
	}
	return n, nil
}

// claim: nodes share a PostgreSQL database, nothing to take.
func (postgresEngine) claim(context.Context, *sql.DB) (io.Closer, error) { return nil, nil }

// afterCopy makes table's identity column, if it has one, go on after the
// greatest id copied, so that the next row a node writes takes a new one.
func (postgresEngine) afterCopy(ctx context.Context, tx *sql.Tx, table string) error {
	var seq sql.NullString
	err := tx.QueryRowContext(ctx, `SELECT pg_get_serial_sequence(table_name, column_name) FROM information_schema.columns
		WHERE table_schema = current_schema() AND table_name = $1 AND column_name = 'id' AND is_identity = 'YES'`, table).Scan(&seq)
	if errors.Is(err, sql.ErrNoRows) || err == nil && !seq.Valid {
		return nil // no identity
	}
	if err != nil {
		return fmt.Errorf("identity of %s: %w", table, err)
	}
	if _, err := tx.ExecContext(ctx, "SELECT setval($1, (SELECT max(id) FROM "+table+"))", seq.String); err != nil {
		return fmt.Errorf("identity of %s: %w", table, err)
	}
	return nil
}

func (postgresEngine) backup(context.Context, *sql.DB, string) error {
	return errors.New("backup copies an SQLite file; this database is PostgreSQL: use pg_dump, or the provider's backups")
}

func (postgresEngine) close() {}

func (e postgresEngine) unprepared() *time.Time { return e.pooler.since() }

// schemaPostgresSQL is PostgreSQL's schema, as its numbered migrations:
// the same tables as schema.sql's, in its dialect, with a history of its
// own.
//
//go:embed schema_postgres.sql
var schemaPostgresSQL string
