package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The topology of SPEC §4.
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

// Errors callers branch on.
var (
	ErrBrokerUnreachable = errors.New("broker unreachable")
	ErrPublishTimeout    = errors.New("no publisher confirm in time")
	ErrPublishNacked     = errors.New("broker refused the message")
	ErrUnroutable        = errors.New("message routed to no queue")
	ErrCallTimeout       = errors.New("AMQP call timed out")
)

// Queues is the AMQP side of switchyard: one connection per broker, shared by
// every worker and the webhook endpoint, dialed on demand with backoff; channels
// are opened per use.
type Queues struct {
	cfg     QueueConfig
	log     *slog.Logger
	conns   []*brokerConn
	metrics *Metrics

	// Backoff between failed dials of one broker, doubled per failure up to
	// maxBackoff, with jitter. Fields so tests can shorten them.
	minBackoff, maxBackoff time.Duration
	// drainQuiet is how long a broker must stay empty, with no message in
	// a worker's hands, before Drained says so (see Drained).
	drainQuiet time.Duration
	// sizes are the message sizes seen per queue, for the windows.
	sizes messageSizes
	// lastDone is, per queue, when a message last ended done (a time.Time),
	// for the status page.
	lastDone sync.Map
}

// LastDone is when a message of queue last ended done in this process; zero
// when none has since the start.
func (q *Queues) LastDone(queue string) time.Time {
	t, _ := q.lastDone.Load(queue)
	v, _ := t.(time.Time)
	return v
}

// brokerConn is the one connection to one broker, and its publisher.
type brokerConn struct {
	broker *Broker
	lock   chan struct{} // a mutex that a context can give up on

	conn     *amqp.Connection
	pub      *publisher
	failures int
	retryAt  time.Time
	lastErr  error

	// inHand counts deliveries from this broker that a worker has taken and
	// not yet settled: the broker's ready counts do not show them.
	inHand atomic.Int64
}

// NewQueues prepares connections to the brokers; nothing is dialed yet.
// metrics may be nil (the commands that record none).
func NewQueues(cfg QueueConfig, brokers []*Broker, metrics *Metrics, log *slog.Logger) *Queues {
	q := &Queues{cfg: cfg, metrics: metrics, log: log, minBackoff: 200 * time.Millisecond, maxBackoff: 15 * time.Second, drainQuiet: time.Second}
	for _, b := range brokers {
		q.conns = append(q.conns, &brokerConn{broker: b, lock: make(chan struct{}, 1)})
	}
	return q
}

// Close closes every connection; whatever is in flight fails.
func (q *Queues) Close() error {
	var errs []error
	for _, bc := range q.conns {
		bc.lock <- struct{}{}
		if bc.conn != nil && !bc.conn.IsClosed() {
			if err := bc.conn.CloseDeadline(time.Now().Add(q.cfg.CallTimeout)); err != nil && !errors.Is(err, amqp.ErrClosed) {
				errs = append(errs, fmt.Errorf("close %s: %w", bc.broker, err))
			}
		}
		bc.conn, bc.pub = nil, nil
		<-bc.lock
	}
	return errors.Join(errs...)
}

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

// ReadyCounts passive-declares each queue on broker b, each on a throwaway
// channel (a 404 closes the channel), and returns its ready-message count. A
// queue that does not exist counts as 0: CloudAMQP deletes idle queues.
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

// Drained reports whether broker b holds no ready message in the main and
// -retry queues of the logical queues consumed (-error queues are terminal and
// do not count), and no worker of this process holds one of its messages.
// Ready counts miss two kinds of message: one in a worker's hands (unacked,
// and it may yet be nacked into -retry), and one that RabbitMQ is
// dead-lettering from -retry back to its queue at that instant. So the broker
// must look empty twice, drainQuiet apart, with nothing in hand either time.
//
// A queue that no worker of this configuration consumes (github-hooks with
// the hooks worker off) would hold the switch forever: it is left out, and a
// warning names it while it holds messages.
func (q *Queues) Drained(ctx context.Context, b *Broker, consumed []string) (bool, error) {
	var names []string
	for _, name := range consumed {
		names = append(names, name, retryQueue(name))
	}
	for check := 0; check < 2; check++ {
		if check > 0 {
			select {
			case <-ctx.Done():
				return false, ctx.Err()
			case <-time.After(q.drainQuiet):
			}
		}
		if q.conns[b.Index].inHand.Load() > 0 {
			return false, nil
		}
		counts, err := q.ReadyCounts(ctx, b, names)
		if err != nil {
			return false, err
		}
		for _, n := range counts {
			if n > 0 {
				return false, nil
			}
		}
		if q.conns[b.Index].inHand.Load() > 0 {
			return false, nil
		}
	}
	q.warnUnconsumed(ctx, b, consumed)
	return true, nil
}

// warnUnconsumed names the queues on b that hold messages no worker of this
// configuration reads: they do not hold a switch back, and stay where they are.
func (q *Queues) warnUnconsumed(ctx context.Context, b *Broker, consumed []string) {
	var names []string
	for _, name := range logicalQueues {
		if !slices.Contains(consumed, name) {
			names = append(names, name, retryQueue(name))
		}
	}
	if len(names) == 0 {
		return
	}
	counts, err := q.ReadyCounts(ctx, b, names)
	if err != nil {
		return
	}
	for _, name := range names {
		if counts[name] > 0 {
			q.log.Warn("queue holds messages that no worker of this configuration consumes; the switch does not wait for them",
				"broker", b.String(), "unconsumed_queue", name, "messages", counts[name])
		}
	}
}

// Reachable dials broker b if needed, for /readyz.
func (q *Queues) Reachable(ctx context.Context, b *Broker) error {
	_, _, err := q.conn(ctx, b)
	return err
}
