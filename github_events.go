package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Event is one GitHub delivery as the workers see it: the routing facts from
// the headers, the few payload fields every worker needs, and the raw payload.
type Event struct {
	DeliveryID     string
	Name           string // X-GitHub-Event
	Action         string
	HookID         int64
	TargetType     string
	TargetID       int64
	InstallationID int64
	Repository     string // owner/name
	Sender         string
	SourceIP       string
	Payload        []byte // the webhook's JSON, byte for byte
	ReceivedAt     time.Time

	// fields is DecodeEvent's one pass over the payload, which the typed
	// tables decode from (tablePayload).
	fields *payloadFields
	// rows and rowsErr are decodeTableRows' answer, kept by tableRows.
	rows    *tableRows
	rowsErr error
}

// Message header names (SPEC §5).
const (
	hdrEvent      = "x-github-event"
	hdrDelivery   = "x-github-delivery"
	hdrHookID     = "x-github-hook-id"
	hdrTargetID   = "x-github-hook-installation-target-id"
	hdrTargetType = "x-github-hook-installation-target-type"
	hdrSourceIP   = "x-source-ip"
	hdrError      = "x-error-reason"
	hdrAttempts   = "x-attempts"
)

// eventHeaders are the GitHub request headers a message carries, lower-cased.
var eventHeaders = []string{hdrEvent, hdrDelivery, hdrHookID, hdrTargetID, hdrTargetType}

// newPublishing builds the message for one webhook delivery: the raw payload as
// body and the GitHub headers as message headers (SPEC §5).
func newPublishing(h http.Header, payload []byte, sourceIP string, now time.Time) amqp.Publishing {
	headers := amqp.Table{hdrSourceIP: sourceIP}
	for _, k := range eventHeaders {
		if v := h.Get(k); v != "" {
			headers[k] = v
		}
	}
	return amqp.Publishing{
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		MessageId:    h.Get(hdrDelivery),
		Type:         h.Get(hdrEvent),
		Timestamp:    now,
		Headers:      headers,
		Body:         payload,
	}
}

// eventFields is what DecodeEvent itself reads of a payload: the wrapped
// form's two members, and the fields the Event's columns come from (in the
// shape of tableFields).
var eventFields = map[string]any{"headers": nil, "payload": nil, "action": nil,
	"repository": map[string]any{"full_name": nil}, "sender": map[string]any{"login": nil},
	"installation": map[string]any{"id": nil}}

// decodedFields is what the one pass over a payload keeps: eventFields and
// tableFields.
var decodedFields = func() map[string]any {
	m := map[string]any{}
	mergeFields(m, eventFields)
	mergeFields(m, tableFields)
	return m
}()

// payloadFields is the one pass over a payload (jsonCut): the payload cut
// down to decodedFields, a few hundred bytes of a 25 KB pull_request, its
// members by key, and how many members the whole payload has.
type payloadFields struct {
	cut     []byte
	members map[string]json.RawMessage
	count   int
}

// str decodes a member that should be a string; any other type reads as "".
func (f *payloadFields) str(key string) string {
	var s string
	if raw := f.members[key]; raw != nil {
		_ = decodeJSON(raw, &s)
	}
	return s
}

// DecodeEvent reads a message into an Event. A message without a delivery
// GUID or event name, or with a body that is not a JSON object, is a permanent
// failure.
func DecodeEvent(d *amqp.Delivery) (*Event, error) {
	body := d.Body
	get := func(k string) string { return tableString(d.Headers, k) }

	f, err := decodePayload(body)
	if err != nil {
		return nil, err
	}
	if f.count == 2 && f.members["headers"] != nil && f.members["payload"] != nil {
		wrapped, err := decodeWrappedHeaders(f.members["headers"])
		if err != nil {
			return nil, err
		}
		get = func(k string) string {
			if v := wrapped.Get(k); v != "" {
				return v
			}
			return tableString(d.Headers, k)
		}
		body = unwrapPayload(f.members["payload"])
		if f, err = decodePayload(body); err != nil {
			return nil, err
		}
	}

	ev := &Event{
		DeliveryID: get(hdrDelivery),
		Name:       get(hdrEvent),
		Action:     f.str("action"),
		TargetType: get(hdrTargetType),
		SourceIP:   get(hdrSourceIP),
		Payload:    body,
		ReceivedAt: d.Timestamp,
	}
	if ev.DeliveryID == "" {
		ev.DeliveryID = d.MessageId
	}
	if ev.Name == "" {
		ev.Name = d.Type
	}
	if ev.DeliveryID == "" {
		return nil, permanent("no delivery GUID (x-github-delivery header or message_id)")
	}
	if ev.Name == "" {
		return nil, permanent("no event name (x-github-event header or type)")
	}
	ev.HookID, _ = strconv.ParseInt(get(hdrHookID), 10, 64)
	ev.TargetID, _ = strconv.ParseInt(get(hdrTargetID), 10, 64)
	// Each of these is one field of a larger object (repository alone is
	// kilobytes), read from its cut: decodeJSON decodes only it. A value
	// of another type (a payload of an unexpected shape) just leaves the
	// column empty.
	_ = decodeJSON(jsonField(f.members["repository"], "full_name"), &ev.Repository)
	_ = decodeJSON(jsonField(f.members["sender"], "login"), &ev.Sender)
	_ = decodeJSON(jsonField(f.members["installation"], "id"), &ev.InstallationID)
	ev.fields = f
	if ev.ReceivedAt.IsZero() {
		ev.ReceivedAt = time.Now()
	}
	ev.ReceivedAt = ev.ReceivedAt.UTC()
	return ev, nil
}

func decodePayload(body []byte) (*payloadFields, error) {
	body = bytes.TrimSpace(body)
	if len(body) == 0 {
		return nil, permanent("empty body")
	}
	if body[0] != '{' {
		return nil, permanent("body is not a JSON object")
	}
	var cut bytes.Buffer
	cut.Grow(1 << 10)
	f := &payloadFields{members: make(map[string]json.RawMessage, 8)}
	if !jsonCut(body, decodedFields, &cut, func(_, _ []byte) { f.count++ }) {
		return nil, permanent("body is not valid JSON")
	}
	f.cut = cut.Bytes()
	jsonMembers(f.cut, func(key string, value []byte) { f.members[key] = value })
	return f, nil
}

// decodeWrappedHeaders reads the original HTTP headers, each a string or a
// list of strings, into an http.Header so lookups ignore case.
func decodeWrappedHeaders(raw json.RawMessage) (http.Header, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, permanent("wrapped message: headers is not an object")
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
