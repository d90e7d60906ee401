package main

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"reflect"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// How consuming a message ends (SPEC §5), in one place: done and duplicate
// are acked once their transaction committed; a permanent failure, a
// broken x-death or the last of max_attempts failures is published to
// QUEUE-error and acked; any other failure is nacked into QUEUE-retry.

// Handler processes one Event. It returns nil when done, ErrDuplicate when the
// worker already finished this delivery, a permanentError when no retry can
// help, and any other error for a transient failure. It must commit before it
// returns nil: the message is acked right after.
type Handler func(ctx context.Context, ev *Event) error

// Outcome is how consuming one message ended (SPEC §5).
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
	Batch(ctx context.Context, fn func(ctx context.Context) error) error
}

// process decodes and handles one delivery taken from queue on broker b. A
// retry or an error is settled here (nack, or publish to -error and ack); done
// and duplicate are left to the caller, which acks them once their
// transaction committed. Only a failed ack or nack is returned: the channel is
// gone, and the broker will deliver the message again.
func (q *Queues) process(ctx context.Context, b *Broker, queue string, d *amqp.Delivery, h Handler, log *slog.Logger) (Outcome, error) {
	if _, ok := deathCount(d.Headers, queue); !ok {
		// A count of -1,000,000 would otherwise buy a million retries.
		return q.toError(ctx, b, queue, d, reasonBadDeath, 0, log.With("delivery_id", d.MessageId))
	}
	ev, err := DecodeEvent(d)
	if err == nil {
		log = log.With("delivery_id", ev.DeliveryID, "event", ev.Name)
		err = h(withLogger(ctx, log), ev)
	} else if d.MessageId != "" {
		log = log.With("delivery_id", d.MessageId)
	}

	var perm *permanentError
	switch {
	case err == nil:
		return OutcomeDone, nil
	case errors.Is(err, ErrDuplicate):
		log.Debug("duplicate delivery")
		return OutcomeDuplicate, nil
	case errors.As(err, &perm):
		return q.toError(ctx, b, queue, d, perm.reason, 0, log)
	}
	return q.retry(ctx, b, queue, d, err, log)
}

// retry ends a transient failure: nack, so the message waits retry_ttl in
// queue-retry, or once it has failed max_attempts times, publish it to
// queue-error with the reason and the attempts.
func (q *Queues) retry(ctx context.Context, b *Broker, queue string, d *amqp.Delivery, cause error, log *slog.Logger) (Outcome, error) {
	attempts, _ := deathCount(d.Headers, queue) // checked in process
	if attempts >= int64(q.cfg.MaxAttempts) {
		return q.toError(ctx, b, queue, d, cause.Error(), attempts+1, log)
	}
	log.Warn("transient failure, message will retry", "attempt", attempts+1, "error", cause)
	return OutcomeRetry, d.Nack(false, false)
}

// settle handles one delivery in its own transaction(s) and acks it.
func (q *Queues) settle(b *Broker, queue string, d *amqp.Delivery, h Handler, log *slog.Logger) (Outcome, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), handleTimeout)
	defer cancel()
	outcome, err := q.process(ctx, b, queue, d, h, log)
	if err == nil && (outcome == OutcomeDone || outcome == OutcomeDuplicate) {
		err = d.Ack(false)
	}
	q.metrics.consume(queue, outcome, time.Since(start))
	return outcome, err
}

// settleBatch handles deliveries, in order, in one transaction, then acks the
// done and duplicate ones with a single multiple ack: every other delivery of
// the batch was settled on its own before, so the multiple ack covers exactly
// these. If the commit fails, none of them was stored, and each goes through
// the retry rules.
func (q *Queues) settleBatch(b *Broker, queue string, ds []amqp.Delivery, h Handler, batch Batcher, log *slog.Logger) error {
	inHand := &q.conns[b.Index].inHand
	defer inHand.Add(-int64(len(ds)))
	if len(ds) == 1 || batch == nil {
		for i := range ds {
			if _, err := q.settle(b, queue, &ds[i], h, log); err != nil {
				return err
			}
		}
		return nil
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), handleTimeout)
	defer cancel()
	var pending []*amqp.Delivery // handled, waiting for the commit
	var outcomes []Outcome
	processed := 0
	err := batch.Batch(ctx, func(ctx context.Context) error {
		for i := range ds {
			outcome, err := q.process(ctx, b, queue, &ds[i], h, log)
			if err != nil {
				return err
			}
			processed++
			if outcome == OutcomeDone || outcome == OutcomeDuplicate {
				pending = append(pending, &ds[i])
				outcomes = append(outcomes, outcome)
			} else {
				q.metrics.consume(queue, outcome, time.Since(start))
			}
		}
		return nil
	})
	if err != nil {
		// Nothing of the batch was stored: what was handled, and what the
		// batch never reached (a BEGIN that found the database locked), retry.
		for i := processed; i < len(ds); i++ {
			pending = append(pending, &ds[i])
		}
		log.Warn("batch not committed, its messages will retry", "messages", len(pending), "error", err)
		for _, d := range pending {
			outcome, rerr := q.retry(ctx, b, queue, d, err, log)
			q.metrics.consume(queue, outcome, time.Since(start))
			if rerr != nil {
				return rerr
			}
		}
		return nil
	}
	if len(pending) == 0 {
		return nil
	}
	for _, o := range outcomes {
		q.metrics.consume(queue, o, time.Since(start))
	}
	return pending[len(pending)-1].Ack(true)
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
