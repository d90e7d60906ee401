package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The topology: one fanout exchange, four queues, each with -retry and -error.
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
	// ErrBrokerBlocked is a publish refused at once because the broker
	// blocked the connection (connection.blocked: a resource alarm, or a
	// plan's quota): waiting out publish_timeout would change nothing.
	ErrBrokerBlocked = errors.New("broker blocked the connection")
)

// consumedQueues are the logical queues the workers of cfg read: all
// four, less github-hooks when the hooks worker is off (app_id = 0).
func consumedQueues(cfg *Config) []string {
	if cfg.GitHub.AppID > 0 {
		return logicalQueues
	}
	return []string{queueGitHub, queueDatabase, queueForbidden}
}

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
	// lastDone is, per logical queue, when a message last ended done
	// (Unix nanoseconds), for the status page. The map is made once and
	// only read after: each value is set atomically, with no allocation.
	lastDone map[string]*atomic.Int64
}

// LastDone is when a message of queue last ended done in this process; zero
// when none has since the start.
func (q *Queues) LastDone(queue string) time.Time {
	if v := q.lastDone[queue]; v != nil {
		if ns := v.Load(); ns > 0 {
			return time.Unix(0, ns)
		}
	}
	return time.Time{}
}

// markDone records that a message of queue ended done now.
func (q *Queues) markDone(queue string) {
	if v := q.lastDone[queue]; v != nil {
		v.Swap(time.Now().UnixNano())
	}
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
	// blocked is the broker's reason while it blocks the connection
	// (connection.blocked), nil otherwise; watchBlocked keeps it. The
	// channel blockedSig points to is closed when a block begins, so that
	// publishes waiting on the broker give up at once; a new one replaces
	// it when the block ends.
	blocked    atomic.Pointer[blockedState]
	blockedSig atomic.Pointer[chan struct{}]
	// published and delivered count the messages switchyard sent to this
	// broker (confirmed publishes) and took from it (basic.deliver and
	// basic.get-ok, redeliveries included) since TakeUsage last took them:
	// what a plan's quota counts.
	published, delivered atomic.Int64
}

// BrokerUsage is what one broker cost since the last TakeUsage.
type BrokerUsage struct {
	Broker               *Broker
	Published, Delivered int64
}

// TakeUsage returns, per broker, the messages counted since the last call,
// and starts counting again from zero. A caller that cannot keep them
// hands them back with ReturnUsage.
func (q *Queues) TakeUsage() []BrokerUsage {
	out := make([]BrokerUsage, 0, len(q.conns))
	for _, bc := range q.conns {
		out = append(out, BrokerUsage{Broker: bc.broker, Published: bc.published.Swap(0), Delivered: bc.delivered.Swap(0)})
	}
	return out
}

// ReturnUsage adds usage taken by TakeUsage back to the counts.
func (q *Queues) ReturnUsage(usage []BrokerUsage) {
	for _, u := range usage {
		bc := q.conns[u.Broker.Index]
		bc.published.Add(u.Published)
		bc.delivered.Add(u.Delivered)
	}
}

// blockedState is a block the broker announced: why, and since when.
type blockedState struct {
	Reason string
	Since  time.Time
}

// Blocked reports whether broker b blocks its connection now, and why.
func (q *Queues) Blocked(b *Broker) (blockedState, bool) {
	if st := q.conns[b.Index].blocked.Load(); st != nil {
		return *st, true
	}
	return blockedState{}, false
}

// watchBlocked follows the broker's connection.blocked and unblocked
// notifications for one connection until it closes (amqp091-go closes the
// channel then); a new connection starts unblocked.
func (q *Queues) watchBlocked(bc *brokerConn, notes <-chan amqp.Blocking) {
	for n := range notes {
		if n.Active {
			reason := cmp.Or(n.Reason, "no reason given")
			if bc.blocked.Swap(&blockedState{Reason: reason, Since: time.Now().UTC()}) == nil {
				close(*bc.blockedSig.Load()) // publishes in flight give up now
			}
			q.log.Warn("broker blocks publishing: webhooks answer 503 until it unblocks", "broker", bc.broker.String(), "reason", reason)
		} else {
			bc.unblock()
			q.log.Info("broker unblocked publishing", "broker", bc.broker.String())
		}
		q.metrics.brokerBlocked(bc.broker.Index, n.Active)
	}
	if bc.unblock() {
		q.metrics.brokerBlocked(bc.broker.Index, false)
	}
}

// unblock ends a block, if one holds, with a fresh signal for the next; it
// reports whether one held.
func (bc *brokerConn) unblock() bool {
	if bc.blocked.Swap(nil) == nil {
		return false
	}
	sig := make(chan struct{})
	bc.blockedSig.Swap(&sig)
	return true
}

// NewQueues prepares connections to the brokers; nothing is dialed yet.
// metrics may be nil (the commands that record none).
func NewQueues(cfg QueueConfig, brokers []*Broker, metrics *Metrics, log *slog.Logger) *Queues {
	q := &Queues{cfg: cfg, metrics: metrics, log: log, minBackoff: 200 * time.Millisecond, maxBackoff: 15 * time.Second, drainQuiet: time.Second,
		lastDone: map[string]*atomic.Int64{}}
	for _, name := range logicalQueues {
		q.lastDone[name] = new(atomic.Int64)
	}
	for _, b := range brokers {
		bc := &brokerConn{broker: b, lock: make(chan struct{}, 1)}
		sig := make(chan struct{})
		bc.blockedSig.Store(&sig)
		q.conns = append(q.conns, bc)
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
