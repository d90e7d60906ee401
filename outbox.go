// The outbox: the store is the door. Every webhook the endpoint accepts
// is committed to the store (the outbox table) before its 202, by one
// writer per node that commits the rows the requests hand it in groups,
// and forwarded to the broker after, in commit order, by the node's
// forwarder (outbox_write.go, outbox_forward.go). Whatever the broker
// does, the door is not touched. Only when the store cannot take a
// webhook does the endpoint publish it itself, with a confirm; when
// neither can, it is refused. Take is that one decision.

package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace"
)

// ErrOutboxFull is a webhook the outbox cannot take: this node's rows that
// wait hold queue.outbox_max_bytes already.
var ErrOutboxFull = errors.New("the outbox is full (queue.outbox_max_bytes)")

// errWriterStopped is a webhook handed to a writer that has stopped (the
// daemon shutting down past its time).
var errWriterStopped = errors.New("the outbox's writer has stopped")

// Outcome is what became of a webhook the door took.
type TakeOutcome int

const (
	// Queued: committed to the outbox; the forwarder publishes it.
	Queued TakeOutcome = iota + 1
	// Published: the store did not take it; the broker confirmed it.
	Published
	// Refused: neither took it (or it is over the broker's size).
	Refused
)

// Taken is Take's answer: the outcome, the broker meant (or used), why
// the store did not take it (Published, Refused: StoreErr), and why the
// broker did not (Refused: Err, which alone is set for a webhook over the
// broker's size).
type Taken struct {
	Outcome  TakeOutcome
	Broker   *Broker
	Err      error
	StoreErr error
}

// Outbox is this node's door to the broker: the writer, the forwarder and
// the policy between the store and the broker.
type Outbox struct {
	store   *Store
	brokers *Brokers
	queues  *Queues
	node    string
	// maxBytes is queue.outbox_max_bytes; publishTimeout the broker's
	// path's wait, and commitTimeout the writer's for a group.
	maxBytes       int64
	publishTimeout time.Duration
	commitTimeout  time.Duration
	// ttl is server.lease_ttl: a row of a node that never took its
	// outbox lease is adopted once it is that old.
	ttl    time.Duration
	tracer Tracer
	log    *slog.Logger

	// writes are the rows the requests hand the writer; stopped is
	// closed once it has stopped taking them.
	writes  chan *outboxWrite
	stopped chan struct{}
	// kick wakes the forwarder: something was committed.
	kick chan struct{}
	// waiting is the bytes of this node's rows that wait (refused ones
	// included): what queue.outbox_max_bytes bounds. The writer adds, the
	// forwarder takes away; the forwarder reads it from the store when it
	// starts.
	waiting atomic.Int64
	// committed counts the rows the writer committed: the forwarder reads
	// no rows to go behind a batch in flight until a batch's worth came.
	committed atomic.Int64
	// rowBytes is the mean size of the rows the forwarder read last,
	// which its next read is sized by (batchRows); the forwarder's own.
	rowBytes int64
	// logStoreRefused and logPublished log, at most once a 10 s, a group
	// the store did not take and a webhook published directly.
	logStoreRefused, logPublished func(error)

	// state is what the store said the outbox holds, read at most once
	// a stateEvery for the gauges and the status.
	stateMu   sync.Mutex
	state     OutboxState
	stateErr  error
	stateRead time.Time
}

// outboxWrite is one row a request hands the writer, and where the writer
// answers: nil once it is committed.
type outboxWrite struct {
	row  OutboxRow
	done chan error
}

// A group is at most outboxGroupRows rows and outboxGroupBytes of them.
const (
	outboxGroupRows  = 512
	outboxGroupBytes = 16 << 20
)

// storeWait is the longest the door waits for the store to commit a
// webhook before it takes the broker's path.
const storeWait = 3 * time.Second

// stateEvery is how often the outbox's state is read from the store at
// most, however often it is asked.
const stateEvery = time.Second

// NewOutbox builds the outbox of cfg over store, brokers and queues, with
// its gauges; nothing runs until Write and Forward.
func NewOutbox(cfg *Config, store *Store, brokers *Brokers, queues *Queues, metrics *Metrics, tp trace.TracerProvider, log *slog.Logger) *Outbox {
	// The store has storeWait to take a webhook (SQLite's busy_timeout
	// when shorter: past it the lock another process holds has refused
	// it), then the broker publish_timeout: within GitHub's 10 s.
	commit := storeWait
	if !store.Shared() {
		commit = min(commit, max(cfg.Database.BusyTimeout, 100*time.Millisecond))
	}
	o := &Outbox{store: store, brokers: brokers, queues: queues, node: cfg.Server.NodeName, maxBytes: cfg.Queue.OutboxMaxBytes,
		publishTimeout: cfg.Queue.PublishTimeout, commitTimeout: commit, ttl: cfg.Server.LeaseTTL, tracer: NewTracer(tp), log: log.With("component", "outbox"),
		writes: make(chan *outboxWrite, outboxGroupRows), stopped: make(chan struct{}), kick: make(chan struct{}, 1)}
	o.logStoreRefused = rateLimited(10*time.Second, func(err error) {
		o.log.Warn("webhooks not committed to the outbox: the store did not take them; they take the broker's path", "error", err)
	})
	o.logPublished = rateLimited(10*time.Second, func(err error) {
		o.log.Warn("the store did not take a webhook: published to the broker directly, out of the outbox's order", "error", err)
	})
	if metrics != nil {
		read := func(f func(OutboxState) int) func(context.Context) (int, error) {
			return func(ctx context.Context) (int, error) {
				st, err := o.State(ctx)
				return f(st), err
			}
		}
		metrics.GaugeFunc("switchyard_outbox_messages", "Webhooks answered 202 that wait in the outbox for the broker to confirm them.",
			read(func(st OutboxState) int { return int(st.Messages) }))
		metrics.GaugeFunc("switchyard_outbox_bytes", "Bytes of the webhooks waiting in the outbox; each node's own are bounded by queue.outbox_max_bytes.",
			read(func(st OutboxState) int { return int(st.Bytes) }))
		metrics.GaugeFunc("switchyard_outbox_oldest_age_seconds", "Age of the oldest webhook waiting in the outbox; 0 when none waits.",
			read(func(st OutboxState) int {
				if st.Oldest == nil {
					return 0
				}
				return int(time.Since(*st.Oldest).Seconds())
			}))
		metrics.GaugeFunc("switchyard_outbox_refused", "Webhooks in the outbox the broker refused for good (over its max_message_size): switchyard outbox retry sends them again.",
			read(func(st OutboxState) int { return int(st.RefusedCount) }))
	}
	return o
}

// State is what the outbox holds, as last read (at most stateEvery ago).
func (o *Outbox) State(ctx context.Context) (OutboxState, error) {
	o.stateMu.Lock()
	defer o.stateMu.Unlock()
	if time.Since(o.stateRead) < stateEvery {
		return o.state, o.stateErr
	}
	o.state, o.stateErr = o.store.OutboxState(ctx)
	o.stateRead = time.Now()
	return o.state, o.stateErr
}

// Full reports whether this node's waiting rows leave no room in
// queue.outbox_max_bytes for a webhook of outboxRoom: the next webhooks
// take the broker's path.
func (o *Outbox) Full() bool { return o.waiting.Load()+outboxRoom > o.maxBytes }

// outboxRoom is a large webhook as compressed, what Full keeps room for.
const outboxRoom = 64 << 10

// Waiting is the bytes of this node's rows that wait.
func (o *Outbox) Waiting() int64 { return o.waiting.Load() }

// MaxBytes is queue.outbox_max_bytes.
func (o *Outbox) MaxBytes() int64 { return o.maxBytes }

// Take is the door's one decision. The webhook msg, for exchange and
// key, is prepared for the publish target (compressed, within its size:
// over it, Refused with a *TooLargeError) and committed to the outbox:
// Queued. When the outbox is full or the store does not take the write in
// time, the broker's path: published with a confirm, Published. Neither:
// Refused, its Err joining both causes. bodyDone is called once msg no
// longer refers to the request's body; Take returns only once the writer
// is done with msg, whatever ctx does (a client that left still has its
// row committed).
func (o *Outbox) Take(ctx context.Context, exchange, key string, msg amqp.Publishing, bodyDone func()) Taken {
	encoded := msg.ContentEncoding
	b, msg, err := o.queues.Prepare(o.brokers, msg)
	if err != nil {
		return Taken{Outcome: Refused, Broker: b, Err: err}
	}
	if msg.ContentEncoding != encoded {
		bodyDone() // compressed into bytes of its own: the request's body is free
	}
	row, err := o.row(exchange, key, msg)
	if err != nil {
		return Taken{Outcome: Refused, Broker: b, Err: err}
	}
	storeErr := ErrOutboxFull
	if o.waiting.Load()+row.Size() <= o.maxBytes {
		if storeErr = o.write(ctx, row); storeErr == nil {
			return Taken{Outcome: Queued, Broker: b}
		}
	}
	if err := o.publish(ctx, b, exchange, key, msg); err != nil {
		return Taken{Outcome: Refused, Broker: b, Err: err, StoreErr: storeErr}
	}
	o.logPublished(fmt.Errorf("delivery %s: %w", msg.MessageId, storeErr))
	return Taken{Outcome: Published, Broker: b, StoreErr: storeErr}
}

// publish is the broker's path: msg published to b with a confirm within
// publish_timeout, sent again while its confirm is lost, and tried again
// while the broker is away (its connection's backoff, a second at most)
// rather than refused at the first failed dial.
func (o *Outbox) publish(ctx context.Context, b *Broker, exchange, key string, msg amqp.Publishing) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.publishTimeout)
	defer cancel()
	for {
		err := o.queues.PublishConfirmed(ctx, b, exchange, key, msg)
		if err == nil || !errors.Is(err, ErrBrokerUnreachable) {
			return err
		}
		wait := time.NewTimer(brokerRetryStep)
		select {
		case <-ctx.Done():
			wait.Stop()
			return err
		case <-o.queues.Back(b):
		case <-wait.C:
		}
		wait.Stop()
	}
}

// brokerRetryStep is how often the broker's path tries a broker away
// again within publish_timeout.
const brokerRetryStep = 200 * time.Millisecond

// row is msg, for exchange and key, as the outbox keeps it.
func (o *Outbox) row(exchange, key string, msg amqp.Publishing) (OutboxRow, error) {
	headers, err := encodeHeaders(msg.Headers)
	if err != nil {
		return OutboxRow{}, fmt.Errorf("delivery %s: %w", msg.MessageId, err)
	}
	hook := HookID(-1)
	if v, ok := msg.Headers[hdrHookID].(string); ok {
		if id, err := parseHookID(v); err == nil {
			hook = HookID(id)
		}
	}
	return OutboxRow{Node: o.node, GUID: msg.MessageId, Hook: hook, Event: msg.Type, ReceivedAt: msg.Timestamp, QueuedAt: time.Now(),
		Exchange: exchange, Key: key, Headers: headers, ContentEncoding: msg.ContentEncoding, Body: msg.Body}, nil
}

// write hands row to the writer and waits for it to be committed (nil) or
// not; in a span of the delivery's trace when ctx is traced.
func (o *Outbox) write(ctx context.Context, row OutboxRow) error {
	span := o.tracer.startOutbox(ctx, row.Exchange, row.GUID)
	w := &outboxWrite{row: row, done: make(chan error, 1)}
	var err error
	select {
	case o.writes <- w:
		select {
		case err = <-w.done:
		case <-o.stopped:
			err = errWriterStopped
		}
	case <-o.stopped:
		err = errWriterStopped
	}
	endSpan(span, err)
	return err
}

// publishing is the message row holds.
func (r *OutboxRow) publishing() (Outgoing, error) {
	headers, err := decodeHeaders(r.Headers)
	if err != nil {
		return Outgoing{}, fmt.Errorf("outbox row of delivery %s: %w", r.GUID, err)
	}
	return Outgoing{Exchange: r.Exchange, Key: r.Key, Msg: amqp.Publishing{ContentType: "application/json",
		ContentEncoding: r.ContentEncoding, DeliveryMode: amqp.Persistent, MessageId: r.GUID, Type: r.Event,
		Timestamp: r.ReceivedAt, Headers: headers, Body: r.Body}}, nil
}

// The outbox keeps a message's headers as a JSON object whose values keep
// their AMQP types: a string as a JSON string (so that the headers of an
// older version's spool, all strings, read as they are), any other value
// as {"t": type, "v": value}.

// typedValue is a header value that is not a string.
type typedValue struct {
	T string `json:"t"`
	V any    `json:"v,omitempty"`
}

// encodeHeaders is h as the outbox keeps it.
func encodeHeaders(h amqp.Table) (string, error) {
	out := make(map[string]any, len(h))
	for k, v := range h {
		e, err := encodeValue(v)
		if err != nil {
			return "", fmt.Errorf("header %s: %w", k, err)
		}
		out[k] = e
	}
	b, err := json.Marshal(out)
	return string(b), err
}

func encodeValue(v any) (any, error) {
	switch x := v.(type) {
	case string:
		return x, nil
	case nil:
		return typedValue{T: "null"}, nil
	case bool:
		return typedValue{T: "bool", V: x}, nil
	case int8:
		return typedValue{T: "int8", V: x}, nil
	case uint8:
		return typedValue{T: "uint8", V: x}, nil
	case int16:
		return typedValue{T: "int16", V: x}, nil
	case uint16:
		return typedValue{T: "uint16", V: x}, nil
	case int32:
		return typedValue{T: "int32", V: x}, nil
	case uint32:
		return typedValue{T: "uint32", V: x}, nil
	case int:
		return typedValue{T: "int64", V: int64(x)}, nil
	case int64:
		return typedValue{T: "int64", V: x}, nil
	case float32:
		return typedValue{T: "float32", V: x}, nil
	case float64:
		return typedValue{T: "float64", V: x}, nil
	case []byte:
		return typedValue{T: "bytes", V: base64.StdEncoding.EncodeToString(x)}, nil
	case time.Time:
		return typedValue{T: "time", V: x.UTC().Format(time.RFC3339)}, nil
	case amqp.Decimal:
		return typedValue{T: "decimal", V: []any{x.Scale, x.Value}}, nil
	case amqp.Table:
		fields := make(map[string]any, len(x))
		for k, f := range x {
			e, err := encodeValue(f)
			if err != nil {
				return nil, err
			}
			fields[k] = e
		}
		return typedValue{T: "table", V: fields}, nil
	case []any:
		items := make([]any, len(x))
		for i, f := range x {
			e, err := encodeValue(f)
			if err != nil {
				return nil, err
			}
			items[i] = e
		}
		return typedValue{T: "array", V: items}, nil
	}
	return nil, fmt.Errorf("a value of type %T, which AMQP does not carry", v)
}

// scalars read the values of the AMQP types that are JSON numbers or
// booleans, by the type's name in the encoding.
var scalars = map[string]func(json.RawMessage) (any, error){
	"bool": scalar[bool], "int8": scalar[int8], "uint8": scalar[uint8], "int16": scalar[int16], "uint16": scalar[uint16],
	"int32": scalar[int32], "uint32": scalar[uint32], "int64": scalar[int64], "float32": scalar[float32], "float64": scalar[float64],
}

// scalar reads v as a T.
func scalar[T any](v json.RawMessage) (any, error) {
	var x T
	err := json.Unmarshal(v, &x)
	return x, err
}

// decodeHeaders is the table encodeHeaders kept as s.
func decodeHeaders(s string) (amqp.Table, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal([]byte(s), &raw); err != nil {
		return nil, fmt.Errorf("headers: %w", err)
	}
	out := make(amqp.Table, len(raw))
	for k, r := range raw {
		v, err := decodeValue(r)
		if err != nil {
			return nil, fmt.Errorf("header %s: %w", k, err)
		}
		out[k] = v
	}
	return out, nil
}

func decodeValue(r json.RawMessage) (any, error) {
	var s string
	if err := json.Unmarshal(r, &s); err == nil {
		return s, nil
	}
	var tv struct {
		T string          `json:"t"`
		V json.RawMessage `json:"v"`
	}
	if err := json.Unmarshal(r, &tv); err != nil {
		return nil, err
	}
	value := func(dst any) error { return json.Unmarshal(tv.V, dst) }
	if read, ok := scalars[tv.T]; ok {
		return read(tv.V)
	}
	switch tv.T {
	case "null":
		return nil, nil
	case "bytes":
		var b64 string
		if err := value(&b64); err != nil {
			return nil, err
		}
		return base64.StdEncoding.DecodeString(b64)
	case "time":
		var ts string
		if err := value(&ts); err != nil {
			return nil, err
		}
		return time.Parse(time.RFC3339, ts)
	case "decimal":
		var d []json.RawMessage
		if err := value(&d); err != nil || len(d) != 2 {
			return nil, fmt.Errorf("a decimal: %s", tv.V)
		}
		var x amqp.Decimal
		if err := errors.Join(json.Unmarshal(d[0], &x.Scale), json.Unmarshal(d[1], &x.Value)); err != nil {
			return nil, err
		}
		return x, nil
	case "table":
		var fields map[string]json.RawMessage
		if err := value(&fields); err != nil {
			return nil, err
		}
		t := make(amqp.Table, len(fields))
		for k, f := range fields {
			v, err := decodeValue(f)
			if err != nil {
				return nil, err
			}
			t[k] = v
		}
		return t, nil
	case "array":
		var items []json.RawMessage
		if err := value(&items); err != nil {
			return nil, err
		}
		out := make([]any, len(items))
		for i, f := range items {
			v, err := decodeValue(f)
			if err != nil {
				return nil, err
			}
			out[i] = v
		}
		return out, nil
	}
	return nil, fmt.Errorf("a value of type %q", tv.T)
}
