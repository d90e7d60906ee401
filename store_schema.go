package main

import (
	"context"
	_ "embed"
	"fmt"
	"regexp"
	"strconv"
)

// The schema: schema.sql's numbered migrations, and bringing a database up
// to date.

//go:embed schema.sql
var schemaSQL string

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
		err := s.WriteTx(ctx, func(tx *Tx) error {
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
