package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The headers an -error message carries: why it is there, and after how
// many attempts when it exhausted its retries.
const (
	hdrErrorReason   = "x-error-reason"
	hdrErrorAttempts = "x-attempts"
)

// How consuming a message ends, in one place: done and duplicate
// are acked once their transaction committed; a permanent failure, a
// broken x-death or the last of max_attempts failures is published to
// QUEUE-error and acked; any other failure is nacked into QUEUE-retry.

// Message is one delivery as a consumer hands it over: the queue's plain
// view, with nothing of what the body means.
type Message struct {
	ID      string // message_id
	Type    string // type
	Headers amqp.Table
	// Body is the body inflated: valid until the handler of its batch
	// returns (ConsumeOptions.Handle), as its room is reused after.
	Body []byte
	// Zstd is Body as the message came, when it came zstd-compressed
	// (content_encoding zstd): a reader that keeps the body compressed
	// keeps these bytes rather than compress it again.
	Zstd      []byte
	Timestamp time.Time
	// Attempts is how often the message failed on this queue before
	// (its x-death count).
	Attempts int64
	// Broker is the broker it came from.
	Broker *Broker
	// Leftover says it came through a Leftover Drain: Broker is not the
	// active one.
	Leftover bool
}

// Header reads one header as text, whatever AMQP type carried it.
func (m *Message) Header(k string) string { return tableString(m.Headers, k) }

// BatchHandler handles a batch of messages, in order, and returns one
// verdict per message: nil when done, ErrDuplicate when it was done
// before, a Permanent error when no retry can help, any other error for a
// transient failure. err is a failure of the batch as a whole (a commit
// that failed): then no done or duplicate verdict stands, and those
// messages retry. The handler does not touch the broker: what the broker
// hears of the verdicts is the queue's job, after the handler returned.
// The messages' bodies are valid until it returns (Message.Body).
type BatchHandler func(ctx context.Context, msgs []Message) (verdicts []error, err error)

// permanentError marks a message that no retry can fix: it goes to -error.
type permanentError struct{ reason string }

func (e *permanentError) Error() string { return e.reason }

// permanent is the verdict for a message no retry can help.
func permanent(format string, args ...any) error {
	return &permanentError{reason: fmt.Sprintf(format, args...)}
}

// ErrDuplicate is the verdict for a message whose work was done before.
var ErrDuplicate = errors.New("duplicate delivery")

// Outcome is how consuming one message ended.
type Outcome string

const (
	OutcomeDone      Outcome = "done"
	OutcomeDuplicate Outcome = "duplicate"
	OutcomeRetry     Outcome = "retry"
	OutcomeError     Outcome = "error"
)

// outcomes are every Outcome, for the metrics' labels.
var outcomes = []string{string(OutcomeDone), string(OutcomeDuplicate), string(OutcomeRetry), string(OutcomeError)}

// doneTimes keeps, per logical queue, when a message last ended done
// (Unix nanoseconds), for the status page. The map is made once and only
// read after: each value is set atomically, with no allocation.
type doneTimes map[string]*atomic.Int64

func newDoneTimes() doneTimes {
	d := doneTimes{}
	for _, name := range logicalQueues {
		d[name] = new(atomic.Int64)
	}
	return d
}

// mark records that a message of queue ended done now.
func (d doneTimes) mark(queue string) {
	if v := d[queue]; v != nil {
		v.Swap(time.Now().UnixNano())
	}
}

// last is when a message of queue last ended done; zero when none has.
func (d doneTimes) last(queue string) time.Time {
	if v := d[queue]; v != nil {
		if ns := v.Load(); ns > 0 {
			return time.Unix(0, ns)
		}
	}
	return time.Time{}
}

// ConsumeOptions say what a consumer does with a queue's messages.
type ConsumeOptions struct {
	Queue  string
	Handle BatchHandler
	// Batch lets a window's half be handed over at once; otherwise each
	// message is handed over on its own.
	Batch bool
	Log   *slog.Logger
	// Attached, when set, is called each time a consumer of the queue is
	// attached: the worker is consuming again.
	Attached func()
	// HandBack, when set, closes when the messages in hand must be
	// handed back rather than settled: the handler cannot finish them
	// (its database is lost), and they are no fault of theirs. Their
	// handling ends at once, and they are left unacknowledged, for
	// another consumer, with no attempt burned.
	HandBack <-chan struct{}
	// leftover marks the messages of a Leftover Drain (Message.Leftover).
	leftover bool
}

// settler ends the messages of one broker by their verdicts: it acks them,
// nacks them into the retry cycle, or publishes them to -error.
type settler struct {
	bc             *brokerConn
	pub            *publisher
	maxAttempts    int
	publishTimeout time.Duration
	metrics        *Metrics
	done           doneTimes
	// handling is the parent of every batch's handling: Queues.Abandon
	// cancels it.
	handling context.Context
}

// handleTimeout bounds one batch's processing. It does not follow the
// worker's context: on shutdown the messages in hand are finished and acked,
// unless shutdown_timeout passes first (Queues.Abandon).
const handleTimeout = 2 * time.Minute

// ErrAbandoned is a batch whose handling Queues.Abandon ended: its
// messages are left unacknowledged, and the broker gives them back once
// the connection closes.
var ErrAbandoned = errors.New("messages in hand abandoned at shutdown")

// ErrHandedBack is a batch handed back (ConsumeOptions.HandBack, or a
// handler's error that wraps it): left unacknowledged, neither acked nor
// nacked into the retry cycle, so that the broker hands its messages to
// another consumer once the channel closes.
var ErrHandedBack = errors.New("messages in hand handed back, unacknowledged")

// whileOpen is a context that ends when ctx does or ch closes (a nil ch
// never does); stop ends it and waits for the goroutine that watches ch.
func whileOpen(ctx context.Context, ch <-chan struct{}) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		select {
		case <-ch:
			cancel()
		case <-ctx.Done():
		}
	})
	return ctx, func() { cancel(); wg.Wait() }
}

// deathCount is the attempt number of a message: the sum of the counts of
// its x-death entries for queue with reason rejected, i.e. how often it was
// nacked there. RabbitMQ keeps one such entry per queue and reason; LavinMQ
// up to 2.6.1 starts another whenever the dead-letter exchange differs, so
// the count is split over entries that name different exchanges, and
// reading one of them would let a message fail more than max_attempts
// times. ok is false when a count is negative or not an integer, or the
// sum overflows: the header is forged or broken, and no retry budget can be
// read from it.
func deathCount(h amqp.Table, queue string) (n int64, ok bool) {
	deaths, _ := h["x-death"].([]any)
	for _, d := range deaths {
		t, isTable := d.(amqp.Table)
		if !isTable || tableString(t, "queue") != queue || tableString(t, "reason") != "rejected" {
			continue
		}
		// RabbitMQ writes a long; a forged header may carry any type.
		var c int64
		switch v := reflect.ValueOf(t["count"]); {
		case v.CanInt():
			c = v.Int()
		case v.CanUint() && v.Uint() <= math.MaxInt64:
			c = int64(v.Uint())
		default:
			return 0, false
		}
		if c < 0 || n > math.MaxInt64-c {
			return 0, false
		}
		n += c
	}
	return n, true
}

// reasonBadDeath is the x-error-reason of a message whose x-death is broken.
const reasonBadDeath = "invalid x-death header"

// tableString reads a header as text, whatever AMQP type carried it.
func tableString(t amqp.Table, k string) string {
	switch v := t[k].(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case int64, int32, int16, int8, int, uint8, uint16, uint32, uint64:
		return fmt.Sprint(v)
	case nil:
		return ""
	default:
		return strings.TrimSpace(fmt.Sprint(v))
	}
}

// settled reports whether a verdict is one the caller acks: done or
// duplicate, whose writes (if any) commit with the transaction.
func settled(verdict error) (Outcome, bool) {
	switch {
	case verdict == nil:
		return OutcomeDone, true
	case errors.Is(verdict, ErrDuplicate):
		return OutcomeDuplicate, true
	}
	return "", false
}

// messageLog is the logger of one delivery.
func messageLog(log *slog.Logger, d *amqp.Delivery) *slog.Logger {
	if d.MessageId == "" {
		return log
	}
	return log.With("delivery_id", d.MessageId)
}

// finish tells the broker how a failed delivery ended: a permanent failure
// goes to -error, any other to the retry cycle. Only a failed ack or nack is
// returned: the channel is gone, and the broker will deliver the message
// again.
func (s *settler) finish(ctx context.Context, queue string, d *amqp.Delivery, verdict error, log *slog.Logger) (Outcome, error) {
	var perm *permanentError
	if errors.As(verdict, &perm) {
		return s.toError(ctx, queue, d, perm.reason, 0, log)
	}
	return s.retry(ctx, queue, d, verdict, log)
}

// retry ends a transient failure: nack, so the message waits retry_ttl in
// queue-retry, or once it has failed max_attempts times, publish it to
// queue-error with the reason and the attempts.
func (s *settler) retry(ctx context.Context, queue string, d *amqp.Delivery, cause error, log *slog.Logger) (Outcome, error) {
	attempts, _ := deathCount(d.Headers, queue) // checked in settleBatch
	if attempts >= int64(s.maxAttempts) {
		return s.toError(ctx, queue, d, cause.Error(), attempts+1, log)
	}
	log.Warn("transient failure, message will retry", "attempt", attempts+1, "error", cause)
	return OutcomeRetry, d.Nack(false, false)
}

// settleBatch hands deliveries, in order, to the handler, then settles each
// by its verdict: each failed one is nacked or moved to -error on its own,
// then the done and duplicate ones are acked with a single multiple ack,
// which covers exactly these (every other delivery up to the last of them
// was settled before). A message whose x-death is broken never reaches the
// handler: a count of -1,000,000 would otherwise buy a million retries.
// held is the size of the bodies handed over, inflated: what the batch
// held in memory, which the window is sized by.
func (s *settler) settleBatch(ds []amqp.Delivery, o ConsumeOptions) (held int64, err error) {
	queue, log := o.Queue, o.Log
	inHand := &s.bc.inHand
	defer inHand.Add(-int64(len(ds)))
	start := time.Now()
	ctx, cancel := context.WithTimeout(s.handling, handleTimeout)
	defer cancel()
	ctx, stop := whileOpen(ctx, o.HandBack)
	defer stop()
	verdicts := make([]error, len(ds))
	var msgs []Message
	var at []int // msgs[j] is ds[at[j]]
	// The bodies inflate into one room, given back for another batch: no
	// handler keeps a body past its batch (BatchHandler), and the
	// verdicts settle the deliveries as they came.
	need := 0
	for i := range ds {
		need += inflatedSize(ds[i].ContentEncoding, ds[i].Body)
	}
	room := takeInflateRoom(need)
	defer room.giveBack()
	for i := range ds {
		d := &ds[i]
		attempts, ok := deathCount(d.Headers, queue)
		if !ok {
			verdicts[i] = permanent("%s", reasonBadDeath)
			continue
		}
		body, err := room.body(d.ContentEncoding, d.Body)
		if err != nil {
			verdicts[i] = permanent("%v", err)
			continue
		}
		held += int64(len(body))
		m := Message{ID: d.MessageId, Type: d.Type, Headers: d.Headers, Body: body, Broker: s.bc.broker,
			Timestamp: d.Timestamp, Attempts: attempts, Leftover: o.leftover}
		if d.ContentEncoding == encodingZstd {
			m.Zstd = d.Body
		}
		msgs = append(msgs, m)
		at = append(at, i)
	}
	if len(msgs) > 0 {
		got, err := o.Handle(ctx, msgs)
		for j, i := range at {
			switch {
			case j < len(got):
				verdicts[i] = got[j]
			default:
				verdicts[i] = errors.New("no verdict from the handler")
			}
			if _, ok := settled(verdicts[i]); ok && err != nil {
				verdicts[i] = err
			}
		}
		if s.handling.Err() != nil {
			// Not a failure of the messages: neither nacked into the
			// retry cycle (an attempt they did not fail) nor acked.
			log.Warn("shutdown_timeout passed: messages in hand left unacknowledged, the broker gives them back", "messages", len(ds))
			return held, ErrAbandoned
		}
		if closed(o.HandBack) || errors.Is(err, ErrHandedBack) {
			log.Warn("messages in hand handed back unacknowledged: the broker gives them to another consumer", "messages", len(ds), "error", err)
			if errors.Is(err, ErrHandedBack) {
				return held, err
			}
			return held, fmt.Errorf("%w: %w", ErrHandedBack, cmp.Or(err, errors.New("handed back")))
		}
		if err != nil {
			log.Warn("batch not committed, its messages will retry", "messages", len(msgs), "error", err)
		}
	}
	last := -1
	for i := range ds {
		mlog := messageLog(log, &ds[i])
		outcome, ok := settled(verdicts[i])
		if !ok {
			var ferr error
			if outcome, ferr = s.finish(ctx, queue, &ds[i], verdicts[i], mlog); ferr != nil {
				return held, ferr
			}
		} else {
			if outcome == OutcomeDuplicate {
				mlog.Debug("duplicate delivery")
			}
			last = i
		}
		s.consumed(queue, outcome, start)
	}
	if last < 0 {
		return held, nil
	}
	return held, ds[last].Ack(true)
}

// consumed records how one message of queue ended.
func (s *settler) consumed(queue string, outcome Outcome, start time.Time) {
	s.metrics.messageEnded(queue, string(outcome), time.Since(start))
	if outcome == OutcomeDone {
		s.done.mark(queue)
	}
}

// toError publishes the delivery to queue-error on the broker it came from,
// with the reason, and acks it. If that publish fails the message is nacked
// instead, so it retries rather than vanishing.
func (s *settler) toError(ctx context.Context, queue string, d *amqp.Delivery, reason string, attempts int64, log *slog.Logger) (Outcome, error) {
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	headers[hdrErrorReason] = reason
	if attempts > 0 {
		headers[hdrErrorAttempts] = attempts
	}
	msg := amqp.Publishing{
		Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp.Persistent, MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type,
		CorrelationId: d.CorrelationId, AppId: d.AppId, Body: d.Body,
	}
	pctx, cancel := context.WithTimeout(ctx, s.publishTimeout)
	defer cancel()
	if err := s.pub.Publish(pctx, "", errorQueue(queue), msg); err != nil {
		log.Error("cannot move message to error queue, it will retry", "reason", reason, "error", err)
		return OutcomeRetry, d.Nack(false, false)
	}
	log.Error("message moved to error queue", "error_queue", errorQueue(queue), "reason", reason, "attempts", attempts)
	return OutcomeError, d.Ack(false)
}
