package main

import (
	"context"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The broker side of the topology: declaring it, and
// reading what the queues hold. The names are in queue.go; the fleet's
// keepalive and depth gauges (worker_fleet.go) and the drain check use these.

// declareTopology declares github-exchange, the 12 queues and the bindings.
func (q *Queues) declareTopology(conn *amqp.Connection) error {
	ch, err := q.channel(conn)
	if err != nil {
		return err
	}
	defer q.closeChannel(conn, ch)
	_, err = call(q, conn, "declare", func() (struct{}, error) {
		if err := ch.ExchangeDeclare(exchangeName, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
			return struct{}{}, fmt.Errorf("exchange %s: %w", exchangeName, err)
		}
		for _, name := range logicalQueues {
			for _, d := range []struct {
				name string
				args amqp.Table
			}{
				{name, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": retryQueue(name)}},
				{retryQueue(name), amqp.Table{"x-message-ttl": q.cfg.RetryTTL.Milliseconds(),
					"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name}},
				{errorQueue(name), nil},
			} {
				if _, err := ch.QueueDeclare(d.name, true, false, false, false, d.args); err != nil {
					return struct{}{}, fmt.Errorf("queue %s: %w", d.name, err)
				}
			}
		}
		for _, name := range []string{queueGitHub, queueDatabase} {
			if err := ch.QueueBind(name, "", exchangeName, false, nil); err != nil {
				return struct{}{}, fmt.Errorf("bind %s: %w", name, err)
			}
		}
		return struct{}{}, nil
	})
	return err
}

// isNotFound reports a 404 from a passive declare: the queue does not exist.
func isNotFound(err error) bool {
	var aerr *amqp.Error
	return errors.As(err, &aerr) && aerr.Code == amqp.NotFound
}

// ReadyCounts passive-declares each queue on broker b (see inspect) and
// returns its ready-message count. A queue that does not exist counts as 0:
// CloudAMQP deletes idle queues.
func (q *Queues) ReadyCounts(ctx context.Context, b *Broker, queues []string) (map[string]int, error) {
	infos, _, err := q.inspect(ctx, b, queues)
	if err != nil {
		return nil, err
	}
	counts := make(map[string]int, len(queues))
	for _, name := range queues {
		counts[name] = infos[name].Ready // a queue that does not exist holds none
	}
	return counts, nil
}

// readyCount is one queue's ready messages; one that does not exist holds
// none.
func (q *Queues) readyCount(ctx context.Context, b *Broker, name string) (int, error) {
	counts, err := q.ReadyCounts(ctx, b, []string{name})
	return counts[name], err
}

// queueInfo is what a passive declare tells of a queue.
type queueInfo struct {
	Ready     int `json:"ready"`
	Consumers int `json:"consumers"`
}

// inspect asks broker b for each of names with a passive declare: the ready
// messages and consumers of those that exist, and which do not. The declares
// share one channel, one round trip each: over a WAN link a channel opened
// and closed per queue tripled the time of every drain check. A queue that
// does not exist closes the channel (404), so the next declare opens another.
func (q *Queues) inspect(ctx context.Context, b *Broker, names []string) (infos map[string]queueInfo, missing []string, err error) {
	conn, _, err := q.conn(ctx, b)
	if err != nil {
		return nil, nil, err
	}
	var ch *amqp.Channel
	defer func() {
		if ch != nil {
			q.closeChannel(conn, ch)
		}
	}()
	infos = make(map[string]queueInfo, len(names))
	for _, name := range names {
		if ch == nil {
			if ch, err = q.channel(conn); err != nil {
				return nil, nil, fmt.Errorf("%s on %s: %w", name, b, err)
			}
		}
		qi, err := call(q, conn, "passive declare "+name, func() (amqp.Queue, error) {
			return ch.QueueDeclarePassive(name, true, false, false, false, nil)
		})
		if isNotFound(err) {
			ch = nil // the 404 closed it
			missing = append(missing, name)
			q.metrics.ready(b.Index, name, 0)
			continue
		}
		if err != nil {
			return nil, nil, fmt.Errorf("%s on %s: %w", name, b, err)
		}
		q.metrics.ready(b.Index, name, qi.Messages)
		infos[name] = queueInfo{Ready: qi.Messages, Consumers: qi.Consumers}
	}
	return infos, missing, nil
}

// Inspect reads all 12 queues on broker b, and which of them do not exist (a
// free plan deletes a queue nobody used for 28 days).
func (q *Queues) Inspect(ctx context.Context, b *Broker) (queues map[string]queueInfo, missing []string, err error) {
	return q.inspect(ctx, b, allQueues())
}

// Redeclare declares the topology on broker b again, as at connect.
func (q *Queues) Redeclare(ctx context.Context, b *Broker) error {
	conn, _, err := q.conn(ctx, b)
	if err != nil {
		return err
	}
	return q.declareTopology(conn)
}
