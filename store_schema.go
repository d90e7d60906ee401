package main

import (
	"context"
	_ "embed"
	"fmt"
	"regexp"
	"strconv"
	"time"
)

// The schema: schema.sql's numbered migrations for SQLite,
// schema_postgres.sql's for PostgreSQL, and bringing a database up to
// date.

//go:embed schema.sql
var schemaSQL string

//go:embed schema_postgres.sql
var schemaPostgresSQL string

// migration is one "-- migration N: ..." block of a schema file.
type migration struct {
	version int
	name    string
	sql     string
}

var migrationHeader = regexp.MustCompile(`(?m)^-- migration (\d+): (.*)$`)

// parseMigrations splits a schema file into its numbered blocks, which
// count up from the first one's without gaps.
func parseMigrations(src string) ([]migration, error) {
	locs := migrationHeader.FindAllStringSubmatchIndex(src, -1)
	var ms []migration
	for i, loc := range locs {
		end := len(src)
		if i+1 < len(locs) {
			end = locs[i+1][0]
		}
		v, _ := strconv.Atoi(src[loc[2]:loc[3]])
		if i > 0 && v != ms[0].version+i {
			return nil, fmt.Errorf("migration %d out of order (want %d)", v, ms[0].version+i)
		}
		ms = append(ms, migration{version: v, name: src[loc[4]:loc[5]], sql: src[loc[1]:end]})
	}
	return ms, nil
}

// migrations are the store's dialect's migrations.
func (s *Store) migrations() ([]migration, error) {
	if s.dialect == dialectPostgres {
		return parseMigrations(schemaPostgresSQL)
	}
	return parseMigrations(schemaSQL)
}

// firstTracked is the migration that made schema_migrations, where every
// database keeps its version; SQLite kept it in PRAGMA user_version
// before it.
const firstTracked = 15

// SchemaVersion is the database's version: the greatest migration it has.
func (s *Store) SchemaVersion(ctx context.Context) (int, error) {
	return s.schemaVersion(ctx, s.r)
}

// schemaVersion reads the version through q.
func (s *Store) schemaVersion(ctx context.Context, q queryer) (int, error) {
	var tracked bool
	exists := "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
	if s.dialect == dialectPostgres {
		exists = "SELECT to_regclass('schema_migrations') IS NOT NULL"
	}
	if err := q.QueryRowContext(ctx, exists).Scan(&tracked); err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	var v int
	var err error
	switch {
	case tracked:
		err = q.QueryRowContext(ctx, "SELECT coalesce(max(version), 0) FROM schema_migrations").Scan(&v)
	case s.dialect == dialectSQLite:
		err = q.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v)
	}
	if err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	return v, nil
}

// Current checks that the database has this binary's schema version, for
// a command that writes beside serve: an older one wants migrate first, a
// newer one a newer switchyard.
func (s *Store) Current(ctx context.Context) error {
	ms, err := s.migrations()
	if err != nil {
		return err
	}
	v, err := s.SchemaVersion(ctx)
	if err != nil {
		return err
	}
	switch last := ms[len(ms)-1].version; {
	case v < last:
		return fmt.Errorf("database schema version %d is older than this binary's (%d): run switchyard migrate (or serve) first", v, last)
	case v > last:
		return fmt.Errorf("database schema version %d is newer than this binary knows (%d): upgrade switchyard", v, last)
	}
	return nil
}

// Migrate brings the schema up to date, each migration in its own
// transaction together with its schema_migrations row. Nodes that start
// at once on one PostgreSQL database migrate it once: each migration's
// transaction takes a lock, then reads the version again. It returns the
// versions before and after.
func (s *Store) Migrate(ctx context.Context) (from, to int, err error) {
	ms, err := s.migrations()
	if err != nil {
		return 0, 0, err
	}
	if from, err = s.schemaVersion(ctx, s.w); err != nil {
		return 0, 0, err
	}
	last := ms[len(ms)-1].version
	if from > last {
		return from, from, fmt.Errorf("database schema version %d is newer than this binary knows (%d): upgrade switchyard", from, last)
	}
	to = from
	applied := map[int]string{} // this run's versions, and when
	for _, m := range ms {
		if m.version <= to {
			continue
		}
		err := s.WriteTx(ctx, func(tx *Tx) error {
			if err := tx.Lock(ctx, "migrate"); err != nil {
				return err
			}
			if v, err := s.schemaVersion(ctx, tx.tx); err != nil || v >= m.version {
				return err // another node applied it
			}
			if _, err := tx.tx.ExecContext(ctx, m.sql); err != nil {
				return err
			}
			now := formatTime(time.Now())
			applied[m.version] = now
			if s.dialect == dialectSQLite {
				if _, err := tx.tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", m.version)); err != nil {
					return err
				}
			}
			if m.version < firstTracked {
				return nil
			}
			// The row of each version this table was not there to take.
			for _, e := range ms {
				if e.version > m.version || (e.version < m.version && m.version != firstTracked) {
					continue
				}
				var at any
				if t, ok := applied[e.version]; ok {
					at = t
				}
				if _, err := tx.exec(ctx, `INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)
					ON CONFLICT (version) DO NOTHING`, e.version, e.name, at); err != nil {
					return err
				}
			}
			return nil
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
