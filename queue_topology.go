package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The topology: its names, declaring it, and reading what its queues hold.

// One fanout exchange, four queues, each with -retry and -error.
const exchangeName = "github-exchange"

// Logical queue names; each has a -retry and an -error sibling.
const (
	queueGitHub    = "github"
	queueDatabase  = "github-database"
	queueHooks     = "github-hooks"
	queueForbidden = "github-forbidden"
)

var logicalQueues = []string{queueGitHub, queueDatabase, queueHooks, queueForbidden}

func retryQueue(q string) string { return q + "-retry" }
func errorQueue(q string) string { return q + "-error" }

// allQueues lists the 12 queues: each logical queue, its -retry and its -error.
func allQueues() []string {
	var qs []string
	for _, q := range logicalQueues {
		qs = append(qs, q, retryQueue(q), errorQueue(q))
	}
	return qs
}

// consumedQueues are the logical queues the workers of cfg read: all
// four, less github-hooks when the hooks worker is off (app_id = 0).
func consumedQueues(cfg *Config) []string {
	if cfg.GitHub.AppID > 0 {
		return logicalQueues
	}
	return []string{queueGitHub, queueDatabase, queueForbidden}
}

// quorumDeliveryLimit is the x-delivery-limit of quorum queues. A quorum
// queue counts every return of a message (a consumer's window ending hands
// back what it was sent) toward it, and RabbitMQ 4 sets 20 when none is
// given: a backlog could reach that without one failure. This is never
// reached before max_attempts, and a message past it is dead-lettered to
// its -retry queue and comes back, never dropped.
const quorumDeliveryLimit = 1_000_000

// queueType is the type every queue is declared with: queue.type, classic
// when it is not set.
func queueType(cfg QueueConfig) string { return cmp.Or(cfg.Type, "classic") }

// queueArgs are the arguments of queue name, one of the 12, as declared:
// its type, always explicit, so that a vhost whose default queue type is
// another (RabbitMQ 4's default_queue_type, Amazon MQ's quorum) changes
// nothing; the dead-letter routes of the retry cycle; the -retry queue's
// TTL.
func queueArgs(cfg QueueConfig, name string) amqp.Table {
	args := amqp.Table{"x-queue-type": queueType(cfg)}
	if cfg.Type == "quorum" {
		args["x-delivery-limit"] = int64(quorumDeliveryLimit)
	}
	for _, q := range logicalQueues {
		switch name {
		case q:
			args["x-dead-letter-exchange"], args["x-dead-letter-routing-key"] = "", retryQueue(q)
		case retryQueue(q):
			args["x-message-ttl"] = cfg.RetryTTL.Milliseconds()
			args["x-dead-letter-exchange"], args["x-dead-letter-routing-key"] = "", q
		}
	}
	return args
}

// declareTopology returns what declares github-exchange, the 12 queues
// (queueArgs) and the bindings on a connection.
func declareTopology(cfg QueueConfig) func(bc *brokerConn, conn *amqp.Connection) error {
	return func(bc *brokerConn, conn *amqp.Connection) error {
		ch, err := bc.channel(conn)
		if err != nil {
			return fmt.Errorf("declare topology: %w", err)
		}
		defer bc.closeChannel(conn, ch)
		_, err = call(bc, conn, "declare", func() (struct{}, error) {
			if err := ch.ExchangeDeclare(exchangeName, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
				return struct{}{}, fmt.Errorf("exchange %s: %w", exchangeName, err)
			}
			for _, name := range allQueues() {
				if _, err := ch.QueueDeclare(name, true, false, false, false, queueArgs(cfg, name)); err != nil {
					return struct{}{}, fmt.Errorf("queue %s: %w", name, err)
				}
			}
			for _, name := range []string{queueGitHub, queueDatabase} {
				if err := ch.QueueBind(name, "", exchangeName, false, nil); err != nil {
					return struct{}{}, fmt.Errorf("bind %s: %w", name, err)
				}
			}
			return struct{}{}, nil
		})
		if err != nil {
			return fmt.Errorf("declare topology: %w", err)
		}
		return nil
	}
}

// missingRoute names what of the webhooks' route is missing on the broker:
// github-exchange, or else the queues bound to it; nil when nothing is.
func (bc *brokerConn) missingRoute(ctx context.Context) ([]string, error) {
	conn, ch, err := bc.openChannel(ctx)
	if err != nil {
		return nil, err
	}
	_, err = call(bc, conn, "passive declare "+exchangeName, func() (struct{}, error) {
		return struct{}{}, ch.ExchangeDeclarePassive(exchangeName, amqp.ExchangeFanout, true, false, false, false, nil)
	})
	if isNotFound(err) {
		return []string{exchangeName}, nil // the 404 closed the channel
	}
	bc.closeChannel(conn, ch)
	if err != nil {
		return nil, err
	}
	_, missing, err := bc.inspect(ctx, []string{queueGitHub, queueDatabase})
	return missing, err
}

// isNotFound reports a 404 from a passive declare: the queue does not exist.
func isNotFound(err error) bool {
	var aerr *amqp.Error
	return errors.As(err, &aerr) && aerr.Code == amqp.NotFound
}

// readyCounts passive-declares each queue (see inspect) and returns its
// ready-message count. A queue that does not exist counts as 0: CloudAMQP
// deletes idle queues.
func (bc *brokerConn) readyCounts(ctx context.Context, queues []string) (map[string]int, error) {
	infos, _, err := bc.inspect(ctx, queues)
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
func (bc *brokerConn) readyCount(ctx context.Context, name string) (int, error) {
	counts, err := bc.readyCounts(ctx, []string{name})
	return counts[name], err
}

// queueInfo is what a passive declare tells of a queue.
type queueInfo struct {
	Ready     int `json:"ready"`
	Consumers int `json:"consumers"`
}

// inspect asks the broker for each of names with a passive declare: the ready
// messages and consumers of those that exist, and which do not. The declares
// share one channel, one round trip each: over a WAN link a channel opened
// and closed per queue tripled the time of every drain check. A queue that
// does not exist closes the channel (404), so the next declare opens another.
func (bc *brokerConn) inspect(ctx context.Context, names []string) (infos map[string]queueInfo, missing []string, err error) {
	b := bc.broker
	conn, err := bc.connection(ctx)
	if err != nil {
		return nil, nil, err
	}
	var ch *amqp.Channel
	defer func() {
		if ch != nil {
			bc.closeChannel(conn, ch)
		}
	}()
	infos = make(map[string]queueInfo, len(names))
	for _, name := range names {
		if ch == nil {
			if ch, err = bc.channel(conn); err != nil {
				return nil, nil, fmt.Errorf("%s on %s: %w", name, b, err)
			}
		}
		qi, err := call(bc, conn, "passive declare "+name, func() (amqp.Queue, error) {
			return ch.QueueDeclarePassive(name, true, false, false, false, nil)
		})
		if isNotFound(err) {
			ch = nil // the 404 closed it
			missing = append(missing, name)
			bc.metrics.ready(b.Index, name, 0)
			continue
		}
		if err != nil {
			return nil, nil, fmt.Errorf("%s on %s: %w", name, b, err)
		}
		bc.metrics.ready(b.Index, name, qi.Messages)
		infos[name] = queueInfo{Ready: qi.Messages, Consumers: qi.Consumers}
	}
	return infos, missing, nil
}
