package main

import (
	"context"
	"errors"
	"fmt"
)

// RerunBatch is a batch of parts (a consumed message each) that
// WriteRerunBatch writes in one transaction, one fsync for all: a part that
// fails undoes its own writes only. Its name says what it does: it is the
// one place a batch is written twice, and a part (RerunPart) may run
// twice. The first run sends its statements ahead of their answers,
// guessing the answers they nearly always get, without a savepoint a part;
// when a guess missed or a part failed, that run is rolled back and the
// batch written once more, in a second transaction, each part in a
// savepoint of its own, the failed part skipped (its handler ran once).
// A part writes only through its tx; what it keeps of a run (a verdict,
// what it found) it overwrites in the next.
type RerunBatch struct {
	// Parts is how many parts the batch has.
	Parts int
	// Part writes part i in tx: an error is part i's failure.
	Part RerunPart
	// Last, when set, writes after every part in each run, as the
	// batch's own (the brokers' counts): its failure is the batch's.
	Last func(ctx context.Context, tx *Tx) error
}

// RerunPart writes part i of a RerunBatch in tx. It may run twice, the
// first run's writes rolled back: it writes only through tx, and what it
// keeps outside (a verdict, what it found) it overwrites in its next run,
// so that its effect lands once.
type RerunPart func(ctx context.Context, tx *Tx, i int) error

// errRunAgain is a batch's first run that a missed guess or a failed part
// ended: the batch is written again, with savepoints.
var errRunAgain = errors.New("a part failed: the batch is written again with savepoints")

// WriteRerunBatch writes b (see RerunBatch) and returns each part's failure (nil:
// written) and the failure of the batch's transaction, after which no part
// is written. A failure of the connection to PostgreSQL is
// ErrDatabaseLost (Lost).
func (s *Store) WriteRerunBatch(ctx context.Context, b RerunBatch) ([]error, error) {
	failed := make([]error, b.Parts)
	err := s.WriteTx(ctx, func(tx *Tx) error {
		tx.pipelined, tx.guesses = s.engine.pipelines(), true
		return b.firstRun(ctx, tx, failed)
	})
	if !errors.Is(err, errRunAgain) && !errors.Is(err, errAheadMissed) {
		return failed, err
	}
	err = s.WriteTx(ctx, func(tx *Tx) error { return b.secondRun(ctx, tx, failed) })
	return failed, err
}

// firstRun writes every part in tx without savepoints: a part's failure
// is kept in failed and ends the run (errRunAgain).
func (b RerunBatch) firstRun(ctx context.Context, tx *Tx, failed []error) error {
	for i := range b.Parts {
		err := b.Part(ctx, tx, i)
		switch {
		case err == nil:
		case errors.Is(err, errAheadMissed) || errors.Is(err, ErrDatabaseLost) || tx.s.engine.lost(err):
			return tx.s.health.observe(err) // no fault of the part's
		default:
			failed[i] = err
			return fmt.Errorf("%w: %w", errRunAgain, err)
		}
	}
	return b.last(ctx, tx)
}

// secondRun writes every part that did not fail in the first run, each in
// its savepoint, keeping the failures in failed.
func (b RerunBatch) secondRun(ctx context.Context, tx *Tx, failed []error) error {
	for i := range b.Parts {
		if failed[i] != nil {
			continue
		}
		err := tx.savepoint(ctx, func() error { return b.Part(ctx, tx, i) })
		if errors.Is(err, ErrDatabaseLost) {
			return err
		}
		failed[i] = err
	}
	return b.last(ctx, tx)
}

// last writes b.Last, when set, and ends a run whose context ended.
func (b RerunBatch) last(ctx context.Context, tx *Tx) error {
	if b.Last != nil {
		if err := b.Last(ctx, tx); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// savepoint runs fn inside one savepoint of tx: a failure rolls back fn's
// writes only, so one part of a batch that fails leaves the others.
// Savepoints are released before the next begins, so one name serves them
// all, and its three statements are prepared once. A savepoint costs a
// part two statements more (on PostgreSQL two round trips), and every page
// it changes a copy in SQLite's sub-journal: only a batch's second run
// takes them.
func (t *Tx) savepoint(ctx context.Context, fn func() error) error {
	if _, err := t.write(ctx, atOnce, "SAVEPOINT msg"); err != nil {
		return fmt.Errorf("savepoint: %w", err)
	}
	if err := fn(); err != nil {
		if t.s.engine.lost(err) {
			return t.s.health.observe(err) // the transaction is gone with it
		}
		ctx := context.WithoutCancel(ctx) // undo the part even when its time is up
		if _, rerr := t.write(ctx, atOnce, "ROLLBACK TO msg"); rerr != nil {
			return errors.Join(err, fmt.Errorf("rollback to savepoint: %w", rerr))
		}
		_, _ = t.write(ctx, atOnce, "RELEASE msg")
		return err
	}
	if _, err := t.write(ctx, atOnce, "RELEASE msg"); err != nil {
		return fmt.Errorf("release savepoint: %w", err)
	}
	return nil
}
