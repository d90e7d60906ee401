package main

import (
	"context"
	"fmt"
	"time"
)

// The outbox's writer: one goroutine per node, which the daemon owns,
// takes the rows the requests hand it and commits them in groups, one
// commit (one fsync) for as many as came while the last one was written.
// A request waits for its own row's answer and never writes for another.

// Write commits the rows handed to the outbox until ctx ends. Call it
// once; it returns when ctx ends, after the group in hand is answered:
// the daemon ends it only once the HTTP servers have stopped taking
// webhooks, and a request that still waits is told the writer stopped.
func (o *Outbox) Write(ctx context.Context) error {
	defer close(o.stopped)
	group := make([]*outboxWrite, 0, outboxGroupRows)
	rows := make([]OutboxRow, 0, outboxGroupRows)
	for {
		select {
		case <-ctx.Done():
			return nil
		case w := <-o.writes:
			group = append(group[:0], w)
		}
		bytes := group[0].row.Size()
	more:
		for len(group) < outboxGroupRows && bytes < outboxGroupBytes {
			select {
			case w := <-o.writes:
				group = append(group, w)
				bytes += w.row.Size()
			default:
				break more
			}
		}
		rows = rows[:0]
		for _, w := range group {
			rows = append(rows, w.row)
		}
		err := o.commit(rows)
		if err == nil {
			o.waiting.Add(bytes)
			select {
			case o.kick <- struct{}{}:
			default:
			}
		}
		for _, w := range group {
			w.done <- err
		}
		if err != nil {
			// What came while the store failed would wait for it again:
			// it takes the broker's path now.
			o.failWaiting(err)
		}
		clear(group)
		clear(rows)
	}
}

// commit writes rows to the outbox in one transaction, within the
// writer's time: not the request's, since the group is many requests'.
func (o *Outbox) commit(rows []OutboxRow) error {
	if down, _, cause := o.store.Down(); down {
		// Lost (until it answers again), or past its floor for this
		// binary (for good): the broker's path at once, not after a wait.
		o.logStoreRefused(fmt.Errorf("%d webhooks: the database is lost: %w", len(rows), cause))
		return fmt.Errorf("the database is lost: %w", cause)
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.commitTimeout)
	defer cancel()
	start := time.Now()
	err := o.store.WriteTxFirst(ctx, func(tx *Tx) error {
		tx.Pipeline()
		return tx.Outbox(ctx, rows)
	})
	if err != nil {
		o.logStoreRefused(fmt.Errorf("%d webhooks, after %s: %w", len(rows), time.Since(start).Round(time.Millisecond), err))
	}
	return err
}

// failWaiting answers err to every row handed to the writer now.
func (o *Outbox) failWaiting(err error) {
	for {
		select {
		case w := <-o.writes:
			w.done <- err
		default:
			return
		}
	}
}
