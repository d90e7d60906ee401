package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// The spool: a webhook the broker has not confirmed within
// queue.spool_after, or that a broker refusing, blocked or away cannot
// take, is committed to the store (spooled_webhooks) and answered 202 all
// the same, so that the broker's bad minute costs GitHub, which never
// retries, nothing. While the spool holds anything, every new webhook goes
// in behind it, so that they reach the broker in the order they came; one
// spool drain (the spool job's lease holder) publishes it oldest first,
// with confirms, to where the endpoint would publish; once it is empty
// the endpoint publishes directly again.

// ErrSpoolFull is a webhook the spool cannot take: it holds
// queue.spool_max_bytes already.
var ErrSpoolFull = errors.New("the spool is full (queue.spool_max_bytes)")

// errSpoolRefused is a webhook the store did not take into the spool.
var errSpoolRefused = errors.New("the spool did not take it")

// errBehindSpool is why a webhook went to the spool without trying the
// broker: the spool held earlier ones.
var errBehindSpool = errors.New("behind earlier spooled webhooks")

// spoolBatch is how many spooled webhooks one publish of the drain sends
// before it waits for their confirms, and one transaction marks published.
const spoolBatch = 128

// spoolEvery is how often the spool's state is read again (the gauges,
// and whether another node spooled), and how often the drain tries a
// broker that did not take the spool: a returning broker is noticed
// within it.
const spoolEvery = time.Second

// Spool takes the webhooks the broker does not confirm in time, and
// drains them.
type Spool struct {
	store    *Store
	queues   *Queues
	brokers  *Brokers
	node     string
	after    time.Duration // queue.spool_after
	timeout  time.Duration // queue.publish_timeout
	maxBytes int64         // 0: no spool
	log      *slog.Logger

	mu sync.Mutex
	// holding: the spool holds webhooks (or is about to): new ones go in
	// behind them. Set by a webhook spooled, or by the state read; cleared
	// only under mu once nothing is pending or being written and the
	// store holds none (release).
	holding bool
	// pending are the webhooks waiting for the writer; writing is whether
	// a webhook's request is writing a group of them now.
	pending []*spoolWrite
	writing bool
	// state is the spool as last read; added the bytes spooled since;
	// commits counts the groups committed, so that a read that a commit
	// overtook is not taken for the spool's state.
	state   SpoolState
	added   int64
	addedN  int64
	commits uint64
	// fullBy is the size of the last webhook the spool was too full to
	// take, until there is room for it: Full.
	fullBy int64
	// kick wakes the drain when something was spooled.
	kick chan struct{}
}

// spoolWrite is one webhook waiting to be committed to the spool.
type spoolWrite struct {
	row  SpooledWebhook
	done chan error
}

// NewSpool builds the spool of cfg over store and queues.
func NewSpool(cfg *Config, store *Store, brokers *Brokers, queues *Queues, metrics *Metrics, log *slog.Logger) *Spool {
	s := &Spool{store: store, queues: queues, brokers: brokers, node: cfg.Server.NodeName, after: cfg.Queue.SpoolAfter,
		timeout: cfg.Queue.PublishTimeout, maxBytes: cfg.Queue.SpoolMaxBytes, log: log.With("component", "spool"),
		kick: make(chan struct{}, 1)}
	if metrics != nil {
		metrics.GaugeFunc("switchyard_spool_messages", "Webhooks answered 202 that wait in the spool for the broker to confirm them.",
			func(context.Context) (int, error) { return int(s.State().Messages), nil })
		metrics.GaugeFunc("switchyard_spool_bytes", "Bytes of the webhooks waiting in the spool, against queue.spool_max_bytes.",
			func(context.Context) (int, error) { return int(s.State().Bytes), nil })
		metrics.GaugeFunc("switchyard_spool_oldest_age_seconds", "Age of the oldest webhook waiting in the spool; 0 when none waits.",
			func(context.Context) (int, error) {
				if o := s.State().Oldest; o != nil {
					return int(time.Since(*o).Seconds()), nil
				}
				return 0, nil
			})
	}
	return s
}

// On reports whether webhooks may be spooled (queue.spool_max_bytes > 0).
func (s *Spool) On() bool { return s != nil && s.maxBytes > 0 }

// State is the spool as last read, with what this node spooled since.
func (s *Spool) State() SpoolState {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.state
	st.Bytes += s.added
	st.Messages += s.addedN
	return st
}

// Full reports whether the spool refused a webhook for want of room, and
// has no room for it yet.
func (s *Spool) Full() bool {
	if !s.On() {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fullBy > 0 && s.state.Bytes+s.added+s.fullBy > s.maxBytes
}

// Spooling reports whether new webhooks go to the spool now.
func (s *Spool) Spooling() bool {
	if !s.On() {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.holding
}

// Accepted is what became of a webhook the door took: published and
// confirmed on Broker, or spooled for it.
type Accepted struct {
	Broker  *Broker
	Spooled bool
}

// Take makes msg durable: published to the publish target and confirmed
// within queue.spool_after, else committed to the spool. While the spool
// holds anything msg goes in behind it. It fails with a *TooLargeError
// (never spooled), or when neither the broker confirmed nor the spool took
// it: the error then joins both causes. A webhook the spool cannot take
// behind others tries the broker, out of their order, rather than be
// refused. Without a spool it publishes as before, waiting publish_timeout
// for the confirm. bodyDone is called once msg no longer refers to the
// request's body (compressed into bytes of its own).
func (s *Spool) Take(ctx context.Context, exchange, key string, msg amqp.Publishing, bodyDone func()) (Accepted, error) {
	encoded := msg.ContentEncoding
	b, msg, err := s.queues.Prepare(s.brokers, msg)
	var tooLarge *TooLargeError
	if err != nil && (errors.As(err, &tooLarge) || b == nil) {
		return Accepted{Broker: b}, err
	}
	if msg.ContentEncoding != encoded {
		bodyDone() // compressed into bytes of its own: the request's body is free
	}
	if !s.On() {
		pctx, cancel := context.WithTimeout(ctx, s.timeout)
		defer cancel()
		return Accepted{Broker: b}, s.queues.PublishConfirmed(pctx, b, exchange, key, msg)
	}
	publish := func() error {
		pctx, cancel := context.WithTimeout(ctx, s.after)
		defer cancel()
		return s.queues.PublishConfirmed(pctx, b, exchange, key, msg)
	}
	err = errBehindSpool
	if !s.Spooling() {
		if err = publish(); err == nil {
			return Accepted{Broker: b}, nil
		}
		if ctx.Err() != nil || !spoolable(err) {
			return Accepted{Broker: b}, err // the client left, or waiting changes nothing
		}
	}
	serr := s.writeTraced(ctx, spooledRow(s.node, b, exchange, key, msg, err))
	if serr == nil {
		return Accepted{Broker: b, Spooled: true}, nil
	}
	if errors.Is(err, errBehindSpool) {
		// The spool cannot take it behind the others: the broker may,
		// out of their order, rather than GitHub losing it.
		if err = publish(); err == nil {
			return Accepted{Broker: b}, nil
		}
	}
	if !errors.Is(serr, ErrSpoolFull) {
		serr = fmt.Errorf("%w: %w", errSpoolRefused, serr)
	}
	return Accepted{Broker: b}, errors.Join(err, serr)
}

// writeTraced is write in a span of the delivery's trace: the spool's
// write, its producer's part until the drain publishes it.
func (s *Spool) writeTraced(ctx context.Context, row SpooledWebhook) error {
	if !tracingOn.Load() {
		return s.write(ctx, row)
	}
	ctx, span := tracer.Start(ctx, "spool "+row.Exchange, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("messaging.message.id", row.GUID), attribute.String("switchyard.spool.reason", row.Reason)))
	err := s.write(ctx, row)
	endSpan(span, err)
	return err
}

// spoolable reports whether a webhook the broker did not take for err
// may wait in the spool: the broker away, blocked, refusing publishes or
// not confirming in time. A broker that refuses switchyard's user, routes
// the webhook to no queue or refuses it for its size answers the same
// after any wait: those are the operator's to fix, and the webhook is
// answered as before.
func spoolable(err error) bool {
	var tooLarge *TooLargeError
	return !errors.Is(err, ErrBrokerAccessRefused) && !errors.Is(err, ErrUnroutable) && !errors.As(err, &tooLarge)
}

// spooledRow is msg as the spool keeps it, meant for broker b, which did
// not take it for why.
func spooledRow(node string, b *Broker, exchange, key string, msg amqp.Publishing, why error) SpooledWebhook {
	headers := map[string]string{}
	for k, v := range msg.Headers {
		if s, ok := v.(string); ok {
			headers[k] = s
		}
	}
	h, _ := json.Marshal(headers) // strings only: cannot fail
	hook := HookID(-1)
	if id, err := parseHookID(headers[hdrHookID]); err == nil {
		hook = HookID(id)
	}
	return SpooledWebhook{GUID: msg.MessageId, Hook: hook, Event: msg.Type, ReceivedAt: msg.Timestamp, SpooledAt: time.Now(),
		Node: node, Broker: b.Index, Reason: spoolReason(why), Exchange: exchange, Key: key, Headers: string(h),
		ContentEncoding: msg.ContentEncoding, Body: msg.Body}
}

// spoolReason is why a webhook was spooled, in the words of a public
// answer: the broker's failure by its kind, or the spool ahead of it.
func spoolReason(why error) string {
	if errors.Is(why, errBehindSpool) {
		return why.Error()
	}
	return "broker " + brokerProblem(why)
}

// publishing is the message a spooled row holds.
func (w *SpooledWebhook) publishing() (Outgoing, error) {
	headers := map[string]string{}
	if err := json.Unmarshal([]byte(w.Headers), &headers); err != nil {
		return Outgoing{}, fmt.Errorf("spooled delivery %s: headers: %w", w.GUID, err)
	}
	table := amqp.Table{}
	for k, v := range headers {
		table[k] = v
	}
	return Outgoing{Exchange: w.Exchange, Key: w.Key, Msg: amqp.Publishing{ContentType: "application/json",
		ContentEncoding: w.ContentEncoding, DeliveryMode: amqp.Persistent, MessageId: w.GUID, Type: w.Event,
		Timestamp: w.ReceivedAt, Headers: table, Body: w.Body}}, nil
}

// write commits row to the spool behind everything spooled before it, and
// returns once it is committed. Webhooks spooled at once commit together:
// the first of them writes the group, the others wait for it, so that one
// commit (one fsync) covers many.
func (s *Spool) write(ctx context.Context, row SpooledWebhook) error {
	w := &spoolWrite{row: row, done: make(chan error, 1)}
	s.mu.Lock()
	if s.state.Bytes+s.added+row.size() > s.maxBytes {
		s.fullBy = row.size()
		s.mu.Unlock()
		return ErrSpoolFull
	}
	s.holding = true
	s.added += row.size()
	s.addedN++
	s.pending = append(s.pending, w)
	lead := !s.writing
	s.writing = true
	s.mu.Unlock()
	if lead {
		s.writeGroups()
	}
	select {
	case err := <-w.done:
		return err
	case <-ctx.Done():
		// The client left; the write goes on, and what it spools is
		// published: a duplicate at worst.
		return ctx.Err()
	}
}

// writeGroups commits what is pending, group after group, until nothing
// is: the webhook's request that found no writer writes for everyone.
func (s *Spool) writeGroups() {
	for {
		s.mu.Lock()
		group := s.pending
		s.pending = nil
		if len(group) == 0 {
			s.writing = false
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
		rows := make([]SpooledWebhook, len(group))
		for i, w := range group {
			rows[i] = w.row
		}
		// Not the request's context: the group is others' too.
		ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
		err := s.store.WriteTx(ctx, func(tx *Tx) error {
			tx.Pipeline()
			return tx.Spool(ctx, rows)
		})
		cancel()
		if err != nil {
			s.mu.Lock()
			for _, w := range group {
				s.added -= w.row.size()
				s.addedN--
			}
			s.mu.Unlock()
			s.log.Warn("webhooks not spooled: the database did not take them", "webhooks", len(group), "error", err)
		}
		s.mu.Lock()
		s.commits++
		s.mu.Unlock()
		for _, w := range group {
			w.done <- err
		}
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

// Watch reads the spool's state every spoolEvery until ctx ends: for the
// gauges and the status, so that webhooks go in behind what another node
// (or this one before a restart) spooled, and so that the endpoint
// publishes directly again once the spool is empty.
func (s *Spool) Watch(ctx context.Context) error {
	if !s.On() {
		return nil
	}
	t := time.NewTicker(spoolEvery)
	defer t.Stop()
	for {
		s.refresh(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// refresh reads the spool's state; an empty spool lets the endpoint
// publish directly again, once nothing of this node's waits to be written.
func (s *Spool) refresh(ctx context.Context) {
	s.mu.Lock()
	commits := s.commits
	s.mu.Unlock()
	rctx, cancel := context.WithTimeout(ctx, spoolEvery)
	defer cancel()
	st, err := s.store.SpoolState(rctx)
	if err != nil {
		return // the state stays as last read; the spool keeps what it holds
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.writing || len(s.pending) > 0 || s.commits != commits {
		return // a group written since is not in st: read again next time
	}
	s.state, s.added, s.addedN = st, 0, 0
	if st.Messages > 0 {
		s.holding = true
		return
	}
	if s.holding {
		s.holding = false
		s.log.Info("the spool is empty: webhooks are published directly again")
	}
}

// Drain publishes the spool, oldest first, to the publish target, until
// ctx ends; it runs under the spool job's lease (on SQLite, the node's),
// publishing only while h is held and marking what it published under it.
// A broker that takes nothing is tried again every spoolEvery.
func (s *Spool) Drain(ctx context.Context, h Holding) error {
	if !s.On() {
		<-ctx.Done()
		return nil
	}
	var lastErr string
	lastPrune := time.Time{}
	for {
		// After a failure only the oldest webhook goes, once a second: a
		// broker that nacks (a queue over its length, a quota) costs a
		// message a second, not a batch, until it takes one again.
		limit := spoolBatch
		if lastErr != "" {
			limit = 1
		}
		n, err := s.drainBatch(ctx, h, limit)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			if lastErr == "" {
				// Once, not every second: the log says when it ends.
				s.log.Warn("the spool waits: the broker did not take its oldest webhooks", "error", err)
				lastErr = err.Error()
			}
		case n > 0:
			if lastErr != "" {
				s.log.Info("the broker takes the spool's webhooks again")
				lastErr = ""
			}
			continue
		default:
			s.refresh(ctx)
			if time.Since(lastPrune) > time.Hour {
				lastPrune = time.Now()
				s.prune(ctx, h)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-s.kick:
			if err != nil {
				// The broker failed a moment ago: the next try waits
				// its second, not the next webhook.
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(spoolEvery):
				}
			}
		case <-time.After(spoolEvery):
		}
	}
}

// drainBatch publishes the spool's oldest webhooks, up to limit, in
// order on one channel, and marks those confirmed published. It returns
// how many it published.
func (s *Spool) drainBatch(ctx context.Context, h Holding, limit int) (int, error) {
	rows, err := s.store.SpoolHead(ctx, limit)
	if err != nil || len(rows) == 0 || !h.Held() {
		return 0, err
	}
	b, err := s.queues.Target(s.brokers)
	if err != nil {
		return 0, err
	}
	msgs := make([]Outgoing, 0, len(rows))
	for i := range rows {
		m, err := rows[i].publishing()
		if err != nil {
			return 0, err
		}
		msgs = append(msgs, m)
	}
	pctx, cancel := context.WithTimeout(ctx, s.timeout)
	n, perr := s.queues.PublishInOrder(pctx, b, msgs)
	cancel()
	var tooLarge *TooLargeError
	givenUp := errors.As(perr, &tooLarge) && n < len(rows)
	if n == 0 && !givenUp {
		return 0, perr
	}
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = rows[i].ID
	}
	err = h.WriteTx(ctx, s.store, func(tx *Tx) error {
		if err := tx.SpoolPublished(ctx, ids, b.Index, time.Now()); err != nil || !givenUp {
			return err
		}
		return tx.SpoolGivenUp(ctx, rows[n].ID, perr.Error(), time.Now())
	})
	if err != nil {
		// Published, not marked: the next drain publishes them again,
		// duplicates that are stored once.
		return 0, fmt.Errorf("spooled webhooks published to %s, not marked so: %w", b, err)
	}
	if givenUp {
		s.log.Error("a spooled webhook the broker refuses for its size is given up: lower max_message_bytes to the broker's limit",
			"delivery_id", rows[n].GUID, "broker", b.String(), "error", perr)
		return n + 1, nil
	}
	return n, perr
}

// prune deletes the published rows past spoolKeptFor, a batch at a time.
func (s *Spool) prune(ctx context.Context, h Holding) {
	for ctx.Err() == nil {
		var n int64
		err := h.WriteTx(ctx, s.store, func(tx *Tx) error {
			var err error
			n, err = tx.PruneSpool(ctx, time.Now())
			return err
		})
		if err != nil {
			s.log.Warn("the spool's published rows not pruned", "error", err)
			return
		}
		if n < retentionBatch {
			return
		}
	}
}
