package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace"
)

// Queues is the AMQP side of switchyard, one broker at a time: per broker a
// connection (queue_conn.go), shared by every worker and the webhook
// endpoint; a publisher on it (queue_publish.go); and a reader of its
// queues (queue_consume.go) that settles what it read (queue_settle.go).
// The topology is in queue_topology.go, replays in queue_replay.go.
type Queues struct {
	cfg     QueueConfig
	log     *slog.Logger
	conns   []*brokerConn
	pubs    []*publisher
	readers []*reader
	done    doneTimes
	// drainQuiet is how long a broker must stay empty, with no message in
	// a worker's hands, before Drained says so (see Drained).
	drainQuiet time.Duration
	// abandon ends the handling of every message in hand (Abandon).
	abandon context.CancelFunc
	// zstdReaders: whether every node reading the queues reads zstd
	// (SetZstdReaders, fit).
	zstdReaders atomic.Int32
	tracer      Tracer
}

// NewQueues prepares connections to the brokers; nothing is dialed yet.
// metrics may be nil (the commands that record none); publishes are spans
// of tp (the no-op provider: none).
func NewQueues(cfg QueueConfig, brokers []*Broker, metrics *Metrics, tp trace.TracerProvider, log *slog.Logger) *Queues {
	handling, abandon := context.WithCancel(context.Background())
	q := &Queues{cfg: cfg, log: log, drainQuiet: time.Second, done: newDoneTimes(), abandon: abandon, tracer: NewTracer(tp)}
	var onDial func(*brokerConn, *amqp.Connection) error
	if cfg.DeclareTopology {
		onDial = declareTopology(cfg)
	}
	sizes := &messageSizes{}
	for _, b := range brokers {
		bc := newBrokerConn(b, cfg.CallTimeout, onDial, metrics, log)
		pub := newPublisher(bc, metrics, q.tracer)
		q.conns = append(q.conns, bc)
		q.pubs = append(q.pubs, pub)
		q.readers = append(q.readers, &reader{
			settler: settler{bc: bc, pub: pub, maxAttempts: cfg.MaxAttempts, publishTimeout: cfg.PublishTimeout, metrics: metrics,
				done: q.done, handling: handling},
			prefetch: cfg.Prefetch, maxBatchBytes: cfg.MaxBatchBytes, sizes: sizes,
		})
	}
	return q
}

// Abandon ends the handling of every message in hand, at once: a
// transaction waiting on the database gives up and rolls back, and the
// messages are left unacknowledged (ErrAbandoned). Every connection is
// severed (closed without waiting for the broker), so that the broker
// gives them back now and a call waiting on a broker that does not answer
// fails now, not after call_timeout. A shutdown that outlasts
// shutdown_timeout calls it; nothing is handled or dialed after it.
func (q *Queues) Abandon() {
	q.abandon()
	for _, bc := range q.conns {
		bc.sever()
	}
}

// closeWithin is how long Close waits for each broker's close-ok, all
// brokers at once: a second, the margin serve has past shutdown_timeout.
const closeWithin = time.Second

// Close closes every connection, whatever is in flight failing, and
// waits for the goroutines they own: the block watchers and the lanes
// opening in the background.
func (q *Queues) Close() error {
	q.abandon()
	errs := make([]error, len(q.conns))
	var closing sync.WaitGroup
	for i, bc := range q.conns {
		closing.Go(func() { errs[i] = bc.close(min(bc.callTimeout, closeWithin)) })
	}
	closing.Wait()
	for _, p := range q.pubs {
		p.opening.Wait()
	}
	return errors.Join(errs...)
}

// LastDone is when a message of queue last ended done in this process; zero
// when none has since the start.
func (q *Queues) LastDone(queue string) time.Time { return q.done.last(queue) }

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

// Blocked reports whether broker b blocks its connection now, and why.
func (q *Queues) Blocked(b *Broker) (blockedState, bool) { return q.conns[b.Index].isBlocked() }

// PublishToTarget publishes msg to the broker the switch state names as the
// publish target now (a Pending Switch's target, else the active broker),
// sending it again while publish_timeout lasts when its confirm is lost
// (PublishConfirmed). It is the path by which republished deliveries reach
// a broker (webhooks take Prepare and PublishConfirmed, to spool what the
// broker does not confirm), and it returns the broker it chose.
func (q *Queues) PublishToTarget(ctx context.Context, brokers *Brokers, exchange, key string, msg amqp.Publishing) (*Broker, error) {
	b, msg, err := q.Prepare(brokers, msg)
	if err != nil {
		return b, err
	}
	ctx, cancel := context.WithTimeout(ctx, q.cfg.PublishTimeout)
	defer cancel()
	return b, q.PublishConfirmed(ctx, b, exchange, key, msg)
}

// Target is the broker the switch state names as the publish target now:
// a Pending Switch's target, else the active broker.
func (q *Queues) Target(brokers *Brokers) (*Broker, error) {
	return brokers.Get(brokers.Cached().PublishTarget())
}

// Prepare readies msg for the publish target (Target): compressed as
// queue.compress says, within its max_message_bytes (*TooLargeError).
func (q *Queues) Prepare(brokers *Brokers, msg amqp.Publishing) (*Broker, amqp.Publishing, error) {
	b, err := q.Target(brokers)
	if err != nil {
		return nil, msg, err
	}
	msg, err = q.fit(b, msg)
	return b, msg, err
}

// fit makes msg fit broker b: a body not yet encoded goes zstd-compressed
// when queue.compress is zstd and every node reading the queues reads it
// (SetZstdReaders), else gzip-compressed over queue.compress_over; one
// still over b's max_message_bytes is a *TooLargeError, refused here
// rather than by the broker (which closes the channel for it).
func (q *Queues) fit(b *Broker, msg amqp.Publishing) (amqp.Publishing, error) {
	if msg.ContentEncoding == "" {
		switch {
		case q.cfg.Compress == encodingZstd && q.zstdReaders.Load() == zstdAll:
			// A body too small to shrink, as the hooks queue's, goes as
			// it came: the reader keeps it and compresses it for the
			// disk.
			if z := compressZstd(msg.Body); len(z) < len(msg.Body) {
				msg.Body, msg.ContentEncoding = z, encodingZstd
			}
		case q.cfg.CompressOver > 0 && int64(len(msg.Body)) > q.cfg.CompressOver:
			msg.Body, msg.ContentEncoding = compressGzip(msg.Body), encodingGzip
		}
	}
	return msg, overMaxBytes(b, int64(len(msg.Body)))
}

// TooLarge is overMaxBytes, or a *TooLargeError (Own) when a message of size
// bytes is over the broker's own max_message_size as it named it on its
// connection (closing a channel on a message over it): the forwarder
// refuses such a row before it is sent, rather than have the broker close
// another channel on it and on the rows sent with it.
func (q *Queues) TooLarge(b *Broker, size int64) error {
	if own := q.conns[b.Index].sizeLimit.Load(); own > 0 && size > own {
		return &TooLargeError{Size: size, Max: own, Own: true}
	}
	return overMaxBytes(b, size)
}

// overMaxBytes is a *TooLargeError when a message of size bytes is over
// b's max_message_bytes; nil when it fits or the limit is not known.
func overMaxBytes(b *Broker, size int64) error {
	if b.MaxMessageBytes > 0 && size > b.MaxMessageBytes {
		return &TooLargeError{Size: size, Max: b.MaxMessageBytes}
	}
	return nil
}

// SetZstdReaders says whether every node that reads the queues reads
// zstd-compressed messages: until it is said, and while it is not so (a
// node of an older version runs), nothing is published zstd-compressed.
func (q *Queues) SetZstdReaders(all bool) {
	state := zstdNotAll
	if all {
		state = zstdAll
	}
	if q.zstdReaders.Swap(state) == state || q.cfg.Compress != encodingZstd {
		return
	}
	if all {
		q.log.Info("every live node reads zstd: webhooks are published zstd-compressed")
	} else {
		q.log.Warn("a live node does not read zstd (an older version): webhooks are published as before, gzip over queue.compress_over")
	}
}

// What SetZstdReaders was told; zero until it is.
const (
	zstdAll int32 = 1 + iota
	zstdNotAll
)

// Publish sends msg to broker b and waits for its publisher confirm until
// ctx ends (see publisher.Publish).
func (q *Queues) Publish(ctx context.Context, b *Broker, exchange, key string, msg amqp.Publishing) error {
	return q.pubs[b.Index].Publish(ctx, exchange, key, msg)
}

// PublishConfirmed publishes msg to broker b, sending it again on a fresh
// channel until it is confirmed or ctx ends (publisher.PublishConfirmed).
func (q *Queues) PublishConfirmed(ctx context.Context, b *Broker, exchange, key string, msg amqp.Publishing) error {
	return q.pubs[b.Index].PublishConfirmed(ctx, exchange, key, msg)
}

// Sent is a batch of messages sent to one broker, in their order on one
// channel, whose confirms are still to be awaited (Settle).
type Sent struct {
	q     *Queues
	b     *Broker
	s     *sentBatch
	start time.Time
	ctx   context.Context // the batch's: its traces, and its end
	// answered is made by the first call of Answered.
	answered chan struct{}
}

// Send publishes msgs to broker b on one channel, in their order, and
// returns without waiting for their confirms: Settle waits. With behind, a
// batch sent to b before and not yet settled, they follow it on its
// channel, so that the broker takes them in order after it (none is sent
// when that channel has closed): a window of publishes stays in flight
// across batches. An error: none was sent.
func (q *Queues) Send(ctx context.Context, b *Broker, msgs []Outgoing, behind *Sent) (*Sent, error) {
	var after *sentBatch
	if behind != nil {
		after = behind.s
	}
	start := time.Now()
	s, err := q.pubs[b.Index].send(ctx, msgs, after)
	if err != nil {
		q.observePublishes(ctx, b, msgs, 0, err, start)
		return nil, err
	}
	return &Sent{q: q, b: b, s: s, start: start, ctx: ctx}, nil
}

// Answered is closed once the broker has answered the last message Send
// sent (confirmed or not, or its channel closed), blocked the connection,
// or the batch's context (Send's) ended: Settle does not wait then. Call
// it from the goroutine that settles.
func (s *Sent) Answered() <-chan struct{} {
	if s.answered == nil {
		s.answered = make(chan struct{})
		last := s.s.dcs[len(s.s.dcs)-1].Done()
		go func() {
			defer close(s.answered)
			select {
			case <-last:
			case <-s.s.blockedSig:
			case <-s.ctx.Done():
			}
		}()
	}
	return s.answered
}

// Settle waits for the confirms of what Send sent until ctx ends: it
// returns how many of the first were confirmed, and why the next one was
// not. Call it once.
func (s *Sent) Settle(ctx context.Context) (int, error) {
	n, err := s.s.settle(ctx)
	s.q.observePublishes(s.ctx, s.b, s.s.msgs, n, err, s.start)
	return n, err
}

// observePublishes counts the publishes of msgs to b begun at start: the
// first n confirmed, the rest failed with err.
func (q *Queues) observePublishes(ctx context.Context, b *Broker, msgs []Outgoing, n int, err error, start time.Time) {
	p := q.pubs[b.Index]
	for i := range msgs {
		var e error
		if i >= n {
			e = err
		}
		p.metrics.publish(b.Index, traceID(q.tracer.traceOf(ctx, msgs[i].Msg.Headers)), e, time.Since(start))
	}
}

// Consume reads the queue o names on broker b until the window ends, stop
// is closed, or ctx is done, handling each message with o.Handle. A queue
// that does not exist is treated as empty for the window. The message in
// hand is always finished.
func (q *Queues) Consume(ctx context.Context, b *Broker, o ConsumeOptions, window time.Duration, stop <-chan struct{}) (int, error) {
	return q.readers[b.Index].consume(ctx, o, window, stop)
}

// Drain takes up to limit messages from the queue o names on broker b, the
// Leftover Drain, while unchanged says the broker state is the one it began
// on (see reader.drain).
func (q *Queues) Drain(ctx context.Context, b *Broker, o ConsumeOptions, limit int, unchanged func() bool) (int, error) {
	return q.readers[b.Index].drain(ctx, o, limit, unchanged)
}

// ReadyCounts is the ready messages of each of queues on broker b; a queue
// that does not exist holds none.
func (q *Queues) ReadyCounts(ctx context.Context, b *Broker, queues []string) (map[string]int, error) {
	return q.conns[b.Index].readyCounts(ctx, queues)
}

// Inspect reads all 12 queues on broker b, and which of them do not exist (a
// free plan deletes a queue nobody used for 28 days).
func (q *Queues) Inspect(ctx context.Context, b *Broker) (queues map[string]queueInfo, missing []string, err error) {
	return q.conns[b.Index].inspect(ctx, allQueues())
}

// Redeclare declares the topology on broker b again, as at connect.
func (q *Queues) Redeclare(ctx context.Context, b *Broker) error {
	bc := q.conns[b.Index]
	conn, err := bc.connection(ctx)
	if err != nil {
		return err
	}
	return declareTopology(q.cfg)(bc, conn)
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

// Routes fails when a webhook published to broker b now would not reach
// every queue it feeds: with declare_topology = false, github-exchange and
// the queues bound to it must exist (switchyard declares them itself otherwise,
// on every connection). For /readyz: every webhook would be refused.
func (q *Queues) Routes(ctx context.Context, b *Broker) error {
	if q.cfg.DeclareTopology {
		return nil
	}
	missing, err := q.conns[b.Index].missingRoute(ctx)
	if err != nil {
		return err
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s lacks %s (queue.declare_topology = false): %w", b, strings.Join(missing, ", "), ErrUnroutable)
	}
	return nil
}

// Back is closed once broker b's connection is dialed after its last
// failed dial: who waits out a failure of b is woken by it. It is nil
// (never closed) while no dial has failed since the last that succeeded:
// a failure on a live connection is waited out by time alone.
func (q *Queues) Back(b *Broker) <-chan struct{} {
	back := q.conns[b.Index].Back()
	if closed(back) {
		return nil
	}
	return back
}

// Reachable dials broker b if needed, for /readyz.
func (q *Queues) Reachable(ctx context.Context, b *Broker) error {
	_, err := q.conns[b.Index].connection(ctx)
	return err
}

// brokerProblem is what a public answer may say of a broker's failure: its
// kind, in a fixed text. Never the broker's own text, nor its host, port,
// vhost or user: on a hosted plan those are the account, and a webhook's
// answer is shown on GitHub's Recent Deliveries page. The cause goes to
// the log and to the operator's status.
func brokerProblem(err error) string {
	switch {
	case errors.Is(err, ErrBrokerAccessRefused):
		return "refuses access"
	case errors.Is(err, ErrBrokerBlocked):
		return "blocked"
	case errors.Is(err, ErrUnroutable):
		return "routes webhooks to no queue"
	case errors.Is(err, ErrBrokerRefused):
		return "refusing publishes"
	case errors.Is(err, ErrPublishTimeout), errors.Is(err, context.DeadlineExceeded):
		return "no confirm"
	}
	return "unreachable"
}
