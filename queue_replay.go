package main

import (
	"context"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// replayProgressEvery is how many moved messages Replay reports at a time.
const replayProgressEvery = 1000

// Replay is the replay command's work: basic_get from queue-error on broker
// from, publish to queue on broker to through the default exchange with a
// confirm, then ack. The retry history goes, so the message gets its attempts
// anew. It moves at most what queue-error held when it began (and at most
// limit, when positive): a replayed message that fails again is back in
// queue-error before long, and must not be taken again in the same run.
func (q *Queues) Replay(ctx context.Context, from, to *Broker, queue string, limit int, progress func(done, total int)) (moved, total int, err error) {
	src := q.conns[from.Index]
	conn, ch, err := src.openChannel(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer src.closeChannel(conn, ch)
	if total, err = src.readyCount(ctx, errorQueue(queue)); err != nil {
		return 0, 0, err
	}
	if limit > 0 {
		total = min(total, limit)
	}
	for moved < total && ctx.Err() == nil {
		d, ok, err := src.get(conn, ch, errorQueue(queue))
		if err != nil || !ok {
			return moved, total, err
		}
		if err := q.moveBack(ctx, &d, to, queue); err != nil {
			return moved, total, err
		}
		moved++
		if moved%replayProgressEvery == 0 && moved < total {
			progress(moved, total)
		}
	}
	return moved, total, ctx.Err()
}

// moveBack publishes an -error message d to queue on broker to, without
// its retry history (it gets its attempts anew), then acks it; if the
// publish fails it goes back where it was.
func (q *Queues) moveBack(ctx context.Context, d *amqp.Delivery, to *Broker, queue string) error {
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	for _, k := range []string{"x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
		"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", hdrErrorReason, hdrErrorAttempts} {
		delete(headers, k)
	}
	pctx, cancel := context.WithTimeout(ctx, q.cfg.PublishTimeout)
	err := q.Publish(pctx, to, "", queue, amqp.Publishing{Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp.Persistent, MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type, Body: d.Body})
	cancel()
	if err != nil {
		_ = d.Nack(false, true)
		return err
	}
	return d.Ack(false)
}

// isDelivery reports whether d carries delivery guid: as its message id, or
// in its X-GitHub-Delivery header.
func isDelivery(d *amqp.Delivery, guid string) bool {
	return d.MessageId == guid || tableString(d.Headers, "x-github-delivery") == guid
}

// maxReplayScan bounds how many -error messages ReplayOne looks through.
const maxReplayScan = 10000

// ReplayOne moves the message of delivery guid (its message id, or its
// X-GitHub-Delivery header) from queue-error on broker from back to queue on
// broker to, as Replay does, and leaves every other message where it was: it
// looks through what queue-error holds (at most maxReplayScan), taking them
// unacknowledged, and closing the channel puts them back in order. found is
// false when the message is not there: a second ask does nothing.
func (q *Queues) ReplayOne(ctx context.Context, from, to *Broker, queue, guid string) (found bool, err error) {
	src := q.conns[from.Index]
	conn, ch, err := src.openChannel(ctx)
	if err != nil {
		return false, err
	}
	defer src.closeChannel(conn, ch)
	total, err := src.readyCount(ctx, errorQueue(queue))
	if err != nil {
		return false, err
	}
	for range min(total, maxReplayScan) {
		d, ok, err := src.get(conn, ch, errorQueue(queue))
		if err != nil || !ok {
			return false, err
		}
		if isDelivery(&d, guid) {
			return true, q.moveBack(ctx, &d, to, queue)
		}
	}
	return false, ctx.Err()
}

// PeekErrors shows fn the messages queue-error on broker b holds (at most
// limit, when positive) and moves none: they are taken unacknowledged, and
// closing the channel puts them all back where they were.
func (q *Queues) PeekErrors(ctx context.Context, b *Broker, queue string, limit int, fn func(d *amqp.Delivery)) (int, error) {
	return q.peek(ctx, b, errorQueue(queue), limit, fn)
}

// PeekRetries shows fn the messages queue-retry on broker b holds, each
// waiting out retry_ttl after a passing failure, with how often it failed
// (its x-death count); like PeekErrors, it moves none (a message put back
// keeps the time it was due to leave).
func (q *Queues) PeekRetries(ctx context.Context, b *Broker, queue string, limit int, fn func(d *amqp.Delivery, failures int64)) (int, error) {
	return q.peek(ctx, b, retryQueue(queue), limit, func(d *amqp.Delivery) {
		n, _ := deathCount(d.Headers, queue)
		fn(d, n)
	})
}

// peek shows fn what the queue named name on broker b holds, at most limit
// when positive, and moves none.
func (q *Queues) peek(ctx context.Context, b *Broker, name string, limit int, fn func(d *amqp.Delivery)) (int, error) {
	bc := q.conns[b.Index]
	conn, ch, err := bc.openChannel(ctx)
	if err != nil {
		return 0, err
	}
	defer bc.closeChannel(conn, ch)
	total, err := bc.readyCount(ctx, name)
	if err != nil {
		return 0, err
	}
	if limit > 0 {
		total = min(total, limit)
	}
	n := 0
	for n < total && ctx.Err() == nil {
		d, ok, err := bc.get(conn, ch, name)
		if err != nil {
			return n, fmt.Errorf("get %s on %s: %w", name, b, err)
		}
		if !ok {
			break
		}
		fn(&d)
		n++
	}
	return n, ctx.Err()
}
