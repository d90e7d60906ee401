package main

import (
	"context"
	"fmt"
	"time"
)

// The outbox's writer: one goroutine per node, which the daemon owns,
// takes the rows the requests hand it and commits them in groups, one
// commit (one fsync) for as many as came while the last one was written
// and this one waited for the store's writer. A request waits for its own
// row's answer and never writes for another.

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
		// The group is gathered once the writer's turn is taken, not
		// before: the rows that came while the commit waited for it (a
		// consumer's batch under way) are in this commit, not the next.
		var bytes int64
		var err error
		group, bytes, err = o.commit(group, rows)
		if err == nil {
			o.waiting.Add(bytes)
			o.committed.Add(int64(len(group)))
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
	}
}

// commit writes group, and the rows handed to the writer by the time
// its transaction began, to the outbox in one transaction, within the
// writer's time: not the request's, since the group is many requests'. It
// returns the group it wrote, or did not, and its rows' bytes; rows is
// room for their rows, cleared after.
func (o *Outbox) commit(group []*outboxWrite, rows []OutboxRow) ([]*outboxWrite, int64, error) {
	if down, _, cause := o.store.Down(); down {
		// Lost (until it answers again), or past its floor for this
		// binary (for good): the broker's path at once, not after a wait.
		o.logStoreRefused(fmt.Errorf("%d webhooks: the database is lost: %w", len(group), cause))
		return group, 0, fmt.Errorf("the database is lost: %w", cause)
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.commitTimeout)
	defer cancel()
	start := time.Now()
	var bytes int64
	err := o.store.WriteTxFirst(ctx, func(tx *Tx) error {
		group, bytes = o.gather(group)
		rows = rows[:0]
		for _, w := range group {
			rows = append(rows, w.row)
		}
		tx.Pipeline()
		return tx.Outbox(ctx, rows)
	})
	clear(rows)
	if err != nil {
		o.logStoreRefused(fmt.Errorf("%d webhooks, after %s: %w", len(group), time.Since(start).Round(time.Millisecond), err))
	}
	return group, bytes, err
}

// gather adds to group (one row) the rows handed to the writer now, up
// to a group's bounds, and returns it with its rows' bytes.
func (o *Outbox) gather(group []*outboxWrite) ([]*outboxWrite, int64) {
	bytes := group[0].row.Size()
	for len(group) < outboxGroupRows && bytes < outboxGroupBytes {
		select {
		case w := <-o.writes:
			group = append(group, w)
			bytes += w.row.Size()
		default:
			return group, bytes
		}
	}
	return group, bytes
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
