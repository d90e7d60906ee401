package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Errors a publish ends with, besides those of the connection.
var (
	ErrPublishTimeout = errors.New("no publisher confirm in time")
	ErrUnroutable     = errors.New("message routed to no queue")
	// ErrUnconfirmed is a publish sent whose confirm did not come (in
	// time, or the broker blocked the connection first): the message may
	// still reach the queues.
	ErrUnconfirmed = errors.New("sent, not confirmed")
)

// maxInFlight bounds the publishes awaiting a confirm on one broker. It also
// bounds the returns that can wait in a lane's buffer (see wasReturned), so
// every lane holds a buffer of that many amqp.Return (264 bytes each) for as
// long as it is open, always live, and the collector lets the heap grow to
// GOGC's multiple of what is live: the bound is kept as low as still lets
// the confirms of a WAN link pipeline faster than two cores store, and
// above what a burst of webhooks asks at once.
const maxInFlight = 256

// confirmLanes is how many confirm channels a broker's publisher spreads its
// publishes over. RabbitMQ runs each channel as one process, so a single
// channel serializes every publish of the daemon through it. A publish takes
// an idle lane when there is one and pipelines behind a busy one only when
// all are busy, which comes close to a channel per concurrent publisher
// while keeping the channels a plan counts few (BENCHMARKS.md has the
// measurements).
const confirmLanes = 16

// publisher is one broker's publishing: up to confirmLanes confirm-mode
// channels on its current connection, shared by every concurrent
// publisher: confirms pipeline, each caller waiting on its own deferred
// confirmation. The lanes are opened by the first publish on a
// connection, never by a connection opened for anything else.
type publisher struct {
	bc      *brokerConn
	metrics *Metrics
	sem     chan struct{}
	// opening are the goroutines opening lanes in the background, each
	// ending once its channel is open or failed, within call_timeout;
	// Queues.Close waits for them.
	opening sync.WaitGroup

	mu    sync.Mutex
	conn  *amqp.Connection    // the connection the lanes are on; nil before the first publish
	lanes *[confirmLanes]lane // new with each connection
	idle  []*lane             // lanes with no publish in flight, the last used on top
	next  int                 // the busy lane the next publish pipelines behind
}

// lane is one confirm channel and the returns (unroutable messages) it got.
type lane struct {
	// usable: a publish may take or pipeline behind this lane; false until
	// its channel is first opened in the background (lane 0's is opened at
	// once, and a publish on it waits for that). Guarded by publisher.mu.
	usable bool

	conn *amqp.Connection // set when made, never changed

	mu       sync.Mutex
	ch       *amqp.Channel
	returns  chan amqp.Return
	returned map[string]int // message ids returned as unroutable, not yet claimed
	// closes tells why the broker closed ch; closeErr keeps what it told,
	// for every publish that was on ch.
	closes   chan *amqp.Error
	closeErr *amqp.Error
}

// newPublisher prepares publishing on the connection bc keeps; nothing is
// opened before the first publish.
func newPublisher(bc *brokerConn, metrics *Metrics) *publisher {
	return &publisher{bc: bc, metrics: metrics, sem: make(chan struct{}, maxInFlight)}
}

// onConn readies the lanes for conn: when it is not the connection they are
// on, they start afresh on it, the first one opening at once in the
// background (a publish on it waits for that), so that the first webhooks
// on a new connection wait one round trip, not three. The goroutines it
// starts end once their channel is open or failed, within call_timeout.
func (p *publisher) onConn(conn *amqp.Connection) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conn == conn {
		return
	}
	p.conn, p.lanes, p.next, p.idle = conn, new([confirmLanes]lane), 0, nil
	for i := len(p.lanes) - 1; i >= 0; i-- {
		p.lanes[i].conn = conn
		p.idle = append(p.idle, &p.lanes[i])
	}
	p.lanes[0].usable = true
	lane := &p.lanes[0]
	p.opening.Go(func() { _, _, _ = lane.channel(p.bc) })
}

// pickLane returns a lane for one publish: an idle one if there is one, else a
// busy one to pipeline behind. put gives it back when the confirm is in.
// Idle lanes are taken last in, first out, so a daemon that never has more
// than a few webhooks in flight keeps using (and opening) only a few
// channels: shared broker plans count them.
//
// Opening a channel costs two round trips (channel.open, confirm.select),
// 100 ms at 50 ms away: a burst on a fresh connection would pay them on
// every lane at once. So no publish waits for a lane to open but behind the
// first (onConn opens it); when every lane in use is busy, the next
// is opened in the background while the publish pipelines behind one that
// is.
func (p *publisher) pickLane() (l *lane, idle bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	// Lanes never opened stay at the bottom of idle (every lane put back
	// or warmed goes on top), so the top one tells.
	if n := len(p.idle); n > 0 {
		l := p.idle[n-1]
		p.idle = p.idle[:n-1]
		if l.usable {
			return l, true
		}
		p.opening.Go(func() { p.warm(l) })
	}
	for {
		p.next = (p.next + 1) % confirmLanes
		if p.lanes[p.next].usable {
			return &p.lanes[p.next], false
		}
	}
}

// warm opens lane l's channel in the background, then makes it an idle lane
// publishes take; one that failed to open is opened by the publish that
// takes it.
func (p *publisher) warm(l *lane) {
	_, _, _ = l.channel(p.bc)
	p.mu.Lock()
	if l.conn == p.conn { // else the lanes started afresh on another connection
		l.usable = true
		p.idle = append(p.idle, l)
	}
	p.mu.Unlock()
}

func (p *publisher) put(l *lane, idle bool) {
	if idle {
		p.mu.Lock()
		if l.conn == p.conn {
			p.idle = append(p.idle, l)
		}
		p.mu.Unlock()
	}
}

// channel returns the lane's confirm channel, opening a new one on its
// connection when the last closed.
func (l *lane) channel(bc *brokerConn) (*amqp.Channel, chan amqp.Return, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ch != nil && !l.ch.IsClosed() {
		return l.ch, l.returns, nil
	}
	ch, err := bc.channel(l.conn)
	if err != nil {
		return nil, nil, err
	}
	if _, err := call(bc, l.conn, "confirm select", func() (struct{}, error) { return struct{}{}, ch.Confirm(false) }); err != nil {
		bc.closeChannel(l.conn, ch)
		return nil, nil, err
	}
	l.ch = ch
	l.returns = ch.NotifyReturn(make(chan amqp.Return, maxInFlight))
	l.returned = map[string]int{}
	// amqp091-go sends the close reason once, before it resolves the
	// channel's outstanding confirms as nacks: a buffer of one takes it.
	l.closes, l.closeErr = ch.NotifyClose(make(chan *amqp.Error, 1)), nil
	return ch, l.returns, nil
}

// closedBy is why the broker closed ch, the lane's channel a publish was
// on: a channel error (Recover: the connection lives on) is the broker
// refusing what was sent on it; nil when the connection went, or the lane
// has moved to another channel since.
func (l *lane) closedBy(ch *amqp.Channel) *amqp.Error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ch != l.ch {
		return nil
	}
	if l.closeErr == nil {
		select {
		case e := <-l.closes:
			l.closeErr = e
		default:
		}
	}
	if l.closeErr == nil || !l.closeErr.Recover {
		return nil
	}
	return l.closeErr
}

// wasReturned claims a return for msgID. RabbitMQ sends basic.return before the
// basic.ack of the same message, and amqp091-go hands the return to the
// buffered channel before it processes the ack, so once a confirm is in, its
// return (if any) is already in the buffer: draining it here, after the
// confirm, cannot miss one. The buffer never fills, as at most maxInFlight
// publishes are outstanding and each drains after its confirm.
func (l *lane) wasReturned(returns chan amqp.Return, msgID string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if returns != l.returns {
		return false // the channel was replaced; its confirm was a real one
	}
drain:
	for {
		select {
		case r, ok := <-returns:
			if !ok {
				break drain
			}
			l.returned[r.MessageId]++
		default:
			break drain
		}
	}
	if l.returned[msgID] > 0 {
		l.returned[msgID]--
		if l.returned[msgID] == 0 {
			delete(l.returned, msgID)
		}
		return true
	}
	return false
}

// Publish sends msg and waits for its publisher confirm until ctx ends.
// Messages are mandatory: one that reaches no queue (a queue deleted on the
// broker) is an error, never a silent success.
func (p *publisher) Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) (err error) {
	bc, b := p.bc, p.bc.broker
	start := time.Now()
	defer func() { p.metrics.publish(b.Index, err, time.Since(start)) }()
	blockedSig := *bc.blockedSig.Load()
	if bc.blocked.Load() != nil {
		// A refusal (bc.refused) does not stop a publish: only a confirmed
		// one can tell that the broker takes them again.
		return bc.blockedError()
	}
	conn, err := bc.connection(ctx)
	if err != nil {
		return err
	}
	p.onConn(conn)
	select {
	case p.sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("publish to %s: %w", b, ErrPublishTimeout)
	case <-blockedSig:
		return bc.blockedError()
	}
	defer func() { <-p.sem }()

	l, idle := p.pickLane()
	defer p.put(l, idle)
	ch, returns, err := l.channel(bc)
	if err != nil {
		return fmt.Errorf("publish to %s: %w", b, err)
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		return fmt.Errorf("publish to %s: %w", b, err)
	}
	bc.published.Add(1) // sent: the broker counts it, confirmed or not
	select {
	case <-dc.Done():
	case <-ctx.Done():
		return fmt.Errorf("publish to %s: %w: %w", b, ErrUnconfirmed, ErrPublishTimeout)
	case <-blockedSig:
		// The broker blocked the connection: no confirm comes while it
		// holds, so the webhook is told at once, not after publish_timeout.
		return fmt.Errorf("%w: %w", ErrUnconfirmed, bc.blockedError())
	}
	if !dc.Acked() {
		// amqp091-go resolves outstanding confirms as nacks when the
		// channel closes: a channel error is the broker refusing (LavinMQ
		// low on disk closes it with 406), a closed connection is the
		// broker gone.
		refusal := &BrokerRefusal{Kind: ErrBrokerRefused, Reason: "publish nacked"}
		if ch.IsClosed() {
			e := l.closedBy(ch)
			if e == nil {
				return fmt.Errorf("publish to %s: %w: channel closed before the confirm", b, ErrBrokerUnreachable)
			}
			if e.Code == amqp.NotFound {
				// No such exchange (declare_topology = false, and none
				// declared): the broker takes publishes, none routed.
				return fmt.Errorf("publish to %s %q: %w: %s", b, exchange, ErrUnroutable, e.Reason)
			}
			refusal.Reason = fmt.Sprintf("channel closed: %d %s", e.Code, e.Reason)
			// A user without the write permission: 403 on the channel.
			if r, ok := bc.refusal("publish", e).(*BrokerRefusal); ok {
				refusal = r
			}
		}
		bc.refuse(refusal)
		return fmt.Errorf("publish to %s: %w", b, refusal)
	}
	bc.confirmed()
	if l.wasReturned(returns, msg.MessageId) {
		return fmt.Errorf("publish to %s %q: %w", b, exchange+"/"+key, ErrUnroutable)
	}
	return nil
}
