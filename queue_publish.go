package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
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

// TooLargeError is a message still over the broker's max_message_bytes,
// compressed where compression was on, or (Own) over the broker's own
// max_message_size, which it closed the channel for (Max 0 when it did
// not say). Its text names no broker.
type TooLargeError struct {
	Size, Max int64
	Own       bool
}

func (e *TooLargeError) Error() string {
	switch {
	case e.Own && e.Max > 0:
		return fmt.Sprintf("message of %d bytes is over the broker's own max_message_size of %d bytes (it named it closing a channel on a message over it): lower max_message_bytes to it", e.Size, e.Max)
	case e.Own:
		return fmt.Sprintf("message of %d bytes is over the broker's own max_message_size (the broker closed the channel on it): lower max_message_bytes to it", e.Size)
	}
	return fmt.Sprintf("message of %d bytes is over the broker's max_message_bytes (%d)", e.Size, e.Max)
}

// ClosedForSizeError is a publish within the broker's own
// max_message_size (Limit) whose channel the broker closed on another
// message, over it: not confirmed, not refused, and sent again
// (resendable).
type ClosedForSizeError struct{ Limit int64 }

func (e *ClosedForSizeError) Error() string {
	return fmt.Sprintf("the broker closed the channel on another message, over its own max_message_size (%d)", e.Limit)
}

func (e *ClosedForSizeError) Unwrap() error { return errConfirmLost }

// sizeRefusal reports whether the broker closed a channel for a message
// over its own max_message_size, and the size it named (0 when its words
// did not): RabbitMQ's 406 "message size 20971520 is larger than
// configured max size 16777216" (or "than max size", at its own ceiling).
func sizeRefusal(e *amqp.Error) (limit int64, ok bool) {
	if e.Code != amqp.PreconditionFailed {
		return 0, false
	}
	_, tail, ok := strings.Cut(e.Reason, "is larger than ")
	if !ok {
		return 0, false
	}
	tail = strings.TrimPrefix(tail, "configured ")
	tail, found := strings.CutPrefix(tail, "max size ")
	if !found {
		return 0, true
	}
	end := strings.IndexFunc(tail, func(r rune) bool { return r < '0' || r > '9' })
	if end < 0 {
		end = len(tail)
	}
	limit, err := strconv.ParseInt(tail[:end], 10, 64)
	if err != nil || limit <= 0 {
		return 0, true
	}
	return limit, true
}

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
	tracer  Tracer // the producer spans
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
func newPublisher(bc *brokerConn, metrics *Metrics, tracer Tracer) *publisher {
	return &publisher{bc: bc, metrics: metrics, tracer: tracer, sem: make(chan struct{}, maxInFlight)}
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
	start := time.Now()
	defer func() { p.metrics.publish(p.bc.broker.Index, traceID(ctx), err, time.Since(start)) }()
	sent, err := p.publishAll(ctx, []Outgoing{{exchange, key, msg}})
	if sent == 1 {
		return nil
	}
	return err
}

// Outgoing is one message to publish, and where.
type Outgoing struct {
	Exchange, Key string
	Msg           amqp.Publishing
}

// publishAll sends msgs in their order on one channel, then waits for their
// confirms until ctx ends: the broker takes them in that order. It returns
// how many of the first were confirmed before the first that was not, and
// why that one was not.
func (p *publisher) publishAll(ctx context.Context, msgs []Outgoing) (confirmed int, err error) {
	s, err := p.send(ctx, msgs, nil)
	if err != nil {
		return 0, err
	}
	return s.settle(ctx)
}

// sentBatch is a batch of messages sent in their order on one lane's channel,
// holding an in-flight place each and the lane until settle has awaited
// their confirms.
type sentBatch struct {
	p          *publisher
	l          *lane
	idle       bool // l goes back to the idle lanes once settled
	ch         *amqp.Channel
	returns    chan amqp.Return
	blockedSig chan struct{}
	msgs       []Outgoing
	dcs        []*amqp.DeferredConfirmation
	spans      []trace.Span
	taken      int   // the places in flight held (p.sem)
	short      error // why fewer than msgs were sent
}

// send sends msgs in their order on one channel and returns without
// waiting for their confirms: settle waits for them. With behind (a batch
// sent before and not yet settled) they go on its channel, after it, so
// that the broker takes them in order behind it; when that channel has
// closed, nothing is sent. An error: none was sent.
func (p *publisher) send(ctx context.Context, msgs []Outgoing, behind *sentBatch) (*sentBatch, error) {
	bc, b := p.bc, p.bc.broker
	s := &sentBatch{p: p, msgs: msgs, blockedSig: *bc.blockedSig.Load()}
	if bc.blocked.Load() != nil {
		// A refusal (bc.refused) does not stop a publish: only a confirmed
		// one can tell that the broker takes them again.
		return nil, bc.blockedError()
	}
	if behind == nil {
		conn, err := bc.connection(ctx)
		if err != nil {
			return nil, err
		}
		p.onConn(conn)
	}
	for s.taken < len(msgs) {
		select {
		case p.sem <- struct{}{}:
			s.taken++
		case <-ctx.Done():
			s.release()
			return nil, fmt.Errorf("publish to %s: %w", b, ErrPublishTimeout)
		case <-s.blockedSig:
			s.release()
			return nil, bc.blockedError()
		}
	}
	if behind != nil {
		if behind.ch.IsClosed() {
			s.release()
			return nil, fmt.Errorf("publish to %s: %w", b, errConfirmLost)
		}
		// The lane goes back when the last batch on it is settled.
		s.l, s.ch, s.returns = behind.l, behind.ch, behind.returns
		s.idle, behind.idle = behind.idle, false
	} else {
		s.l, s.idle = p.pickLane()
		ch, returns, err := s.l.channel(bc)
		if err != nil {
			s.release()
			return nil, fmt.Errorf("publish to %s: %w: %w", b, errConfirmLost, err)
		}
		s.ch, s.returns = ch, returns
	}
	s.dcs = make([]*amqp.DeferredConfirmation, 0, len(msgs))
	s.spans = p.startPublishes(ctx, msgs)
	for _, m := range msgs {
		dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, m.Exchange, m.Key, true, false, m.Msg)
		if err != nil {
			if len(s.dcs) == 0 {
				err = fmt.Errorf("publish to %s: %w: %w", b, errConfirmLost, err)
				endPublishes(s.spans, 0, err)
				s.release()
				return nil, err
			}
			s.short = fmt.Errorf("publish to %s: %w: the channel closed while sending", b, errConfirmLost)
			break // wait for those sent
		}
		bc.published.Add(1) // sent: the broker counts it, confirmed or not
		s.dcs = append(s.dcs, dc)
	}
	return s, nil
}

// settle waits for the confirms of what s sent, in their order, until ctx
// ends: it returns how many of the first were confirmed before the first
// that was not, and why that one was not. Call it once.
func (s *sentBatch) settle(ctx context.Context) (confirmed int, err error) {
	defer s.release()
	defer func() { endPublishes(s.spans, confirmed, err) }()
	for i, dc := range s.dcs {
		if err := s.p.await(ctx, s.l, s.ch, s.returns, dc, s.msgs[i], s.blockedSig); err != nil {
			return i, err
		}
	}
	return len(s.dcs), s.short
}

// release gives back the places in flight s holds, and its lane.
func (s *sentBatch) release() {
	for ; s.taken > 0; s.taken-- {
		<-s.p.sem
	}
	if s.l != nil {
		s.p.put(s.l, s.idle)
		s.l = nil
	}
}

// errConfirmLost is a publish whose channel or connection closed before
// its confirm came: PublishConfirmed sends it again on a fresh channel.
var errConfirmLost = errors.New("channel closed before the confirm")

// await waits for the confirm dc of m, sent on lane l's channel ch.
func (p *publisher) await(ctx context.Context, l *lane, ch *amqp.Channel, returns chan amqp.Return, dc *amqp.DeferredConfirmation,
	m Outgoing, blockedSig chan struct{}) error {
	bc, b := p.bc, p.bc.broker
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
				return fmt.Errorf("publish to %s: %w: %w: %w", b, ErrBrokerUnreachable, ErrUnconfirmed, errConfirmLost)
			}
			if e.Code == amqp.NotFound {
				// No such exchange (declare_topology = false, and none
				// declared): the broker takes publishes, none routed.
				return fmt.Errorf("publish to %s %q: %w: %s", b, m.Exchange, ErrUnroutable, e.Reason)
			}
			if limit, ok := sizeRefusal(e); ok {
				// RabbitMQ's max_message_size, below this broker's
				// max_message_bytes. The channel closed on one message
				// over it, and every publish on it not yet confirmed went
				// with it: only one over the limit is refused (sent again,
				// it would be refused again); the others are sent again.
				size := int64(len(m.Msg.Body))
				if limit > 0 {
					bc.sizeLimit.Store(limit)
					if size <= limit {
						return fmt.Errorf("publish to %s: %w", b, &ClosedForSizeError{Limit: limit})
					}
				}
				bc.log.Warn("the broker refused a message over its own max_message_size: set the broker's max_message_bytes to it",
					"broker", b.String(), "delivery_id", m.Msg.MessageId, "reason", fmt.Sprintf("%d %s", e.Code, e.Reason))
				return fmt.Errorf("publish to %s: %w", b, &TooLargeError{Size: size, Max: limit, Own: true})
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
	if l.wasReturned(returns, m.Msg.MessageId) {
		return fmt.Errorf("publish to %s %q: %w", b, m.Exchange+"/"+m.Key, ErrUnroutable)
	}
	return nil
}

// resendable reports whether a publish that failed with err may be
// confirmed if sent again at once on a fresh channel: it was nacked (a
// quorum queue without a leader for a moment), or its channel or
// connection closed before the confirm. A broker that blocks, refuses
// access, routes nowhere or cannot be dialed answers the same again.
func resendable(err error) bool {
	if errors.Is(err, ErrBrokerAccessRefused) || errors.Is(err, ErrUnroutable) || errors.Is(err, ErrBrokerBlocked) {
		return false
	}
	return errors.Is(err, errConfirmLost) || errors.Is(err, ErrBrokerRefused)
}

// resendPause is the wait before a publish is sent again, doubled per try
// up to resendPauseMax: a broker electing a queue's leader answers within
// seconds, and a nack comes back in a round trip.
const (
	resendPause    = 20 * time.Millisecond
	resendPauseMax = 500 * time.Millisecond
)

// PublishConfirmed publishes msg as Publish does, sending it again on a
// fresh channel (resendable) until it is confirmed or ctx ends: a copy
// that landed before its confirm was lost is a duplicate, stored once.
func (p *publisher) PublishConfirmed(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	pause := resendPause
	for {
		err := p.Publish(ctx, exchange, key, msg)
		if err == nil || !resendable(err) || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(pause):
		}
		pause = min(2*pause, resendPauseMax)
	}
}

// startPublishes begins the producer spans of msgs (startPublish), none
// while tracing is off.
func (p *publisher) startPublishes(ctx context.Context, msgs []Outgoing) []trace.Span {
	if !p.tracer.on() {
		return nil
	}
	spans := make([]trace.Span, len(msgs))
	for i := range msgs {
		_, spans[i] = p.tracer.startPublish(ctx, msgs[i].Exchange, msgs[i].Key, &msgs[i].Msg)
	}
	return spans
}

// endPublishes ends spans, the first confirmed of them confirmed, the rest
// failed with err.
func endPublishes(spans []trace.Span, confirmed int, err error) {
	for i, s := range spans {
		if i >= confirmed && err != nil {
			s.RecordError(err)
			s.SetStatus(codes.Error, "not confirmed")
		}
		s.End()
	}
}
