package main

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// The outbox's forwarder: this node publishes its own rows, in commit
// (id) order, to where the endpoint would publish (a Pending Switch's
// target, else the active broker), a batch at a time on one channel with
// every message of it in flight before the first confirm is awaited; it
// marks those confirmed published. It runs under this node's outbox lease
// (outboxJob), so that a node whose lease is gone (dead, or paused past
// it) publishes nothing, and its rows are adopted by a node that forwards.

// forwardBatch is how many rows one publish of the forwarder sends before
// it waits for their confirms, and one transaction marks.
const forwardBatch = 128

// forwardRetry is how long the forwarder waits before it tries a broker
// that did not take its rows again (sooner when the broker's connection
// comes back), and how often it looks for rows to adopt while idle.
const forwardRetry = time.Second

// Forward publishes this node's rows until ctx ends, under the holding h
// of its outbox lease. A broker that takes nothing (away, blocked,
// refusing switchyard's user, routing nowhere, nacking) is tried again
// each forwardRetry with the oldest row alone, and at once when its
// connection comes back; a row the broker refuses for good (over its
// max_message_size) is marked refused and the rows behind it go on.
func (o *Outbox) Forward(ctx context.Context, h Holding) error {
	if n, err := o.store.OutboxBytes(ctx, o.node); err == nil {
		o.waiting.Store(n)
	}
	var failing string
	lastAdopt, lastPrune := time.Time{}, time.Time{}
	for ctx.Err() == nil {
		limit := forwardBatch
		if failing != "" {
			// One row a try while the broker fails: a broker that nacks
			// (a queue over its length, a quota) costs a message, not a
			// batch.
			limit = 1
		}
		b, n, err := o.forward(ctx, h, limit)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			if failing == "" {
				o.log.Warn("the outbox waits: the broker did not take its oldest webhooks; they are tried again each second",
					"error", err)
			}
			failing = err.Error()
		case n > 0:
			if failing != "" {
				o.log.Info("the broker takes the outbox's webhooks again")
				failing = ""
			}
			continue
		}
		if time.Since(lastAdopt) >= forwardRetry {
			lastAdopt = time.Now()
			if o.adopt(ctx, h) > 0 {
				continue
			}
		}
		if failing == "" && time.Since(lastPrune) > time.Hour {
			lastPrune = time.Now()
			o.prune(ctx, h)
		}
		var back <-chan struct{}
		if b != nil && failing != "" {
			back = o.queues.Back(b) // the broker's connection coming back
		}
		wait := time.NewTimer(forwardRetry)
		select {
		case <-ctx.Done():
		case <-o.kick:
			if failing != "" {
				// The broker failed a moment ago: the next try waits its
				// second (or the broker's return), not the next webhook.
				select {
				case <-ctx.Done():
				case <-wait.C:
				case <-back:
				}
			}
		case <-wait.C:
		case <-back:
		}
		wait.Stop()
	}
	return nil
}

// forward publishes up to limit of this node's oldest rows to the publish
// target and marks those confirmed. It returns the broker it published to,
// how many rows it settled (published, or refused for good), and why the
// broker took no more.
func (o *Outbox) forward(ctx context.Context, h Holding, limit int) (*Broker, int, error) {
	rows, err := o.store.OutboxHead(ctx, o.node, limit)
	if err != nil || len(rows) == 0 || !h.Held() {
		return nil, 0, err
	}
	b, err := o.queues.Target(o.brokers)
	if err != nil {
		return nil, 0, err
	}
	msgs := make([]Outgoing, 0, len(rows))
	var tooLarge error
	for i := range rows {
		if b.MaxMessageBytes > 0 && int64(len(rows[i].Body)) > b.MaxMessageBytes {
			tooLarge = &TooLargeError{Size: int64(len(rows[i].Body)), Max: b.MaxMessageBytes}
			break
		}
		m, err := rows[i].publishing()
		if err != nil {
			return b, 0, err
		}
		msgs = append(msgs, m)
	}
	n, perr := 0, error(nil)
	if len(msgs) > 0 {
		pctx, cancel := context.WithTimeout(ctx, o.publishTimeout)
		n, perr = o.queues.PublishInOrder(pctx, b, msgs)
		cancel()
	}
	var tl *TooLargeError
	if errors.As(perr, &tl) {
		tooLarge = perr
	}
	refuse := tooLarge != nil && n < len(rows)
	if n == 0 && !refuse {
		return b, 0, perr
	}
	ids := make([]int64, n)
	var bytes int64
	for i := range ids {
		ids[i] = rows[i].ID
		bytes += rows[i].Size()
	}
	now := time.Now()
	err = h.WriteTx(ctx, o.store, func(tx *Tx) error {
		if err := tx.OutboxPublished(ctx, o.node, ids, b.Index, now); err != nil || !refuse {
			return err
		}
		return tx.OutboxRefused(ctx, o.node, rows[n].ID, tooLarge.Error(), now)
	})
	if err != nil {
		// Published, not marked: they are published again, duplicates
		// that are stored once.
		return b, 0, fmt.Errorf("outbox rows published to %s, not marked so: %w", b, err)
	}
	o.waiting.Add(-bytes)
	if refuse {
		o.log.Error("the broker refuses a webhook for its size: kept in the outbox as refused; raise the broker's limit (and max_message_bytes), then switchyard outbox retry",
			"delivery_id", rows[n].GUID, "broker", b.String(), "error", tooLarge)
		return b, n + 1, nil
	}
	return b, n, perr
}

// adopt gives this node, under h, the rows of nodes whose outbox lease is
// gone: it returns how many rows it took.
func (o *Outbox) adopt(ctx context.Context, h Holding) int64 {
	// A read first: a write each second on an idle node would be a
	// commit (an fsync on SQLite) for nothing.
	if others, err := o.store.OthersWaiting(ctx, o.node); err != nil || !others {
		return 0
	}
	var rows, bytes int64
	err := h.WriteTx(ctx, o.store, func(tx *Tx) error {
		var err error
		rows, bytes, err = tx.AdoptOutbox(ctx, o.node, outboxJob, o.ttl)
		return err
	})
	if err != nil {
		o.log.Warn("the outbox's rows of gone nodes not adopted", "error", err)
		return 0
	}
	if rows > 0 {
		o.waiting.Add(bytes)
		o.log.Info("the outbox's rows of a node whose lease is gone adopted: this node forwards them", "webhooks", rows)
	}
	return rows
}

// spoolEvery is how often the holder of the spool's lease looks for what
// an older version left in its spool.
const spoolEvery = 5 * time.Second

// MoveSpool moves, until ctx ends, what an older version of switchyard
// left waiting in its spool into this node's outbox, which forwards it. It
// runs under the spool's lease, which an older node's spool drain takes
// too: while one holds it, that node drains its spool, and nothing is
// moved from under it.
func (o *Outbox) MoveSpool(ctx context.Context, h Holding) error {
	t := time.NewTicker(spoolEvery)
	defer t.Stop()
	for {
		var moved, bytes int64
		waiting, err := o.store.SpoolWaiting(ctx)
		if err == nil && waiting {
			err = h.WriteTx(ctx, o.store, func(tx *Tx) error {
				var err error
				moved, bytes, err = tx.MoveSpool(ctx, o.node, time.Now())
				return err
			})
		}
		switch {
		case err != nil && ctx.Err() == nil:
			o.log.Warn("the spool an older version left not moved into the outbox", "error", err)
		case moved > 0:
			o.waiting.Add(bytes)
			o.log.Info("webhooks an older version left in its spool moved into the outbox", "webhooks", moved)
			select {
			case o.kick <- struct{}{}:
			default:
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// prune deletes the published rows past outboxKeptFor, a batch at a time.
func (o *Outbox) prune(ctx context.Context, h Holding) {
	for ctx.Err() == nil {
		var n int64
		err := h.WriteTx(ctx, o.store, func(tx *Tx) error {
			var err error
			n, err = tx.PruneOutbox(ctx, time.Now())
			return err
		})
		if err != nil {
			o.log.Warn("the outbox's published rows not pruned", "error", err)
			return
		}
		if n < retentionBatch {
			return
		}
	}
}
