package main

import (
	"bytes"
	"cmp"
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// Reading a message into an Event: the headers, the payload in one pass
// into the type its typed tables read (newTablePayload), the wrapped form.

// Decoded is one message read, as a value the worker carries to its
// handler: the Event and, when they were asked for (DecodeTableRows), the
// rows the typed tables make of it, or why they cannot.
type Decoded struct {
	Event   *Event
	Rows    *tableRows
	RowsErr error
}

// TableRows are d's rows: the ones decoded with it, or, for an Event built
// by hand, decoded now from its payload.
func (d Decoded) TableRows(botAppID int64) (*tableRows, error) {
	if d.Rows == nil && d.RowsErr == nil {
		return decodeTableRows(d.Event, decodedPayload{}, botAppID)
	}
	return d.Rows, d.RowsErr
}

// DecodeEvent reads a message into an Event. A message without a delivery
// GUID or event name, or with a body that is not a JSON object, is malformed:
// no retry can help.
func DecodeEvent(d Delivery) (*Event, error) {
	ev, _, err := readEvent(d)
	return ev, err
}

// DecodeTableRows is DecodeEvent and the rows of the typed tables, from
// the one pass over the payload: a payload that does not fit them fails
// its RowsErr, not the decoding.
func DecodeTableRows(d Delivery, botAppID int64) (Decoded, error) {
	ev, src, err := readEvent(d)
	if err != nil {
		return Decoded{}, err
	}
	rows, rowsErr := decodeTableRows(ev, src, botAppID)
	return Decoded{Event: ev, Rows: rows, RowsErr: rowsErr}, nil
}

// readEvent is DecodeEvent, and the payload as its one pass read it.
func readEvent(d Delivery) (*Event, decodedPayload, error) {
	body := d.Body
	get := d.Header

	p, shapeErr, err := decodePayload(body, cmp.Or(get(hdrEvent), d.Type))
	if err != nil {
		return nil, decodedPayload{}, err
	}
	env := p.event()
	wrapped := env.Headers != nil && env.Payload != nil && memberCount(body) == 2
	if wrapped {
		hdrs, err := decodeWrappedHeaders(env.Headers)
		if err != nil {
			return nil, decodedPayload{}, err
		}
		get = func(k string) string {
			if v := hdrs.Get(k); v != "" {
				return v
			}
			return d.Header(k)
		}
		body = unwrapPayload(env.Payload)
		if p, shapeErr, err = decodePayload(body, cmp.Or(get(hdrEvent), d.Type)); err != nil {
			return nil, decodedPayload{}, err
		}
		env = p.event()
	}

	ev := &Event{
		DeliveryID: get(hdrDelivery),
		Name:       get(hdrEvent),
		Action:     env.Action,
		TargetType: get(hdrTargetType),
		SourceIP:   get(hdrSourceIP),
		Sender:     login(env.Sender),
		Payload:    body,
		ReceivedAt: d.Timestamp,
		TraceID:    traceIDOf(d.Header("traceparent")),
	}
	if !wrapped {
		ev.PayloadZstd = d.Zstd // the body as it came
	}
	if ev.DeliveryID == "" {
		ev.DeliveryID = d.MessageID
	}
	if ev.Name == "" {
		ev.Name = d.Type
	}
	if ev.DeliveryID == "" {
		return nil, decodedPayload{}, malformed("no delivery GUID (x-github-delivery header or message_id)")
	}
	if ev.Name == "" {
		return nil, decodedPayload{}, malformed("no event name (x-github-event header or type)")
	}
	if ev.HookID, err = parseHookID(get(hdrHookID)); err != nil {
		// The hook is half the delivery's identity: a guess would make
		// it another delivery's duplicate, or a copy of its own.
		return nil, decodedPayload{}, malformed("%v", err)
	}
	ev.TargetID, _ = strconv.ParseInt(get(hdrTargetID), 10, 64)
	if env.Repository != nil {
		ev.Repository = env.Repository.FullName
	}
	if env.Installation != nil {
		ev.InstallationID = env.Installation.ID
	}
	if t, err := time.Parse(timeFormat, get(hdrReceivedAt)); err == nil {
		ev.ReceivedAt = t // to the microsecond; the timestamp has seconds
	}
	if ev.ReceivedAt.IsZero() {
		ev.ReceivedAt = time.Now()
	}
	ev.ReceivedAt = ev.ReceivedAt.UTC()
	return ev, decodedPayload{value: p, shapeErr: shapeErr}, nil
}

// decodePayload decodes a payload, in one pass, into the type the typed
// tables read for the Event name (newTablePayload). A body that is not one
// JSON object is a permanent failure. One whose values do not all have the
// type's shape (a number where a string belongs) is not: the Event keeps
// what did fit (a column of another type stays empty), and shapeErr is the
// first misfit, which fails the Event's typed rows only (decodeInto).
func decodePayload(body []byte, name string) (p tablePayload, shapeErr, err error) {
	body = bytes.TrimSpace(body)
	if len(body) == 0 {
		return nil, nil, malformed("empty body")
	}
	if body[0] != '{' {
		return nil, nil, malformed("body is not a JSON object")
	}
	p = newTablePayload(name)
	if err := decodeJSON(body, p); err != nil {
		if !isShapeError(err) {
			return nil, nil, malformed("body is not valid JSON")
		}
		shapeErr = err
	}
	return p, shapeErr, nil
}

// memberCount is how many different keys the JSON object in b has, 0 when
// b is not one.
func memberCount(b []byte) int {
	var m map[string]json.RawMessage
	if decodeJSON(b, &m) != nil {
		return 0
	}
	return len(m)
}

// decodeWrappedHeaders reads the original HTTP headers, each a string or a
// list of strings, into an http.Header so lookups ignore case.
func decodeWrappedHeaders(raw json.RawMessage) (http.Header, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, malformed("wrapped message: headers is not an object")
	}
	h := http.Header{}
	for k, v := range m {
		var s string
		if err := json.Unmarshal(v, &s); err == nil {
			h.Add(k, s)
			continue
		}
		var ss []string
		if err := json.Unmarshal(v, &ss); err == nil {
			for _, s := range ss {
				h.Add(k, s)
			}
			continue
		}
		var n json.Number
		if err := json.Unmarshal(v, &n); err == nil {
			h.Add(k, n.String())
		}
	}
	return h, nil
}

// unwrapPayload returns the payload of the wrapped form: the object itself,
// or the JSON text inside a string.
func unwrapPayload(raw json.RawMessage) []byte {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return []byte(s)
	}
	return raw
}
