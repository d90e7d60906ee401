// One trace per delivery ([tracing]): OpenTelemetry spans from the door to
// the commit, the W3C trace context carried in each message's headers, so
// that the outbox, the publish and every consumer of every node join the
// trace the webhook's request began.

package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// propagator carries the trace context in messages' headers and requests'
// (W3C traceparent and tracestate), whether tracing is on or not: a
// message passes an outside producer's trace on unchanged.
var propagator = propagation.TraceContext{}

// Tracer makes switchyard's spans from the TracerProvider it is made of
// (NewTracer). Of the no-op provider, tracing off, it is the zero Tracer:
// it makes no span and the data path does not even look for a trace.
// What is traced is handed one; nothing reads a global.
type Tracer struct {
	provider trace.TracerProvider
	tracer   trace.Tracer
}

// NewTracer is the Tracer of tp; of the no-op provider, or none, it is off.
func NewTracer(tp trace.TracerProvider) Tracer {
	if _, off := tp.(noop.TracerProvider); off || tp == nil {
		return Tracer{}
	}
	return Tracer{provider: tp, tracer: tp.Tracer("switchyard")}
}

// on says whether t makes spans.
func (t Tracer) on() bool { return t.tracer != nil }

// spanQueue bounds the spans that wait for the exporter (the SDK's batch
// processor's queue): past it a span is dropped and counted, so that a
// collector that is down or slow costs memory it bounds and nothing else.
const spanQueue = 4096

// NewTracing is the TracerProvider cfg asks for, sending spans through
// the SDK's batch processor, and its shutdown; off, the no-op provider and
// a shutdown that does nothing. dropped counts the spans lost: dropped by
// the batch processor's bounded queue, or not taken by the collector.
func NewTracing(cfg TracingConfig, node string, dropped func(n int), log *slog.Logger) (trace.TracerProvider, func(context.Context) error, error) {
	if !cfg.On() {
		return noop.NewTracerProvider(), func(context.Context) error { return nil }, nil
	}
	exp, err := newExporter(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("tracing: %w", err)
	}
	// The exporter's errors (a collector down) are logged once a minute at
	// most: the spans they lost are counted. The SDK reports both through
	// its process-wide handler and logger, the one place it offers.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(rateLimited(time.Minute, func(err error) {
		log.Warn("tracing: spans not exported", "endpoint", cfg.Endpoint, "error", err)
	})))
	otel.SetLogger(logr.New(&queueDrops{dropped: dropped}))
	var batch []sdktrace.BatchSpanProcessorOption
	if os.Getenv("OTEL_BSP_MAX_QUEUE_SIZE") == "" { // the SDK reads it, and it wins
		batch = append(batch, sdktrace.WithMaxQueueSize(spanQueue))
	}
	opts := []sdktrace.TracerProviderOption{
		sdktrace.WithBatcher(countingExporter{SpanExporter: exp, dropped: dropped}, batch...),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "switchyard"),
			attribute.String("service.version", version), attribute.String("service.instance.id", node))),
	}
	if cfg.Endpoint != "" {
		opts = append(opts, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(cfg.SampleRatio))))
	}
	tp := sdktrace.NewTracerProvider(opts...)
	return tp, tp.Shutdown, nil
}

// newExporter is the OTLP exporter of cfg.Endpoint's protocol, or of the
// OTEL_* variables when it is empty (the SDK reads them).
func newExporter(cfg TracingConfig) (*otlptrace.Exporter, error) {
	ctx := context.Background()
	if cfg.Endpoint == "" {
		if p := strings.ToLower(envOr("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")); p == "grpc" {
			return otlptracegrpc.New(ctx)
		}
		return otlptracehttp.New(ctx)
	}
	u, err := url.Parse(cfg.Endpoint)
	if err != nil {
		return nil, err
	}
	switch u.Scheme {
	case "grpc", "grpcs":
		opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(u.Host), otlptracegrpc.WithHeaders(cfg.Headers)}
		if u.Scheme == "grpc" {
			opts = append(opts, otlptracegrpc.WithInsecure())
		}
		return otlptracegrpc.New(ctx, opts...)
	}
	// A bare http://host:port is the collector's root: OTLP/HTTP posts
	// traces to /v1/traces (a collector answers 404 at /).
	if u.Path == "" || u.Path == "/" {
		u.Path = "/v1/traces"
	}
	return otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(u.String()), otlptracehttp.WithHeaders(cfg.Headers))
}

// envOr is the first of the variables that is set.
func envOr(names ...string) string {
	for _, n := range names {
		if v := strings.TrimSpace(os.Getenv(n)); v != "" {
			return v
		}
	}
	return ""
}

// countingExporter is the exporter the batch processor hands its batches
// to: the spans of a batch the collector did not take (down, refusing,
// past the export's time) are counted as dropped.
type countingExporter struct {
	sdktrace.SpanExporter
	dropped func(n int)
}

func (e countingExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	err := e.SpanExporter.ExportSpans(ctx, spans)
	if err != nil {
		e.dropped(len(spans))
	}
	return err
}

// queueDrops counts the spans the SDK's batch processor dropped because
// its queue was full (the collector slower than the spans come). The
// processor keeps that count to itself and says it only in its debug line
// before each export ("exporting spans", total_dropped): this sink of the
// SDK's logger reads that line, and nothing else, and counts what was
// added since the last.
type queueDrops struct {
	dropped func(n int)
	mu      sync.Mutex
	seen    int64
}

func (q *queueDrops) Init(logr.RuntimeInfo) {}

// Enabled lets through the SDK's debug lines (V(8)) only.
func (q *queueDrops) Enabled(level int) bool { return level == 8 }

func (q *queueDrops) Info(_ int, msg string, kv ...any) {
	if msg != "exporting spans" {
		return
	}
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i] != "total_dropped" {
			continue
		}
		var total int64
		switch v := kv[i+1].(type) {
		case uint32:
			total = int64(v)
		case int64:
			total = v
		case int:
			total = int64(v)
		}
		q.mu.Lock()
		n := total - q.seen
		q.seen = max(q.seen, total)
		q.mu.Unlock()
		if n > 0 {
			q.dropped(int(n))
		}
	}
}

func (q *queueDrops) Error(error, string, ...any)    {}
func (q *queueDrops) WithValues(...any) logr.LogSink { return q }
func (q *queueDrops) WithName(string) logr.LogSink   { return q }

// headerCarrier is a message's headers as the propagator reads and writes
// them.
type headerCarrier amqp.Table

func (c headerCarrier) Get(key string) string {
	v, _ := c[key].(string)
	return v
}

func (c headerCarrier) Set(key, value string) { c[key] = value }

func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// traceOf is ctx with the trace context that headers carry, when they
// carry one (a message of switchyard's, or of an outside producer), else
// ctx.
func (t Tracer) traceOf(ctx context.Context, headers amqp.Table) context.Context {
	if headers == nil || !t.on() {
		return ctx
	}
	return propagator.Extract(ctx, headerCarrier(headers))
}

// startPublish begins the producer span of a message sent to exchange with
// key, under the trace its headers carry (or ctx's), and writes the span's
// context into the headers for its consumers.
func (t Tracer) startPublish(ctx context.Context, exchange, key string, msg *amqp.Publishing) (context.Context, trace.Span) {
	ctx, span := t.tracer.Start(t.traceOf(ctx, msg.Headers), "publish "+exchange, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("messaging.system", "rabbitmq"), attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.destination.name", exchange), attribute.String("messaging.rabbitmq.destination.routing_key", key),
			attribute.String("messaging.message.id", msg.MessageId), attribute.Int("messaging.message.body.size", len(msg.Body))))
	if span.IsRecording() {
		if msg.Headers == nil {
			msg.Headers = amqp.Table{}
		}
		propagator.Inject(ctx, headerCarrier(msg.Headers))
	}
	return ctx, span
}

// requests wraps the API's handler in the HTTP server spans of otelhttp,
// which honour a trace an outside producer's request carries; off, it is h.
func (t Tracer) requests(h http.Handler) http.Handler {
	if !t.on() {
		return h
	}
	return otelhttp.NewHandler(h, "switchyard", otelhttp.WithTracerProvider(t.provider), otelhttp.WithPropagators(propagator),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string {
			if r.URL.Path == "/webhooks/github" {
				return r.Method + " /webhooks/github"
			}
			return r.Method
		}))
}

// traceWebhook names the delivery on the request's span (the endpoint's
// server span, under an outside producer's trace when its request carried
// one) and writes the span's context into the message's headers, which the
// outbox keeps too.
func traceWebhook(ctx context.Context, msg *amqp.Publishing, hookID string) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(attribute.String("github.delivery", msg.MessageId), attribute.String("github.event", msg.Type),
		attribute.String("github.hook_id", hookID))
	propagator.Inject(ctx, headerCarrier(msg.Headers))
}

// nameDelivery names the delivery ctx's span is about (github.delivery), so
// that its trace is found by the GUID where no door's span names it: a
// delivery republished from GitHub's record.
func nameDelivery(ctx context.Context, guid string) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(attribute.String("github.delivery", guid))
	}
}

// startOutbox begins the span of a webhook's commit to the outbox, bound
// for exchange, in the delivery's trace; nil while t is off or ctx is in
// no trace.
func (t Tracer) startOutbox(ctx context.Context, exchange, guid string) trace.Span {
	if !t.on() || !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	_, span := t.tracer.Start(ctx, "outbox "+exchange, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("messaging.message.id", guid)))
	return span
}

// startCommit begins the span of the transaction that commits a batch:
// in the trace of its first message, linked to every message's span, each
// of which links back to it, so that one commit holding many deliveries is
// found from each.
func (t Tracer) startCommit(queue string, msgs []trace.Span, first context.Context) (context.Context, trace.Span) {
	links := make([]trace.Link, len(msgs))
	for i, s := range msgs {
		links[i] = trace.Link{SpanContext: s.SpanContext()}
	}
	ctx, span := t.tracer.Start(first, "commit "+queue, trace.WithLinks(links...))
	for _, s := range msgs {
		s.AddLink(trace.Link{SpanContext: span.SpanContext()})
	}
	return ctx, span
}

// startConsume begins a consumer's span of a message taken from queue,
// under the trace its headers carry, attempt its try (1 for the first).
func (t Tracer) startConsume(ctx context.Context, queue, id string, headers amqp.Table, size, attempt int) (context.Context, trace.Span) {
	return t.tracer.Start(t.traceOf(ctx, headers), "process "+queue, trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attribute.String("messaging.system", "rabbitmq"), attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.destination.name", queue), attribute.String("messaging.message.id", id),
			attribute.Int("messaging.message.body.size", size), attribute.Int("switchyard.attempt", attempt)))
}

// traceID is the ID of ctx's trace when it is sampled, else "".
func traceID(ctx context.Context) string {
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		return sc.TraceID().String()
	}
	return ""
}

// traceFields are the log fields of ctx's span, none without one.
func traceFields(ctx context.Context) []any {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return nil
	}
	return []any{"trace_id", sc.TraceID().String(), "span_id", sc.SpanID().String()}
}

// rateLimited calls fn at most once each every.
func rateLimited(every time.Duration, fn func(error)) func(error) {
	var mu sync.Mutex
	var last time.Time
	return func(err error) {
		mu.Lock()
		due := time.Since(last) >= every
		if due {
			last = time.Now()
		}
		mu.Unlock()
		if due {
			fn(err)
		}
	}
}

// endSpan ends span, failed with err when set; a nil span is none.
func endSpan(span trace.Span, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// pgxTracer is pgx's tracer hook: a span of each statement PostgreSQL
// runs for a traced transaction (one whose context holds a span).
type pgxTracer struct{ tracer trace.Tracer }

// pgx is t's hook for pgx's connections; nil while t is off.
func (t Tracer) pgx() pgx.QueryTracer {
	if !t.on() {
		return nil
	}
	return pgxTracer{tracer: t.tracer}
}

// pgxSpan marks a context whose statement span pgxTracer began.
type pgxSpan struct{}

func (p pgxTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	verb, _, _ := strings.Cut(strings.TrimSpace(data.SQL), " ")
	ctx, _ = p.tracer.Start(ctx, "postgresql "+strings.ToUpper(verb), trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("db.system.name", "postgresql"), attribute.String("db.query.text", data.SQL)))
	return context.WithValue(ctx, pgxSpan{}, true)
}

func (pgxTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if ctx.Value(pgxSpan{}) != nil {
		endSpan(trace.SpanFromContext(ctx), data.Err)
	}
}

// TraceBatchStart begins the span of the statements a transaction sends
// ahead together (one round trip), each an event of it.
func (p pgxTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	ctx, _ = p.tracer.Start(ctx, "postgresql pipeline", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("db.system.name", "postgresql"), attribute.Int("db.operation.batch.size", data.Batch.Len())))
	return context.WithValue(ctx, pgxSpan{}, true)
}

func (pgxTracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	if ctx.Value(pgxSpan{}) != nil {
		trace.SpanFromContext(ctx).AddEvent("statement", trace.WithAttributes(attribute.String("db.query.text", data.SQL)))
	}
}

func (pgxTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	if ctx.Value(pgxSpan{}) != nil {
		endSpan(trace.SpanFromContext(ctx), data.Err)
	}
}

// startTransaction begins the span of a database transaction on driver
// (database.driver), when tracing is on and ctx is traced (a message's
// batch); a nil span else.
func (t Tracer) startTransaction(ctx context.Context, driver string) (context.Context, trace.Span) {
	if !t.on() || !trace.SpanContextFromContext(ctx).IsValid() {
		return ctx, nil
	}
	system := driver // sqlite
	if driver == "postgres" {
		system = "postgresql"
	}
	return t.tracer.Start(ctx, system+" transaction", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("db.system.name", system)))
}

// contextIn is ctx (its deadline, its cancellation, its values) with the
// span of traced as its current span.
func contextIn(ctx, traced context.Context) context.Context {
	return trace.ContextWithSpan(ctx, trace.SpanFromContext(traced))
}
