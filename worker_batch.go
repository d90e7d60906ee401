package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
)

// The worker side of consuming: the queue hands over plain messages and
// takes back one verdict each; here they become Events, are handled in one
// store transaction with a savepoint each, and GitHub's decode errors
// become the queue's verdicts.

// Handler processes one decoded message. It returns what it found (for
// the worker's Record, once the transaction committed) and nil when done,
// ErrDuplicate when the worker already finished this delivery, a
// permanent verdict or a MalformedError when no retry can help, and any
// other error for a transient failure. tx is the message's transaction,
// which it is acked after: the batch's, inside a savepoint of the
// message's own, or one for a lone message. It is nil only for a worker
// with no Batcher, whose handler writes nothing. A handler must not touch
// the network.
type Handler func(ctx context.Context, tx *Tx, d Decoded) (Found, error)

// Found is what a handler found of a message besides its verdict, which
// its worker records (a log line, a counter) once the transaction that
// wrote it committed: a batch run again records nothing twice.
type Found struct {
	// Stale names the typed table whose row was newer than the Event.
	Stale string
	// Skipped says why the typed tables used nothing of the Event.
	Skipped string
}

// Batcher runs a batch of messages' handlers in one transaction; *Store is
// one (Store.WriteTx). Lost and WaitAnswers tell when the database is lost
// (a connection to it failed) and when it answers again.
type Batcher interface {
	WriteTx(ctx context.Context, fn func(tx *Tx) error) error
	Lost() <-chan struct{}
	WaitAnswers(ctx context.Context) error
}

// EventOptions say how a worker handles its queue's messages as Events.
type EventOptions struct {
	Queue  string
	Handle Handler
	// Decode reads a message for Handle (DecodeTableRows with the rows
	// the handler writes); nil reads its Event only (DecodeEvent). It
	// runs ahead of the transaction.
	Decode func(Delivery) (Decoded, error)
	// Record, when set, records what the handler found of each message
	// once its transaction committed (or, with no Batch, once handled).
	Record func(log *slog.Logger, f Found)
	// Batch, when set, commits a window's half at once; nil hands each
	// message over on its own, with no transaction.
	Batch Batcher
	// Usage, when set, writes the brokers' counted messages in each
	// transaction a batch commits.
	Usage *Usage
	Log   *slog.Logger
}

// options is what the queue's consumer does with o's messages.
func (o EventOptions) options() ConsumeOptions {
	return ConsumeOptions{Queue: o.Queue, Handle: o.handleBatch, Batch: o.Batch != nil, Log: o.Log}
}

// handleBatch decodes msgs ahead of the transaction, on a goroutine of its
// own, and handles them in order: in one transaction with a savepoint each
// (a failure undoes that message only) when o batches, else each on its
// own, a lone message in a transaction of its own. It returns the
// verdicts, and the transaction's failure. A database lost under them is
// no failure of the messages: they are handed back (ErrHandedBack).
func (o EventOptions) handleBatch(ctx context.Context, msgs []Message) ([]error, error) {
	verdicts, err := o.handle(ctx, msgs)
	for _, v := range append(verdicts, err) {
		if errors.Is(v, ErrDatabaseLost) {
			return verdicts, fmt.Errorf("%w: %w", ErrHandedBack, v)
		}
	}
	return verdicts, err
}

// handle is handleBatch's work.
func (o EventOptions) handle(ctx context.Context, msgs []Message) ([]error, error) {
	verdicts := make([]error, len(msgs))
	found := make([]Found, len(msgs))
	next, decoded := decodeAhead(msgs, o.Decode, o.Log)
	defer decoded()
	switch {
	case o.Batch == nil:
		for i := range msgs {
			found[i], verdicts[i] = next(i).handle(ctx, nil, o.Handle)
		}
		o.record(next, found)
		return verdicts, nil
	case len(msgs) == 1:
		found[0], verdicts[0] = next(0).handleAlone(ctx, o.Batch, o.Handle, o.Usage)
		o.record(next, found)
		return verdicts, nil
	}
	// A message that failed in a pass without savepoints keeps its verdict
	// when the batch runs again with them: its handler runs once.
	failed := map[int]error{}
	err := batchWithUsage(ctx, o.Batch, o.Usage, func(tx *Tx) error {
		for i := range msgs {
			if v, ok := failed[i]; ok {
				verdicts[i] = v
				continue
			}
			found[i], verdicts[i] = next(i).handle(ctx, tx, o.Handle)
			if errors.Is(verdicts[i], ErrNeedSavepoints) {
				// This message's failure, or a statement sent
				// ahead that was answered otherwise (no one's).
				if ns := (*NeedSavepoints)(nil); errors.As(verdicts[i], &ns) {
					failed[i] = verdict(ns.Err)
				}
				return verdicts[i]
			}
		}
		return ctx.Err()
	})
	if err == nil {
		o.record(next, found)
	}
	return verdicts, err
}

// record hands what the handlers found to Record, once: after the commit
// of the run that counted (a run again overwrote the earlier one's).
func (o EventOptions) record(next func(i int) decoded, found []Found) {
	if o.Record == nil {
		return
	}
	for i, f := range found {
		if f != (Found{}) {
			o.Record(next(i).log, f)
		}
	}
}

// decoded is one message read for its handler: the Decoded and its
// logger, or why the message is no Event.
type decoded struct {
	d   Decoded
	log *slog.Logger
	err error
}

// decodeMessage reads one message with decode (nil: its Event only). It
// talks to nobody: it may run ahead of the transaction, on another
// goroutine.
func decodeMessage(m *Message, decode func(Delivery) (Decoded, error), log *slog.Logger) decoded {
	if decode == nil {
		decode = func(d Delivery) (Decoded, error) {
			ev, err := DecodeEvent(d)
			return Decoded{Event: ev}, err
		}
	}
	d, err := decode(Delivery{MessageID: m.ID, Type: m.Type, Header: m.Header, Body: m.Body, Zstd: m.Zstd, Timestamp: m.Timestamp})
	if err != nil {
		if m.ID != "" {
			log = log.With("delivery_id", m.ID)
		}
		return decoded{log: log, err: err}
	}
	if m.Broker != nil {
		d.Event.Broker = usageKey(m.Broker.Host, m.Broker.Vhost)
	}
	return decoded{d: d, log: log.With("delivery_id", d.Event.DeliveryID, "event", d.Event.Name)}
}

// decodeAhead decodes msgs, in order, on a goroutine of its own, so that a
// batch's transaction writes one message while the next is decoded: the
// consumer keeps two cores busy instead of one. next waits for message i
// (ask for them in order); wait waits for the goroutine to end, which the
// caller does before it returns, whether or not it asked for every message.
func decodeAhead(msgs []Message, decode func(Delivery) (Decoded, error), log *slog.Logger) (next func(i int) decoded, wait func()) {
	out := make([]decoded, len(msgs))
	ready := make(chan struct{}, len(msgs)) // never blocks: the goroutine ends even if nobody waits
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range msgs {
			out[i] = decodeMessage(&msgs[i], decode, log)
			ready <- struct{}{}
		}
	})
	got := 0
	return func(i int) decoded {
		for ; got <= i; got++ {
			<-ready
		}
		return out[i]
	}, wg.Wait
}

// handle runs h on a decoded message, in tx when one is given (inside a
// savepoint, so a failure undoes this message only), and returns its
// verdict in the queue's words.
func (m decoded) handle(ctx context.Context, tx *Tx, h Handler) (Found, error) {
	if m.err != nil {
		return Found{}, verdict(m.err)
	}
	if tx == nil {
		f, err := h(ctx, nil, m.d)
		return f, verdict(err)
	}
	// A duplicate keeps what its handler wrote of it (the receipt's count):
	// only a failure undoes the savepoint, and what it found with it.
	duplicate := false
	var found Found
	err := tx.Savepoint(ctx, func() error {
		f, err := h(ctx, tx, m.d)
		if errors.Is(err, ErrDuplicate) {
			duplicate = true
			return nil
		}
		found = f
		return err
	})
	if errors.Is(err, ErrNeedSavepoints) {
		return Found{}, err // not a verdict: the batch runs again (Store.WriteTx)
	}
	if err != nil {
		return Found{}, verdict(err)
	}
	if duplicate {
		return Found{}, ErrDuplicate
	}
	return found, nil
}

// verdict maps a handler's error to the queue's verdict: GitHub's decode
// errors are permanent, the rest are already the queue's words.
func verdict(err error) error {
	var mal *MalformedError
	if errors.As(err, &mal) {
		return permanent("%s", mal.Reason)
	}
	return err
}

// handleAlone runs h on a lone decoded message in a transaction of its own,
// without a savepoint: a failure rolls it back, a duplicate commits what
// its handler wrote of it (the receipt's count), with the brokers' counts
// (usage) when it commits.
func (m decoded) handleAlone(ctx context.Context, b Batcher, h Handler, usage *Usage) (Found, error) {
	if m.err != nil {
		return Found{}, verdict(m.err)
	}
	var handled error
	var found Found
	err := batchWithUsage(ctx, b, usage, func(tx *Tx) error {
		found, handled = h(ctx, tx, m.d)
		if errors.Is(handled, ErrDuplicate) {
			return nil
		}
		return handled
	})
	if err != nil {
		return Found{}, verdict(err)
	}
	if handled != nil {
		return Found{}, verdict(handled)
	}
	return found, nil
}

// batchWithUsage runs fn in one transaction of batcher and, when fn
// succeeds, adds to the same transaction what usage's queues counted since
// it was last taken:
// a message's delivery is counted with the commit of what it did, and a
// daemon at work writes no transaction of its own for its counts. Counts a
// transaction did not commit go back. A nil usage runs fn alone. The
// transaction's statements go ahead of their answers (Tx.Pipeline).
func batchWithUsage(ctx context.Context, batcher Batcher, usage *Usage, fn func(tx *Tx) error) error {
	undo := func() {}
	err := batcher.WriteTx(ctx, func(tx *Tx) error {
		// A run again (with savepoints) counts anew: what an earlier run
		// took goes back first.
		undo()
		undo = func() {}
		tx.Pipeline()
		if err := fn(tx); err != nil || usage == nil {
			return err
		}
		var err error
		undo, err = usage.addUsageIn(ctx, tx)
		return err
	})
	if err != nil {
		undo()
	}
	return err
}
