package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
)

// The worker side of consuming: the queue hands over plain messages and
// takes back one verdict each; here they become Events, are handled as
// the parts of one RerunBatch of the store, and GitHub's decode errors become
// the queue's verdicts.

// Handler processes one decoded message. It returns what it found (for
// the worker's Record, once the transaction committed) and nil when done,
// ErrDuplicate when the worker already finished this delivery, a
// permanent verdict or a MalformedError when no retry can help, and any
// other error for a transient failure, which undoes what it wrote of the
// message. tx is the transaction of the message's Batch, which it is acked
// after; a RerunBatch may run a handler again, in a second transaction, when
// another part failed (RerunBatch). It is nil only for a worker with no
// Batcher, whose handler writes nothing. A handler must not touch the
// network, nor keep the Event's Payload past its return (Message.Body).
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
	WriteRerunBatch(ctx context.Context, b RerunBatch) ([]error, error)
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
	// Tracer makes each message's span and its batch's commit's; the zero
	// Tracer, none.
	Tracer Tracer
	Log    *slog.Logger
}

// options is what the queue's consumer does with o's messages.
func (o EventOptions) options() ConsumeOptions {
	return ConsumeOptions{Queue: o.Queue, Handle: o.handleBatch, Batch: o.Batch != nil, Log: o.Log}
}

// handleBatch decodes msgs ahead of the transaction, on a goroutine of its
// own, and handles them in order: as one RerunBatch of the store (a failure
// undoes that message only) when o batches, else each on its own. It
// returns the verdicts, and the transaction's failure. A database lost under them is
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

// handle is handleBatch's work: with a Batcher, msgs are one RerunBatch of
// the store, whose parts are the messages; the brokers' counts are taken
// once and written in the batch's transaction (Last), or given back when
// it does not commit.
func (o EventOptions) handle(ctx context.Context, msgs []Message) ([]error, error) {
	verdicts := make([]error, len(msgs))
	found := make([]Found, len(msgs))
	spans := o.Tracer.startConsumes(ctx, o.Queue, msgs)
	next, decoded := decodeAhead(msgs, o.Decode, o.Log, spans.logFields)
	defer decoded()
	if o.Batch == nil {
		for i := range msgs {
			found[i], verdicts[i] = next(i).handle(spans.context(ctx, i), nil, o.Handle)
		}
		spans.end(verdicts, nil)
		o.record(next, found)
		return verdicts, nil
	}
	counted := o.Usage.take()
	bctx, commit := spans.startCommit(ctx, o.Tracer, o.Queue)
	failed, err := o.Batch.WriteRerunBatch(bctx, RerunBatch{
		Parts: len(msgs),
		Part: func(ctx context.Context, tx *Tx, i int) (err error) {
			found[i], verdicts[i], err = next(i).handlePart(ctx, tx, o.Handle)
			return err
		},
		Last: func(ctx context.Context, tx *Tx) error { return o.Usage.write(ctx, tx, counted) },
	})
	endSpan(commit, err)
	if err != nil {
		o.Usage.giveBack(counted)
		spans.end(verdicts, err)
		return verdicts, err
	}
	for i, f := range failed {
		if f != nil {
			found[i], verdicts[i] = Found{}, verdict(f)
		}
	}
	spans.end(verdicts, nil)
	o.record(next, found)
	return verdicts, nil
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
func decodeAhead(msgs []Message, decode func(Delivery) (Decoded, error), log *slog.Logger, fields func(i int) []any) (next func(i int) decoded, wait func()) {
	out := make([]decoded, len(msgs))
	ready := make(chan struct{}, len(msgs)) // never blocks: the goroutine ends even if nobody waits
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range msgs {
			out[i] = decodeMessage(&msgs[i], decode, log)
			if f := fields(i); f != nil {
				out[i].log = out[i].log.With(f...)
			}
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

// handle runs h on a decoded message with no transaction (a worker that
// writes nothing), and returns its verdict in the queue's words.
func (m decoded) handle(ctx context.Context, tx *Tx, h Handler) (Found, error) {
	if m.err != nil {
		return Found{}, verdict(m.err)
	}
	f, err := h(ctx, tx, m.d)
	return f, verdict(err)
}

// handlePart runs h on a decoded message as a part of a Batch: it returns
// what h found and the verdict when the part is written, or the part's
// failure, which undoes what h wrote of it. A duplicate keeps what its
// handler wrote of it (the receipt's count); a message that is no Event
// writes nothing.
func (m decoded) handlePart(ctx context.Context, tx *Tx, h Handler) (Found, error, error) {
	if m.err != nil {
		return Found{}, verdict(m.err), nil
	}
	f, err := h(ctx, tx, m.d)
	switch {
	case errors.Is(err, ErrDuplicate):
		return Found{}, ErrDuplicate, nil
	case err != nil:
		return Found{}, nil, err
	}
	return f, nil, nil
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
