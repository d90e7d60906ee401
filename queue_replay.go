package main

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Replay is the replay command's work on one broker: basic_get from
// queue-error, publish to queue through the default exchange with a confirm,
// then ack. The retry history goes, so the message gets its attempts anew.
func (q *Queues) Replay(ctx context.Context, b *Broker, queue string, limit int) (int, error) {
	conn, ch, err := q.openChannel(ctx, b)
	if err != nil {
		return 0, err
	}
	defer q.closeChannel(conn, ch)
	n := 0
	for (limit <= 0 || n < limit) && ctx.Err() == nil {
		d, ok, err := q.get(conn, ch, errorQueue(queue))
		if err != nil || !ok {
			return n, err
		}
		headers := amqp.Table{}
		for k, v := range d.Headers {
			headers[k] = v
		}
		for _, k := range []string{"x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
			"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", hdrError, hdrAttempts} {
			delete(headers, k)
		}
		pctx, cancel := context.WithTimeout(ctx, q.cfg.PublishTimeout)
		err = q.Publish(pctx, b, "", queue, amqp.Publishing{Headers: headers, ContentType: d.ContentType,
			DeliveryMode: amqp.Persistent, MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type, Body: d.Body})
		cancel()
		if err != nil {
			_ = d.Nack(false, true)
			return n, err
		}
		if err := d.Ack(false); err != nil {
			return n, err
		}
		n++
	}
	return n, ctx.Err()
}
