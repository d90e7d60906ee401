package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

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
		switch c := t["count"].(type) {
		case int64:
			n = c
		case int32:
			n = int64(c)
		case int16:
			n = int64(c)
		case int8:
			n = int64(c)
		case int:
			n = int64(c)
		case uint8:
			n = int64(c)
		case uint16:
			n = int64(c)
		case uint32:
			n = int64(c)
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

// batchLinger is the longest a consumer waits for the next delivery of a
// batch; it bounds the latency a batch adds to its first message.
const batchLinger = 2 * time.Millisecond

// batchSize is the most messages one transaction takes: half the prefetch
// window, so that the broker sends the next half while this one commits.
func (q *Queues) batchSize() int {
	return max(1, q.cfg.Prefetch/2)
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

// Consume reads queue on broker b until the window ends, stop is closed, or ctx
// is done, handling each message with h. A queue that does not exist is
// treated as empty for the window. The message in hand is always finished.
func (q *Queues) Consume(ctx context.Context, b *Broker, queue string, window time.Duration, stop <-chan struct{}, h Handler, batch Batcher, log *slog.Logger) (int, error) {
	conn, ch, err := q.openChannel(ctx, b)
	if err != nil {
		return 0, err
	}
	defer q.closeChannel(conn, ch)

	timer := time.NewTimer(window)
	defer timer.Stop()
	deliveries, err := call(q, conn, "consume "+queue, func() (<-chan amqp.Delivery, error) {
		if err := ch.Qos(q.cfg.Prefetch, 0, false); err != nil {
			return nil, err
		}
		return ch.Consume(queue, "", false, false, false, false, nil)
	})
	if isNotFound(err) {
		log.Warn("queue does not exist on broker, treating it as empty", "queue", queue)
		select {
		case <-ctx.Done():
		case <-timer.C:
		case <-stop:
		}
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("consume %s on %s: %w", queue, b, err)
	}

	n := 0
	for {
		select {
		case <-ctx.Done():
			return n, nil
		case <-timer.C:
			return n, nil
		case <-stop:
			return n, nil
		case d, ok := <-deliveries:
			if !ok {
				return n, fmt.Errorf("consume %s on %s: %w: channel closed", queue, b, ErrBrokerUnreachable)
			}
			q.conns[b.Index].inHand.Add(1)
			// Whatever else the broker already sent joins this message's
			// batch: one commit and one ack for all. amqp091-go hands
			// deliveries over one at a time from its own goroutine, so wait
			// a moment (batchLinger) for the next rather than none at all.
			ds := []amqp.Delivery{d}
			if batch != nil && q.batchSize() > 1 {
				linger := time.NewTimer(batchLinger)
			more:
				for len(ds) < q.batchSize() {
					select {
					case d, ok := <-deliveries:
						if !ok {
							break more
						}
						q.conns[b.Index].inHand.Add(1)
						ds = append(ds, d)
					case <-linger.C:
						break more
					}
				}
				linger.Stop()
			}
			if err := q.settleBatch(b, queue, ds, h, batch, log); err != nil {
				return n, fmt.Errorf("settle on %s: %w", b, err)
			}
			n += len(ds)
		}
	}
}

// get is one basic_get with call_timeout; ok is false when the queue is empty.
func (q *Queues) get(conn *amqp.Connection, ch *amqp.Channel, queue string) (amqp.Delivery, bool, error) {
	type got struct {
		d  amqp.Delivery
		ok bool
	}
	g, err := call(q, conn, "get "+queue, func() (got, error) {
		d, ok, err := ch.Get(queue, false)
		return got{d, ok}, err
	})
	return g.d, g.ok, err
}

// Drain takes up to limit messages from queue on broker b with basic_get and
// handles each like a consumed one, returning as soon as the queue is empty
// instead of waiting out a window. It is the Leftover Drain of SPEC §8. Each
// basic_get runs inside guard; when guard declines (the broker state changed),
// the drain stops.
func (q *Queues) Drain(ctx context.Context, b *Broker, queue string, limit int, guard func(func()) bool, h Handler, batch Batcher, log *slog.Logger) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	conn, _, err := q.conn(ctx, b)
	if err != nil {
		return 0, err
	}
	if ready, err := q.readyCount(conn, b, queue); err != nil || ready == 0 {
		return 0, err
	}
	ch, err := q.channel(conn)
	if err != nil {
		return 0, err
	}
	defer q.closeChannel(conn, ch)
	// basic_get has no window to keep full: a batch takes a whole prefetch.
	size := 1
	if batch != nil {
		size = q.cfg.Prefetch
	}
	n := 0
	for n < limit && ctx.Err() == nil {
		var ds []amqp.Delivery
		var getErr error
		stop := false
		for len(ds) < min(size, limit-n) {
			var d amqp.Delivery
			var ok bool
			if !guard(func() { d, ok, getErr = q.get(conn, ch, queue) }) {
				stop = true // the state changed: take no more, finish what was taken
				break
			}
			if isNotFound(getErr) {
				getErr = nil
			}
			if getErr != nil || !ok {
				stop = true
				break
			}
			q.conns[b.Index].inHand.Add(1)
			ds = append(ds, d)
		}
		if len(ds) > 0 {
			if err := q.settleBatch(b, queue, ds, h, batch, log); err != nil {
				return n, fmt.Errorf("settle on %s: %w", b, err)
			}
			n += len(ds)
		}
		if getErr != nil {
			return n, fmt.Errorf("get %s on %s: %w", queue, b, getErr)
		}
		if stop {
			return n, nil
		}
	}
	return n, nil
}
