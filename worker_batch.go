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

// Handler processes one Event. It returns nil when done, ErrDuplicate when
// the worker already finished this delivery, a permanent verdict or a
// MalformedError when no retry can help, and any other error for a
// transient failure. tx is the message's transaction, which it is acked
// after: the batch's, inside a savepoint of the message's own, or one for
// a lone message. It is nil only for a worker with no Batcher, whose
// handler writes nothing. A handler must not touch the network.
type Handler func(ctx context.Context, tx *Tx, ev *Event) error

// Preparer does ahead of time the part of a handler's work that needs
// neither the database nor the network (decoding the payload for the typed
// tables), keeping what it found in ev for the handler. In a batch it runs
// on the goroutine that decodes the next messages while the transaction
// writes the earlier ones.
type Preparer func(ev *Event)

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
	// Prepare, when set, does the handler's decoding ahead of it.
	Prepare Preparer
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
	next, decoded := decodeAhead(msgs, o.Prepare, o.Log)
	defer decoded()
	switch {
	case o.Batch == nil:
		for i := range msgs {
			verdicts[i] = next(i).handle(ctx, nil, o.Handle)
		}
		return verdicts, nil
	case len(msgs) == 1:
		verdicts[0] = next(0).handleAlone(ctx, o.Batch, o.Handle, o.Usage)
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
			verdicts[i] = next(i).handle(ctx, tx, o.Handle)
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
	return verdicts, err
}

// decoded is one message read for its handler: the Event and its logger,
// or why the message is no Event.
type decoded struct {
	ev  *Event
	log *slog.Logger
	err error
}

// decodeEvent reads one message into an Event and prepares it. It talks to
// nobody: it may run ahead of the transaction, on another goroutine.
func decodeEvent(m *Message, prepare Preparer, log *slog.Logger) decoded {
	ev, err := DecodeEvent(Delivery{MessageID: m.ID, Type: m.Type, Header: m.Header, Body: m.Body, Timestamp: m.Timestamp})
	if err != nil {
		if m.ID != "" {
			log = log.With("delivery_id", m.ID)
		}
		return decoded{log: log, err: err}
	}
	if m.Broker != nil {
		ev.Broker = usageKey(m.Broker.Host, m.Broker.Vhost)
	}
	if prepare != nil {
		prepare(ev)
	}
	return decoded{ev: ev, log: log.With("delivery_id", ev.DeliveryID, "event", ev.Name)}
}

// decodeAhead decodes msgs, in order, on a goroutine of its own, so that a
// batch's transaction writes one message while the next is decoded: the
// consumer keeps two cores busy instead of one. next waits for message i
// (ask for them in order); wait waits for the goroutine to end, which the
// caller does before it returns, whether or not it asked for every message.
func decodeAhead(msgs []Message, prepare Preparer, log *slog.Logger) (next func(i int) decoded, wait func()) {
	out := make([]decoded, len(msgs))
	ready := make(chan struct{}, len(msgs)) // never blocks: the goroutine ends even if nobody waits
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range msgs {
			out[i] = decodeEvent(&msgs[i], prepare, log)
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
func (m decoded) handle(ctx context.Context, tx *Tx, h Handler) error {
	if m.err != nil {
		return verdict(m.err)
	}
	ctx = withLogger(ctx, m.log)
	if tx == nil {
		return verdict(h(ctx, nil, m.ev))
	}
	// A duplicate keeps what its handler wrote of it (the receipt's count):
	// only a failure undoes the savepoint.
	duplicate := false
	err := tx.Savepoint(ctx, func() error {
		err := h(ctx, tx, m.ev)
		if errors.Is(err, ErrDuplicate) {
			duplicate = true
			return nil
		}
		return err
	})
	if errors.Is(err, ErrNeedSavepoints) {
		return err // not a verdict: the batch runs again (Store.WriteTx)
	}
	if err == nil && duplicate {
		err = ErrDuplicate
	}
	return verdict(err)
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

type loggerKey struct{}

// withLogger hands a handler the message's logger, which carries worker,
// queue, broker, delivery_id and event, so that its lines say which message
// they are about.
func withLogger(ctx context.Context, log *slog.Logger) context.Context {
	return context.WithValue(ctx, loggerKey{}, log)
}

// loggerFrom returns the message's logger, or fallback outside a message.
func loggerFrom(ctx context.Context, fallback *slog.Logger) *slog.Logger {
	if l, ok := ctx.Value(loggerKey{}).(*slog.Logger); ok {
		return l
	}
	return fallback
}

// handleAlone runs h on a lone decoded message in a transaction of its own,
// without a savepoint: a failure rolls it back, a duplicate commits what
// its handler wrote of it (the receipt's count), with the brokers' counts
// (usage) when it commits.
func (m decoded) handleAlone(ctx context.Context, b Batcher, h Handler, usage *Usage) error {
	if m.err != nil {
		return verdict(m.err)
	}
	ctx = withLogger(ctx, m.log)
	var handled error
	err := batchWithUsage(ctx, b, usage, func(tx *Tx) error {
		handled = h(ctx, tx, m.ev)
		if errors.Is(handled, ErrDuplicate) {
			return nil
		}
		return handled
	})
	if err != nil {
		return verdict(err)
	}
	return verdict(handled)
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
