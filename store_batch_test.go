package main

import (
	"context"
	"errors"
	"testing"
)

// A function handed to a transaction runs once: WriteTx's fails with it,
// even when a statement it sent ahead was answered otherwise (PostgreSQL),
// and a RerunBatch's second run, after a missed guess or a failed part, is
// WriteRerunBatch's own, which runs a failed part's function no more.
func TestBatchWrittenAgainRunsNothingTwiceUnsaid(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		ctx := context.Background()
		store := migratedStore(t)
		mark := func(tx *Tx, e expect, id string) error {
			_, err := tx.write(ctx, e, "INSERT INTO worker_deliveries (worker, delivery_id, processed_at) VALUES ('t', $1, 'x') ON CONFLICT DO NOTHING", id)
			return err
		}
		if err := store.WriteTx(ctx, func(tx *Tx) error { return mark(tx, atOnce, "dup") }); err != nil {
			t.Fatal(err)
		}

		runs := 0
		err := store.WriteTx(ctx, func(tx *Tx) error {
			runs++
			tx.Pipeline()
			return mark(tx, ahead(1), "dup") // changes no row
		})
		if runs != 1 {
			t.Errorf("WriteTx ran its function %d times, want once (err %v)", runs, err)
		}
		if store.Driver() == "postgres" && !errors.Is(err, errAheadMissed) {
			t.Errorf("a statement sent ahead answered otherwise: %v, want errAheadMissed", err)
		}

		var guess aheadGuess
		broken := errors.New("part 2 fails")
		calls := make([]int, 4)
		failed, err := store.WriteRerunBatch(ctx, RerunBatch{Parts: 4, Part: func(ctx context.Context, tx *Tx, i int) error {
			calls[i]++
			switch i {
			case 1:
				return mark(tx, guessed(&guess), "dup") // guessed new: a miss on PostgreSQL
			case 2:
				if err := mark(tx, ahead(1), "b"); err != nil {
					return err
				}
				return broken
			}
			return mark(tx, ahead(1), []string{"a", "", "", "c"}[i])
		}})
		if err != nil {
			t.Fatal(err)
		}
		if failed[0] != nil || failed[1] != nil || !errors.Is(failed[2], broken) || failed[3] != nil {
			t.Errorf("parts' failures %v, want only part 2's", failed)
		}
		if calls[2] != 1 {
			t.Errorf("the failed part ran %d times, want once", calls[2])
		}
		// A guess missed (PostgreSQL): the batch is written again, whole.
		calls = make([]int, 2)
		failed, err = store.WriteRerunBatch(ctx, RerunBatch{Parts: 2, Part: func(ctx context.Context, tx *Tx, i int) error {
			calls[i]++
			if i == 0 {
				return mark(tx, guessed(&guess), "dup")
			}
			return mark(tx, ahead(1), "d")
		}})
		if err != nil || errors.Join(failed...) != nil {
			t.Fatalf("a batch whose guess missed: %v %v", failed, err)
		}
		if store.Driver() == "postgres" && calls[1] != 2 {
			t.Errorf("after a missed guess the batch's last part ran %d times, want twice", calls[1])
		}
		for id, want := range map[string]int{"a": 1, "b": 0, "c": 1, "d": 1, "dup": 1} {
			if n := queryInt(t, store.r, "SELECT count(*) FROM worker_deliveries WHERE worker = 't' AND delivery_id = $1", id); n != want {
				t.Errorf("%d rows of %s, want %d", n, id, want)
			}
		}
	})
}
