package main

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"time"
)

// Bringing a database up to date: the numbered migrations its engine
// holds (engine.schema: schema.sql for SQLite, schema_postgres.sql for
// PostgreSQL), each with its floor.

// migration is one "-- migration N: ..." block of a schema file, and its
// floor: the oldest schema version whose binaries work with it.
type migration struct {
	version int
	name    string
	sql     string
	floor   int
}

var (
	migrationHeader = regexp.MustCompile(`(?m)^-- migration (\d+): (.*)$`)
	migrationFloor  = regexp.MustCompile(`(?m)^-- floor: (\d+)$`)
)

// firstFloored is the migration that made schema_migrations.floor. Before
// it a migration's floor is its own version (the binaries of those
// versions refuse any newer database); from it on, a migration's "--
// floor: N" line, or else the floor of the one before it.
const firstFloored = 19

// parseMigrations splits a schema file into its numbered blocks, which
// count up from the first one's without gaps, each with its floor.
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
		m := migration{version: v, name: src[loc[4]:loc[5]], sql: src[loc[1]:end], floor: v}
		if f := migrationFloor.FindStringSubmatch(m.sql); f != nil {
			m.floor, _ = strconv.Atoi(f[1])
		} else if v > firstFloored {
			m.floor = ms[i-1].floor
		}
		if m.floor > v {
			return nil, fmt.Errorf("migration %d: floor %d above its own version", v, m.floor)
		}
		ms = append(ms, m)
	}
	return ms, nil
}

// Version is this binary's schema version: its last migration.
func (s *Store) Version() int {
	ms, err := s.migrations()
	if err != nil || len(ms) == 0 {
		return 0
	}
	return ms[len(ms)-1].version
}

// SchemaFloor is the database's floor: the oldest schema version whose
// binaries work with it.
func (s *Store) SchemaFloor(ctx context.Context) (int, error) {
	var f int
	if err := (poolReader{s.w}).row(ctx, "SELECT coalesce(max(coalesce(floor, version)), 0) FROM schema_migrations").Scan(&f); err != nil {
		return 0, fmt.Errorf("read the schema floor: %w", err)
	}
	return f, nil
}

// newerServed checks a database of version v, newer than this binary's
// last migration: its floor must be at most that version.
func (s *Store) newerServed(ctx context.Context, v, last int) error {
	floor, err := s.SchemaFloor(ctx)
	if err != nil {
		return err
	}
	if floor > last {
		return fmt.Errorf("database schema version %d works with switchyard of schema version %d or later (its floor); this binary's is %d: %w",
			v, floor, last, ErrSchemaFloor)
	}
	return nil
}

// CheckFloor fails with ErrSchemaFloor once another node's migration has
// raised the database's floor above this binary's version: this node
// must stop writing to it.
func (s *Store) CheckFloor(ctx context.Context) error {
	last := s.Version()
	floor, err := s.SchemaFloor(ctx)
	if err != nil {
		return err
	}
	if floor > last {
		return fmt.Errorf("database schema floor %d is above this binary's schema version %d: %w", floor, last, ErrSchemaFloor)
	}
	return nil
}

// migrations are the store's database's migrations (engine.schema).
func (s *Store) migrations() ([]migration, error) {
	return parseMigrations(s.engine.schema())
}

// firstTracked is the migration that made schema_migrations, where every
// database keeps its version; SQLite kept it in PRAGMA user_version
// before it.
const firstTracked = 15

// SchemaVersion is the database's version: the greatest migration it has.
func (s *Store) SchemaVersion(ctx context.Context) (int, error) {
	return s.schemaVersion(ctx, s.pool())
}

// schemaVersion reads the version through q.
func (s *Store) schemaVersion(ctx context.Context, q dbReader) (int, error) {
	var tracked bool
	if err := q.row(ctx, s.engine.tracked()).Scan(&tracked); err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	var v int
	var err error
	if tracked {
		err = q.row(ctx, "SELECT coalesce(max(version), 0) FROM schema_migrations").Scan(&v)
	} else {
		v, err = s.engine.legacyVersion(ctx, q)
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
		return s.newerServed(ctx, v, last)
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
	if from, err = s.schemaVersion(ctx, poolReader{s.w}); err != nil {
		return 0, 0, err
	}
	last := ms[len(ms)-1].version
	if from > last {
		// A rolling upgrade: a newer node migrated; this one serves on
		// while the database's floor allows it.
		return from, from, s.newerServed(ctx, from, last)
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
			if v, err := s.schemaVersion(ctx, tx); err != nil || v >= m.version {
				return err // another node applied it
			}
			if _, err := tx.raw().ExecContext(ctx, m.sql); err != nil {
				return err
			}
			now := formatTime(time.Now())
			applied[m.version] = now
			if err := s.engine.migrated(ctx, tx.raw(), m.version); err != nil {
				return err
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
				var err error
				if m.version >= firstFloored {
					_, err = tx.write(ctx, atOnce, `INSERT INTO schema_migrations (version, name, applied_at, floor) VALUES ($1, $2, $3, $4)
						ON CONFLICT (version) DO NOTHING`, e.version, e.name, at, e.floor)
				} else {
					_, err = tx.write(ctx, atOnce, `INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)
						ON CONFLICT (version) DO NOTHING`, e.version, e.name, at)
				}
				if err != nil {
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
	// A database lost for its floor is found again only once the floor
	// allows this binary.
	s.health.require(s.CheckFloor)
	return from, to, nil
}
