package main

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// The outbox's forwarder: this node publishes its own rows, in commit
// (id) order, to where the endpoint would publish (a Pending Switch's
// target, else the active broker), on one channel, keeping a window of
// publishes in flight: a batch is sent behind the one whose confirms it
// waits for, so that the link carries the next rows while a batch's
// confirms come back and its rows are marked published. It runs under
// this node's outbox lease (outboxJob), so that a node whose lease is gone
// (dead, or paused past it) publishes nothing, and its rows are adopted by
// a node that forwards.

// forwardBatch is how many rows one batch of the forwarder sends, and one
// transaction marks; forwardDepth how many batches are in flight at once.
// Their product is the window, below a broker's maxInFlight so that the
// endpoint's own publishes (while the store refuses) find room. A batch
// also ends with the row that brings its messages to forwardBatchBytes:
// 60 typical webhooks are a few hundred KB compressed, but 60 of 1 MB
// were 10 MB a batch, 40 MB held in flight, which the daemon's memory
// limit cannot hold.
const (
	forwardBatch      = 60
	forwardDepth      = 4
	forwardBatchBytes = 1 << 20
)

// forwardRetry is how long the forwarder waits before it tries a broker
// that did not take its rows again (sooner when the broker's connection
// comes back), how often it looks for rows to adopt while idle, and how
// often, while batches follow one another, it looks for waiting rows
// older than those in flight (adopted, moved from a spool, sent again by
// `switchyard outbox retry`): it lets the window empty to take them.
const forwardRetry = time.Second

// flight is a batch of this node's rows sent to a broker, its confirms
// not yet awaited.
type flight struct {
	b    *Broker
	rows []OutboxRow // read; the first sent of them were sent
	sent int
	// tooLarge: rows[sent] is over what b takes (Queues.TooLarge), refused
	// for good once those before it are confirmed.
	tooLarge error
	s        *Sent // nil when none was sent
	ctx      context.Context
	cancel   context.CancelFunc
}

// last is the id of the last row f sent.
func (f *flight) last() int64 { return f.rows[f.sent-1].ID }

// settle waits for f's confirms: how many of its first rows were
// confirmed, and why the next was not.
func (f *flight) settle() (int, error) {
	defer f.cancel()
	if f.s == nil {
		return 0, nil
	}
	return f.s.Settle(f.ctx)
}

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
	var (
		flights                       []*flight // oldest first
		failing                       string
		last                          *Broker
		draining                      bool
		lastAdopt, lastPrune, lastOld time.Time
	)
	// readAll is o.committed when a read last took every row that waited
	// (-1: not known): behind a batch in flight, the next read waits until
	// a batch's worth was committed since.
	readAll := int64(-1)
	// fill sends batches behind those in flight, or past marking's rows (a
	// batch confirmed, its marking to come), while the window has room;
	// one row alone, with none in flight, while the broker fails.
	fill := func(marking *flight) error {
		for len(flights) < forwardDepth && !draining {
			ahead, behind, limit := marking, (*flight)(nil), o.batchRows()
			if len(flights) > 0 {
				ahead = flights[len(flights)-1]
				behind = ahead
			}
			if failing != "" {
				if ahead != nil {
					return nil
				}
				limit = 1
			}
			committed := o.committed.Load()
			if behind != nil && readAll >= 0 && committed-readAll < int64(limit) {
				return nil
			}
			f, full, err := o.send(ctx, h, ahead, behind, limit)
			if full {
				readAll = -1
			} else {
				readAll = committed
			}
			if err != nil || f == nil {
				return err
			}
			flights, last = append(flights, f), f.b
		}
		return nil
	}
	// drop gives up the batches in flight: what was sent behind rows not
	// confirmed is sent again after them, duplicates stored once.
	drop := func() {
		for _, f := range flights {
			f.cancel()
			_, _ = f.settle()
		}
		flights = nil
	}
	defer drop()
	for ctx.Err() == nil {
		if len(flights) == 0 {
			draining = false
		}
		if len(flights) > 0 && time.Since(lastOld) >= forwardRetry {
			lastOld = time.Now()
			draining = o.olderWaiting(ctx, flights[0].rows[0].ID)
		}
		err := fill(nil)
		if len(flights) > 0 {
			f := flights[0]
			o.awaitAnswer(ctx, f, func() { _ = fill(nil) })
			flights = flights[1:]
			n, perr := f.settle()
			if perr == nil {
				_ = fill(f) // the next batch on the link before f's marking waits for the store
			}
			var settled int
			settled, err = o.mark(ctx, h, f, n, perr)
			if perr != nil || err != nil {
				// What went behind f on its channel failed with it (a
				// refusal of f's row for its size closed the channel, and
				// is no refusal of theirs), or waits on a marking that
				// failed: it is sent again, duplicates stored once.
				drop()
			}
			if err == nil {
				if settled > 0 && failing != "" {
					o.log.Info("the broker takes the outbox's webhooks again")
					failing = ""
				}
				continue
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			if failing == "" {
				o.log.Warn("the outbox waits: the broker did not take its oldest webhooks; they are tried again each second",
					"error", err)
			}
			failing = err.Error()
		}
		// Nothing in flight: nothing waits, or the broker takes none.
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
		if last != nil && failing != "" {
			back = o.queues.Back(last) // the broker's connection coming back
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

// batchRows is how many rows a batch reads: forwardBatch, or as many as
// forwardBatchBytes takes at the size of the rows read last (the one
// that reaches it too). A read past what the batch takes would be thrown
// away, and on PostgreSQL sent over the connection first: 60 rows of 1 MB
// webhooks for the 7 a batch takes.
func (o *Outbox) batchRows() int {
	if o.rowBytes <= 0 {
		return forwardBatch
	}
	return int(min(forwardBatch, (forwardBatchBytes+o.rowBytes-1)/o.rowBytes))
}

// awaitAnswer waits until the broker has answered f's last message (or
// will not: Sent.Answered), calling fill (the window filled behind it)
// each time rows are committed meanwhile.
func (o *Outbox) awaitAnswer(ctx context.Context, f *flight, fill func()) {
	if f.s == nil {
		return
	}
	for {
		select {
		case <-f.s.Answered():
			return
		case <-ctx.Done():
			return
		case <-o.kick:
			fill() // what it could not send is sent after f settles
		}
	}
}

// send reads up to limit of this node's rows that wait (forwardBatchBytes
// of them at most), past those of ahead (the last batch sent, in flight
// or confirmed) when it is set, and sends them to the publish target,
// behind behind (the last batch in flight) on its channel when it is set.
// It returns nil when there is none to send, or none may go after ahead:
// the row after it must be refused first, the target is another broker
// now, or the rows read are not a full batch to go behind behind. full
// says the rows read were a full batch, by count or bytes (others may
// wait behind them).
func (o *Outbox) send(ctx context.Context, h Holding, ahead, behind *flight, limit int) (f *flight, full bool, err error) {
	var after int64
	if ahead != nil {
		if ahead.tooLarge != nil {
			return nil, true, nil
		}
		after = ahead.last()
	}
	rows, err := o.store.OutboxHead(ctx, o.node, after, limit, forwardBatchBytes)
	var bytes int64
	for i := range rows {
		bytes += rows[i].Size()
	}
	if len(rows) > 0 {
		o.rowBytes = bytes / int64(len(rows))
	}
	full = len(rows) == limit || bytes >= forwardBatchBytes
	if err != nil || len(rows) == 0 || (behind != nil && !full) || !h.Held() {
		// Behind a batch in flight only a full one goes: fewer rows wait
		// for its confirms and go together then, so that a steady stream
		// is a batch (and a marking) a round trip, not one a few rows.
		return nil, full, err
	}
	b, err := o.queues.Target(o.brokers)
	if err != nil {
		return nil, full, err
	}
	if ahead != nil && b != ahead.b {
		return nil, full, nil
	}
	f = &flight{b: b, rows: rows}
	msgs := make([]Outgoing, 0, len(rows))
	for i := range rows {
		if f.tooLarge = o.queues.TooLarge(b, int64(len(rows[i].Body))); f.tooLarge != nil {
			break
		}
		m, err := rows[i].publishing()
		if err != nil {
			return nil, full, err
		}
		msgs = append(msgs, m)
	}
	f.sent = len(msgs)
	f.ctx, f.cancel = context.WithTimeout(ctx, o.publishTimeout)
	if len(msgs) == 0 {
		return f, full, nil
	}
	var on *Sent
	if behind != nil {
		on = behind.s
	}
	if f.s, err = o.queues.Send(f.ctx, b, msgs, on); err != nil {
		f.cancel()
		return nil, full, err
	}
	return f, full, nil
}

// mark marks the first n rows of f published (the broker confirmed them)
// and, when the broker refuses the one after them for good (its size),
// that one refused. It returns how many rows it settled, and why the rest
// were not: perr, the publish's, or the marking's.
func (o *Outbox) mark(ctx context.Context, h Holding, f *flight, n int, perr error) (int, error) {
	var refusal error
	var tl *TooLargeError
	switch {
	case errors.As(perr, &tl):
		refusal = perr // the broker closed the channel on rows[n]
	case f.tooLarge != nil && n == f.sent:
		refusal = f.tooLarge
	}
	if n == 0 && refusal == nil {
		return 0, perr
	}
	ids := make([]int64, n)
	var bytes int64
	for i := range ids {
		ids[i] = f.rows[i].ID
		bytes += f.rows[i].Size()
	}
	now := time.Now()
	err := h.WriteTx(ctx, o.store, func(tx *Tx) error {
		if err := tx.OutboxPublished(ctx, o.node, ids, f.b.Index, now); err != nil || refusal == nil {
			return err
		}
		return tx.OutboxRefused(ctx, o.node, f.rows[n].ID, refusal.Error(), now)
	})
	if err != nil {
		// Published, not marked: they are published again, duplicates
		// that are stored once.
		return 0, fmt.Errorf("outbox rows published to %s, not marked so: %w", f.b, err)
	}
	o.waiting.Add(-bytes)
	if refusal != nil {
		o.log.Error("the broker refuses a webhook for its size: kept in the outbox as refused; raise the broker's limit (and max_message_bytes), then switchyard outbox retry",
			"delivery_id", f.rows[n].GUID, "broker", f.b.String(), "error", refusal)
		return n + 1, nil
	}
	return n, perr
}

// olderWaiting reports whether a row waits that is older than first, the
// first row in flight: adopted, moved or sent again since the window
// began, it would wait behind every batch that follows.
func (o *Outbox) olderWaiting(ctx context.Context, first int64) bool {
	head, err := o.store.OutboxHead(ctx, o.node, 0, 1, 0)
	return err == nil && len(head) == 1 && head[0].ID < first
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
