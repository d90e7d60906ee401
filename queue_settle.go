package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"reflect"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// How consuming a message ends, in one place: done and duplicate
// are acked once their transaction committed; a permanent failure, a
// broken x-death or the last of max_attempts failures is published to
// QUEUE-error and acked; any other failure is nacked into QUEUE-retry.

// Handler processes one Event. It returns nil when done, ErrDuplicate when the
// worker already finished this delivery, a permanentError when no retry can
// help, and any other error for a transient failure. tx is the batch's
// transaction, which the message is acked after; when tx is nil (a worker
// that does not batch) the handler commits its own before it returns nil.
// A handler handed a tx must not touch the network.
type Handler func(ctx context.Context, tx *Tx, ev *Event) error

// permanentError marks a message that no retry can fix: it goes to -error.
type permanentError struct{ reason string }

func (e *permanentError) Error() string { return e.reason }

func permanent(format string, args ...any) error {
	return &permanentError{reason: fmt.Sprintf(format, args...)}
}

// ErrDuplicate is a handler's answer for a delivery it already finished.
var ErrDuplicate = errors.New("duplicate delivery")

// Outcome is how consuming one message ended.
type Outcome string

const (
	OutcomeDone      Outcome = "done"
	OutcomeDuplicate Outcome = "duplicate"
	OutcomeRetry     Outcome = "retry"
	OutcomeError     Outcome = "error"
)

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

// handleTimeout bounds one message's processing. It does not follow the
// worker's context: on shutdown the message in hand is finished and acked.
const handleTimeout = 2 * time.Minute

// deathCount is the attempt number of a message: the count of its x-death
// entry for queue with reason rejected, i.e. how often it was nacked there.
// ok is false when that count is negative or not an integer: the header is
// forged or broken, and no retry budget can be read from it.
func deathCount(h amqp.Table, queue string) (n int64, ok bool) {
	deaths, _ := h["x-death"].([]any)
	for _, d := range deaths {
		t, isTable := d.(amqp.Table)
		if !isTable || tableString(t, "queue") != queue || tableString(t, "reason") != "rejected" {
			continue
		}
		// RabbitMQ writes a long; a forged header may carry any type.
		switch c := reflect.ValueOf(t["count"]); {
		case c.CanInt():
			n = c.Int()
		case c.CanUint() && c.Uint() <= math.MaxInt64:
			n = int64(c.Uint())
		default:
			return 0, false
		}
		return n, n >= 0
	}
	return 0, true
}

// reasonBadDeath is the x-error-reason of a message whose x-death is broken.
const reasonBadDeath = "invalid x-death header"

// Batcher runs a batch of messages' handlers in one transaction; *Store is
// one (Store.Batch).
type Batcher interface {
	Batch(ctx context.Context, fn func(tx *Tx) error) error
}

// Preparer does ahead of time the part of a handler's work that needs
// neither the database nor the network (decoding the payload for the typed
// tables), keeping what it found in ev for the handler. In a batch it runs
// on the goroutine that decodes the next messages while the transaction
// writes the earlier ones.
type Preparer func(ev *Event)

// decoded is one delivery read for its handler: the Event and its logger, or
// why the delivery is no Event.
type decoded struct {
	ev  *Event
	log *slog.Logger
	err error
}

// decode reads one delivery taken from queue into an Event and prepares it.
// It talks to nobody: it may run ahead of the transaction, on another
// goroutine.
func decode(queue string, d *amqp.Delivery, prepare Preparer, log *slog.Logger) decoded {
	if _, ok := deathCount(d.Headers, queue); !ok {
		// A count of -1,000,000 would otherwise buy a million retries.
		return decoded{log: log.With("delivery_id", d.MessageId), err: permanent("%s", reasonBadDeath)}
	}
	ev, err := DecodeEvent(d)
	if err != nil {
		if d.MessageId != "" {
			log = log.With("delivery_id", d.MessageId)
		}
		return decoded{log: log, err: err}
	}
	if prepare != nil {
		prepare(ev)
	}
	return decoded{ev: ev, log: log.With("delivery_id", ev.DeliveryID, "event", ev.Name)}
}

// decodeAhead decodes ds, in order, on a goroutine of its own, so that a
// batch's transaction writes one message while the next is decoded: the
// consumer keeps two cores busy instead of one. The function it returns
// waits for message i; ask for them in order.
func decodeAhead(queue string, ds []amqp.Delivery, prepare Preparer, log *slog.Logger) func(i int) decoded {
	out := make([]decoded, len(ds))
	ready := make(chan struct{}, len(ds)) // never blocks: the goroutine ends even if nobody waits
	go func() {
		for i := range ds {
			out[i] = decode(queue, &ds[i], prepare, log)
			ready <- struct{}{}
		}
	}()
	got := 0
	return func(i int) decoded {
		for ; got <= i; got++ {
			<-ready
		}
		return out[i]
	}
}

// handle runs h on a decoded message, in tx when one is given (inside a
// savepoint, so a failure undoes this message only). It talks to nobody but
// the database: what the broker hears of the result is finish's job, once any
// transaction is over. It returns h's verdict.
func (m decoded) handle(ctx context.Context, tx *Tx, h Handler) error {
	if m.err != nil {
		return m.err
	}
	ctx = withLogger(ctx, m.log)
	if tx == nil {
		return h(ctx, nil, m.ev)
	}
	return tx.Savepoint(ctx, func() error { return h(ctx, tx, m.ev) })
}

// settled reports whether a verdict is one the caller acks: done or
// duplicate, whose writes (if any) commit with the transaction.
func settled(verdict error) (Outcome, bool) {
	switch {
	case verdict == nil:
		return OutcomeDone, true
	case errors.Is(verdict, ErrDuplicate):
		return OutcomeDuplicate, true
	}
	return "", false
}

// finish tells the broker how a failed delivery ended: a permanent failure
// goes to -error, any other to the retry cycle. Only a failed ack or nack is
// returned: the channel is gone, and the broker will deliver the message
// again.
func (q *Queues) finish(ctx context.Context, b *Broker, queue string, d *amqp.Delivery, verdict error, log *slog.Logger) (Outcome, error) {
	var perm *permanentError
	if errors.As(verdict, &perm) {
		return q.toError(ctx, b, queue, d, perm.reason, 0, log)
	}
	return q.retry(ctx, b, queue, d, verdict, log)
}

// retry ends a transient failure: nack, so the message waits retry_ttl in
// queue-retry, or once it has failed max_attempts times, publish it to
// queue-error with the reason and the attempts.
func (q *Queues) retry(ctx context.Context, b *Broker, queue string, d *amqp.Delivery, cause error, log *slog.Logger) (Outcome, error) {
	attempts, _ := deathCount(d.Headers, queue) // checked in handle
	if attempts >= int64(q.cfg.MaxAttempts) {
		return q.toError(ctx, b, queue, d, cause.Error(), attempts+1, log)
	}
	log.Warn("transient failure, message will retry", "attempt", attempts+1, "error", cause)
	return OutcomeRetry, d.Nack(false, false)
}

// settle handles one delivery with the handler's own transaction, then acks,
// nacks or moves it.
func (q *Queues) settle(b *Broker, d *amqp.Delivery, o ConsumeOptions) (Outcome, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), handleTimeout)
	defer cancel()
	m := decode(o.Queue, d, o.Prepare, o.Log)
	log, verdict := m.log, m.handle(ctx, nil, o.Handle)
	outcome, ok := settled(verdict)
	var err error
	if ok {
		if outcome == OutcomeDuplicate {
			log.Debug("duplicate delivery")
		}
		err = d.Ack(false)
	} else {
		outcome, err = q.finish(ctx, b, o.Queue, d, verdict, log)
	}
	q.consumed(o.Queue, outcome, start)
	return outcome, err
}

// settleBatch handles deliveries, in order, in one transaction, decoded
// ahead of it (decodeAhead). Once it is over, and only then, the broker hears
// of them: each failed one is nacked or moved to -error on its own, then the
// done and duplicate ones are acked with a single multiple ack, which covers
// exactly these (every other delivery up to the last of them was settled
// before). If the commit fails, none of them was stored, and each goes
// through the retry rules.
func (q *Queues) settleBatch(b *Broker, ds []amqp.Delivery, o ConsumeOptions) error {
	queue, log := o.Queue, o.Log
	inHand := &q.conns[b.Index].inHand
	defer inHand.Add(-int64(len(ds)))
	if len(ds) == 1 || o.Batch == nil {
		for i := range ds {
			if _, err := q.settle(b, &ds[i], o); err != nil {
				return err
			}
		}
		return nil
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), handleTimeout)
	defer cancel()
	logs := make([]*slog.Logger, len(ds))
	verdicts := make([]error, len(ds))
	next := decodeAhead(queue, ds, o.Prepare, log)
	err := o.Batch.Batch(ctx, func(tx *Tx) error {
		for i := range ds {
			m := next(i)
			logs[i], verdicts[i] = m.log, m.handle(ctx, tx, o.Handle)
		}
		return ctx.Err()
	})
	if err != nil {
		// Nothing of the batch was stored: what would have been acked
		// retries, and so does what the batch never reached (a BEGIN that
		// found the database locked).
		log.Warn("batch not committed, its messages will retry", "messages", len(ds), "error", err)
		for i := range ds {
			if _, ok := settled(verdicts[i]); ok || logs[i] == nil {
				verdicts[i] = err
			}
			if logs[i] == nil {
				logs[i] = log.With("delivery_id", ds[i].MessageId)
			}
		}
	}
	last := -1
	for i := range ds {
		outcome, ok := settled(verdicts[i])
		if !ok {
			var ferr error
			if outcome, ferr = q.finish(ctx, b, queue, &ds[i], verdicts[i], logs[i]); ferr != nil {
				return ferr
			}
		} else {
			if outcome == OutcomeDuplicate {
				logs[i].Debug("duplicate delivery")
			}
			last = i
		}
		q.consumed(queue, outcome, start)
	}
	if last < 0 {
		return nil
	}
	return ds[last].Ack(true)
}

// consumed records how one message of queue ended.
func (q *Queues) consumed(queue string, outcome Outcome, start time.Time) {
	q.metrics.consume(queue, string(outcome), time.Since(start))
	if outcome == OutcomeDone {
		q.markDone(queue)
	}
}

// toError publishes the delivery to queue-error on the broker it came from,
// with the reason, and acks it. If that publish fails the message is nacked
// instead, so it retries rather than vanishing.
func (q *Queues) toError(ctx context.Context, b *Broker, queue string, d *amqp.Delivery, reason string, attempts int64, log *slog.Logger) (Outcome, error) {
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	headers[hdrError] = reason
	if attempts > 0 {
		headers[hdrAttempts] = attempts
	}
	msg := amqp.Publishing{
		Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp.Persistent, MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type,
		CorrelationId: d.CorrelationId, AppId: d.AppId, Body: d.Body,
	}
	pctx, cancel := context.WithTimeout(ctx, q.cfg.PublishTimeout)
	defer cancel()
	if err := q.Publish(pctx, b, "", errorQueue(queue), msg); err != nil {
		log.Error("cannot move message to error queue, it will retry", "reason", reason, "error", err)
		return OutcomeRetry, d.Nack(false, false)
	}
	log.Error("message moved to error queue", "error_queue", errorQueue(queue), "reason", reason, "attempts", attempts)
	return OutcomeError, d.Ack(false)
}
