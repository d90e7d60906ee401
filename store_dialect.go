package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// The two databases the store is kept in: SQLite, embedded, the default;
// and PostgreSQL, which several nodes share. One query text serves both
// where they agree ($N placeholders, ON CONFLICT, RETURNING); what
// differs is here, each dialect's text beside the other's.

// dialect is which database a Store speaks to.
type dialect int

const (
	dialectSQLite dialect = iota
	dialectPostgres
)

func (d dialect) String() string {
	if d == dialectPostgres {
		return "postgres"
	}
	return "sqlite"
}

// clock is the database's clock ms milliseconds from now (a parameter, or a
// number), as a time in timeFormat: leases are timed by the database, so
// that nodes whose clocks differ agree on when one expires.
func (d dialect) clock(ms string) string {
	ms = "CAST(" + ms + " AS BIGINT)"
	if d == dialectPostgres {
		return `to_char((clock_timestamp() + ` + ms + ` * interval '1 millisecond') AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`
	}
	// %f is seconds with three fraction digits; timeFormat has six.
	return `strftime('%Y-%m-%dT%H:%M:%f', 'now', (` + ms + ` / 1000.0) || ' seconds') || '000Z'`
}

// openPostgres opens a pool of at most cfg.MaxConns connections to the
// PostgreSQL database at cfg.URL, and checks that it answers.
func openPostgres(ctx context.Context, cfg DatabaseConfig) (*sql.DB, error) {
	cc, err := pgx.ParseConfig(cfg.URL)
	if err != nil {
		var pe *pgconn.ParseConfigError
		if errors.As(err, &pe) {
			return nil, fmt.Errorf("database.url: %v", pe.Unwrap())
		}
		return nil, errors.New("database.url: not a PostgreSQL URL")
	}
	if cc.ConnectTimeout == 0 {
		cc.ConnectTimeout = 10 * time.Second
	}
	db := stdlib.OpenDB(*cc)
	db.SetMaxOpenConns(cfg.MaxConns)
	db.SetMaxIdleConns(cfg.MaxConns)
	// A connection is closed after a while, so that a database that
	// failed over is found again by every connection.
	db.SetConnMaxLifetime(30 * time.Minute)
	pctx, cancel := context.WithTimeout(ctx, cc.ConnectTimeout)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("database %s: %w", redactDatabaseURL(cfg.URL), err)
	}
	return db, nil
}

// connectionLost reports whether err is the connection to PostgreSQL
// failing (refused, dropped, reset, closed under a statement), not a
// statement the database refused nor a failure of the caller's own: a
// node that loses the database stops consuming, while a statement's
// error is the message's own failure.
func connectionLost(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// Class 08 is a connection exception; 57P01-57P03 the server
		// shutting down or not accepting connections yet.
		return strings.HasPrefix(pgErr.Code, "08") || pgErr.Code == "57P01" || pgErr.Code == "57P02" || pgErr.Code == "57P03"
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	return errors.As(err, &ce) || errors.As(err, &ne) || errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone)
}

// pipelined is a statement sent in a pipeline: its text and arguments.
type pipelined struct {
	query string
	args  []any
}

// sendPipeline sends stmts on the pgx connection dc in one round trip (a
// pipeline that one Sync ends) and reads their answers in order: the rows
// each changed, up to the first that failed, and that one's failure.
func sendPipeline(ctx context.Context, dc any, stmts []pipelined) (rows []int64, err error) {
	conn, ok := dc.(*stdlib.Conn)
	if !ok {
		return nil, fmt.Errorf("send a pipeline: not a pgx connection: %T", dc)
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
			return rows, errors.Join(err, results.Close())
		}
		rows = append(rows, tag.RowsAffected())
	}
	return rows, results.Close()
}
