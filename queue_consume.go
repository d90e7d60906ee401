package main

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// batchGap, batchFilling and batchWindow close a batch that is not full: it
// waits for its next delivery up to batchGap, and once it holds
// batchFilling messages up to batchGap for every message it holds, at most
// until batchWindow after its first (batchWait). A lone webhook waits 2 ms
// for company, not the whole window: at a steady 200/s a webhook's time to
// its row drops to about a third of what a batch that always takes the
// window costs (BENCHMARKS.md). A batch that is filling waits longer for
// the next, so a backlog still fills it while a broker on the same cores is
// slow to send; the window bounds what a steady stream adds to its first
// message. The few webhooks that queue behind a commit's WAL checkpoint are
// not a backlog: had they waited as one, each would have waited out the
// window as well, which showed in the p99. The price is more commits at
// high rates, a tenth more of the daemon's CPU per webhook at 1,100/s, which
// no rate showed.
const (
	batchGap     = 2 * time.Millisecond
	batchFilling = 8
	batchWindow  = 10 * time.Millisecond
)

// batchWait is how long a batch of held messages whose window ends at until
// waits for its next delivery.
func batchWait(held int, until time.Time) time.Duration {
	gap := batchGap
	if held >= batchFilling {
		gap = time.Duration(held) * batchGap
	}
	return min(gap, time.Until(until))
}

// firstMessageSize is what a queue's messages are taken to weigh before
// one was seen: pessimistic, so that a first window of 1 MB payloads stays
// within max_batch_bytes; it adapts after the first batch.
const firstMessageSize = 1 << 20

// reader reads one broker's queues: consumers whose windows follow the
// sizes of the messages seen, handing batches to a handler and settling
// them by its verdicts.
type reader struct {
	settler
	prefetch      int
	maxBatchBytes int64
	sizes         *messageSizes // shared by every broker's reader
}

// window is a consumer's prefetch for queue: at most queue.prefetch unacked
// messages, and no more than queue.max_batch_bytes of them by the sizes seen
// so far (inflated, as they are held). RabbitMQ's prefetch counts messages, not bytes, and amqp091-go
// holds every message the broker sent in memory: with 1 MB payloads a count
// alone would hold prefetch megabytes per consumer.
func (r *reader) window(queue string) int {
	avg := r.sizes.get(queue)
	return max(1, min(r.prefetch, int(r.maxBatchBytes/avg)))
}

// batchFull tells when a batch of n messages and size bytes is complete:
// half the window, so that the broker sends the next half while this one
// commits, or half of max_batch_bytes.
func (r *reader) batchFull(win, n int, size int64) bool {
	return n >= max(1, win/2) || size >= r.maxBatchBytes/2
}

// messageSizes keeps, per queue, a moving average of message sizes.
type messageSizes struct {
	mu  sync.Mutex
	avg map[string]int64
}

func (m *messageSizes) get(queue string) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if v, ok := m.avg[queue]; ok {
		return max(v, 1)
	}
	return firstMessageSize
}

// observe folds a batch of n messages of size bytes in total into the
// average: the first batch replaces the pessimistic guess, and after it each
// message moves the average half way to the batch's mean. So the average
// follows the number of messages seen, not how they fell into batches (a
// batch closed by batchGap or batchWindow before it was full counts as much
// per message as a full one): eight messages of a new size bring it within
// 1/256 of it.
func (m *messageSizes) observe(queue string, n int, size int64) {
	if n == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.avg == nil {
		m.avg = map[string]int64{}
	}
	mean := size / int64(n)
	if v, ok := m.avg[queue]; ok {
		mean += (v - mean) >> min(n, 62)
	}
	m.avg[queue] = mean
}

// consumer is one basic.consume of a queue, on a channel of its own, with
// a window (its prefetch).
type consumer struct {
	bc         *brokerConn
	conn       *amqp.Connection
	ch         *amqp.Channel
	queue, tag string
	win        int
	deliveries <-chan amqp.Delivery
}

// consumerSeq numbers the consumers' tags, which close cancels by.
var consumerSeq atomic.Int64

// startConsumer starts a consumer of queue on conn with window win. A queue
// that does not exist is an error isNotFound tells.
func startConsumer(bc *brokerConn, conn *amqp.Connection, queue string, win int) (*consumer, error) {
	tag := fmt.Sprintf("switchyard-%d", consumerSeq.Add(1))
	ch, err := bc.channel(conn)
	if err != nil {
		return nil, err
	}
	deliveries, err := call(bc, conn, "consume "+queue, func() (<-chan amqp.Delivery, error) {
		if err := ch.Qos(win, 0, false); err != nil {
			return nil, err
		}
		return ch.Consume(queue, tag, false, false, false, false, nil)
	})
	if err != nil {
		if !isNotFound(err) {
			bc.closeChannel(conn, ch) // a 404 has closed it already
		}
		return nil, bc.refusal("consume", err)
	}
	return &consumer{bc: bc, conn: conn, ch: ch, queue: queue, tag: tag, win: win, deliveries: deliveries}, nil
}

// close ends the consumer; what the broker sent it and it did not settle goes
// back to the queue.
func (c *consumer) close() {
	// Cancelled first, the consumer hands over what the broker sent it and
	// it had not: counted, as the broker counted them, and left unacked, so
	// that closing the channel puts them back in the queue, in order.
	if _, err := call(c.bc, c.conn, "cancel "+c.queue, func() (struct{}, error) { return struct{}{}, c.ch.Cancel(c.tag, false) }); err == nil {
		t := time.NewTimer(c.bc.callTimeout)
		defer t.Stop()
	drain:
		for {
			select {
			case _, ok := <-c.deliveries:
				if !ok {
					break drain
				}
				c.bc.delivered.Add(1)
			case <-t.C:
				break drain
			}
		}
	}
	c.bc.closeChannel(c.conn, c.ch)
}

// resize starts the consumer again with the window r's message sizes call
// for (at most limit), when it is at least twice or at most half the current
// one. RabbitMQ applies a basic.qos only to consumers started after it, so
// the channel is closed (the messages it was sent and had not handed over go
// back to the queue, in order) and another opened: a few round trips, paid
// when the sizes change, not per batch. Call it with nothing in hand.
func (c *consumer) resize(r *reader, limit int) error {
	win := min(r.window(c.queue), limit)
	if win < c.win*2 && win > c.win/2 {
		return nil
	}
	c.close()
	next, err := startConsumer(c.bc, c.conn, c.queue, win)
	if err != nil {
		return err
	}
	*c = *next
	return nil
}

// consume reads the queue until the window ends, stop is closed,
// or ctx is done, handling each message with o.Handle. A queue that does not
// exist is treated as empty for the window. The message in hand is always
// finished.
func (r *reader) consume(ctx context.Context, o ConsumeOptions, window time.Duration, stop <-chan struct{}) (int, error) {
	queue, log := o.Queue, o.Log
	bc, b := r.bc, r.bc.broker
	conn, err := bc.connection(ctx)
	if err != nil {
		return 0, err
	}
	timer := time.NewTimer(window)
	defer timer.Stop()
	c, err := startConsumer(bc, conn, queue, r.window(queue))
	if (err == nil || isNotFound(err)) && o.Attached != nil {
		o.Attached()
	}
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
	defer func() { c.close() }()

	n := 0
	for {
		select {
		case <-ctx.Done():
			return n, nil
		case <-timer.C:
			return n, nil
		case <-stop:
			return n, nil
		case d, ok := <-c.deliveries:
			if !ok {
				return n, fmt.Errorf("consume %s on %s: %w: channel closed", queue, b, ErrBrokerUnreachable)
			}
			bc.delivered.Add(1)
			ds, _, err := r.handleBatch(ctx, c, d, math.MaxInt, o, nil)
			n += len(ds)
			if err != nil {
				return n, err
			}
			if err := c.resize(r, r.prefetch); err != nil {
				return n, fmt.Errorf("consume %s on %s: %w", queue, b, err)
			}
		}
	}
}

// handleBatch is the one batch loop of the consumer's window and the
// Leftover Drain: it takes first, and whatever else the broker sends close
// behind it (batchGap, batchWindow) up to max messages and the window's
// bytes, into one batch that is handled with one commit and one ack. A
// delivery counts as delivered when it arrives (the broker bills it
// whether or not it is handled) and as in hand once taken. take, when set,
// is asked before each is taken: once it says no, that delivery is not
// handled (closing the channel gives it back, in order), the batch ends
// and refused says so. first is taken already (delivered counted).
func (r *reader) handleBatch(ctx context.Context, c *consumer, first amqp.Delivery, max int, o ConsumeOptions,
	take func() bool) (ds []amqp.Delivery, refused bool, err error) {
	bc := r.bc
	bc.inHand.Add(1)
	ds = []amqp.Delivery{first}
	size := int64(len(first.Body))
	until := time.Now().Add(batchWindow)
	for o.Batch && len(ds) < max && !r.batchFull(c.win, len(ds), size) {
		d, ok := receive(ctx, c.deliveries, batchWait(len(ds), until))
		if !ok {
			break
		}
		bc.delivered.Add(1)
		if take != nil && !take() {
			refused = true
			break
		}
		bc.inHand.Add(1)
		ds = append(ds, d)
		size += int64(len(d.Body))
	}
	held, err := r.settleBatch(ds, o)
	if err != nil {
		return ds, refused, fmt.Errorf("settle on %s: %w", bc.broker, err)
	}
	// The window counts the bodies as inflated: a compressed message
	// takes its full size in hand.
	if held > size {
		size = held
	}
	r.sizes.observe(o.Queue, len(ds), size)
	return ds, refused, nil
}

// receive waits up to wait for the next delivery; ok is false when none
// came, the channel closed, or ctx ended. With no time left it takes one
// only if one is there.
func receive(ctx context.Context, deliveries <-chan amqp.Delivery, wait time.Duration) (amqp.Delivery, bool) {
	if wait <= 0 {
		select {
		case d, ok := <-deliveries:
			return d, ok
		default:
			return amqp.Delivery{}, false
		}
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case d, ok := <-deliveries:
		return d, ok
	case <-t.C:
	case <-ctx.Done():
	}
	return amqp.Delivery{}, false
}

// drainIdle is the shortest a Leftover Drain waits for a delivery before it
// takes the queue to be empty; the wait is longer on a slower link.
const drainIdle = 100 * time.Millisecond

// drain takes up to limit messages from queue and handles each
// like a consumed one: the Leftover Drain. It takes at most what
// the queue held when it began and returns as soon as it has them, or when
// none came for a while (another consumer took them), instead of waiting out
// a window. Messages come through a consumer with the worker's window, not a
// basic_get each: over a WAN link a basic_get is a round trip per message
// (20 a second at 50 ms), a window is many at once.
//
// Each delivery is taken only while unchanged says the broker state is still the
// one the drain began on: once it changed (the broker was named a Pending
// Switch's target, say), nothing more is handled, and closing the channel
// puts every message not yet acked back in the queue, in order.
func (r *reader) drain(ctx context.Context, o ConsumeOptions, limit int, unchanged func() bool) (int, error) {
	queue, batch := o.Queue, o.Batch
	o.leftover = true
	if limit <= 0 {
		return 0, nil
	}
	bc, b := r.bc, r.bc.broker
	conn, err := bc.connection(ctx)
	if err != nil {
		return 0, err
	}
	ready, err := bc.readyCount(ctx, queue)
	if err != nil || ready == 0 {
		return 0, err
	}
	want := min(limit, ready)
	win := min(r.window(queue), want)
	if !batch {
		win = 1
	}
	start := time.Now()
	c, err := startConsumer(bc, conn, queue, win)
	if isNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("consume %s on %s: %w", queue, b, err)
	}
	defer func() { c.close() }()
	idle := max(drainIdle, 3*time.Since(start))

	n := 0
	for n < want && ctx.Err() == nil {
		d, ok := receive(ctx, c.deliveries, idle)
		if ok {
			bc.delivered.Add(1) // delivered, handled or not
		}
		if !ok || !unchanged() {
			break // empty for a while, the channel closed, or the state changed
		}
		ds, changed, err := r.handleBatch(ctx, c, d, want-n, o, unchanged)
		n += len(ds)
		if err != nil || changed {
			return n, err
		}
		if batch && n < want {
			if err := c.resize(r, want); err != nil {
				return n, fmt.Errorf("drain %s on %s: %w", queue, b, err)
			}
		}
	}
	return n, nil
}
