package main

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// consumeSpans are the consumer spans of a batch's messages, each in the
// trace its message's headers carry (startConsume); nil while tracing is
// off, when every method does nothing.
type consumeSpans []struct {
	ctx  context.Context
	span trace.Span
}

// startConsumes begins a span of t for each of msgs, taken from queue;
// none while t is off.
func (t Tracer) startConsumes(ctx context.Context, queue string, msgs []Message) consumeSpans {
	if !t.on() {
		return nil
	}
	spans := make(consumeSpans, len(msgs))
	for i := range msgs {
		m := &msgs[i]
		spans[i].ctx, spans[i].span = t.startConsume(ctx, queue, m.ID, m.Headers, len(m.Body), int(m.Attempts)+1)
		if m.Broker != nil {
			spans[i].span.SetAttributes(attribute.String("server.address", m.Broker.Host), attribute.Int("server.port", m.Broker.Port),
				attribute.String("switchyard.broker", m.Broker.String()))
		}
		if m.Leftover {
			spans[i].span.SetAttributes(attribute.Bool("switchyard.leftover_drain", true))
		}
	}
	return spans
}

// context is message i's context, in its span; ctx while tracing is off.
func (s consumeSpans) context(ctx context.Context, i int) context.Context {
	if s == nil {
		return ctx
	}
	return s[i].ctx
}

// logFields are the log fields of message i's span: its trace's ID and
// its own.
func (s consumeSpans) logFields(i int) []any {
	if s == nil {
		return nil
	}
	return traceFields(s[i].ctx)
}

// startCommit begins the span of the batch's commit (Tracer.startCommit).
func (s consumeSpans) startCommit(ctx context.Context, t Tracer, queue string) (context.Context, trace.Span) {
	if s == nil {
		return ctx, nil
	}
	spans := make([]trace.Span, len(s))
	for i := range s {
		spans[i] = s[i].span
	}
	cctx, span := t.startCommit(queue, spans, s[0].ctx)
	// The batch's own deadline and cancellation, in the commit's trace.
	return contextIn(ctx, cctx), span
}

// end ends each message's span with its verdict, or the batch's failure.
func (s consumeSpans) end(verdicts []error, failed error) {
	for i := range s {
		v := verdicts[i]
		if failed != nil {
			v = failed
		}
		if v != nil && !errors.Is(v, ErrDuplicate) {
			s[i].span.RecordError(v)
			s[i].span.SetStatus(codes.Error, v.Error())
		}
		s[i].span.End()
	}
}
