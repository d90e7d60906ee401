package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// What is traced takes the TracerProvider it is handed, and nothing else
// decides: side by side in one process, a store and a broker's publisher
// handed a recording provider, and a store and a publisher handed the
// no-op one, do the same work in the same trace. Only the first pair's
// work becomes spans (the transaction, the publish, the consumer's span of
// the published message, in the caller's trace); the second pair's makes
// none and writes no trace context into its message.
func TestTracingHandedIn(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	traced := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer traced.Shutdown(context.Background())
	ctx, root := traced.Tracer("test").Start(context.Background(), "the caller")
	defer root.End()
	body := loadFixture(t, "issues", "opened")

	for _, c := range []struct {
		name string
		tp   trace.TracerProvider
	}{{"traced", traced}, {"off", noop.NewTracerProvider()}} {
		before := len(rec.Ended())
		store, err := OpenTracedStore(ctx, testStore(t), nil, c.tp)
		if err != nil {
			t.Fatal(err)
		}
		defer store.Close()
		if _, _, err := store.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if err := store.WriteTx(ctx, func(tx *Tx) error { return nil }); err != nil {
			t.Fatal(err)
		}

		vhost := newVhost(t)
		declareTestTopology(t, vhost, 200*time.Millisecond)
		q := NewQueues(testConfig(t, amqpURL(vhost)).Queue, mustBrokers(t, amqpURL(vhost)), nil, c.tp, slog.New(slog.DiscardHandler))
		defer q.Close()
		if err := q.Publish(ctx, q.conns[0].broker, exchangeName, "", eventMessage("issues", newGUID(), body)); err != nil {
			t.Fatal(err)
		}
		got := getOne(t, vhost, queueGitHub)
		_, carried := got.Headers["traceparent"]
		consumed := NewTracer(c.tp).startConsumes(context.Background(), queueGitHub,
			[]Message{{ID: got.MessageId, Headers: got.Headers, Body: got.Body}})
		consumed.end([]error{nil}, nil)

		names := map[string]trace.SpanContext{}
		for _, s := range rec.Ended()[before:] {
			names[s.Name()] = s.SpanContext()
		}
		switch c.name {
		case "traced":
			for _, name := range []string{"sqlite transaction", "publish " + exchangeName, "process " + queueGitHub} {
				if sc, ok := names[name]; !ok || sc.TraceID() != root.SpanContext().TraceID() {
					t.Errorf("traced: no span %q in the caller's trace (spans: %v)", name, names)
				}
			}
			if !carried {
				t.Error("traced: the published message carries no traceparent")
			}
		case "off":
			if len(names) != 0 {
				t.Errorf("off: spans made: %v", names)
			}
			if carried || consumed != nil {
				t.Errorf("off: a trace context written into the message (%v) or a consumer span begun (%v)", carried, consumed != nil)
			}
		}
	}
}
