package main

import (
	"bytes"
	"encoding/json"
	"errors"
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

	// tableJSON is the payload cut down to the top-level keys the typed
	// tables read (see tableKeys): decoding it costs a fraction of decoding
	// a 25 KB payload again. Nil until DecodeEvent.
	tableJSON []byte
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

// payloadFields are the payload fields every worker needs. The body is read
// once: the few fields of the raw log are decoded, the top-level objects the
// typed tables read are kept raw (a slice of the body, not decoded), and the
// wrapped form's fields ride along.
type payloadFields struct {
	Action       string          `json:"action"`
	Repository   json.RawMessage `json:"repository"`
	Sender       json.RawMessage `json:"sender"`
	Installation json.RawMessage `json:"installation"`

	Release             json.RawMessage `json:"release"`
	WorkflowRun         json.RawMessage `json:"workflow_run"`
	Ref                 json.RawMessage `json:"ref"`
	RefType             json.RawMessage `json:"ref_type"`
	MasterBranch        json.RawMessage `json:"master_branch"`
	Issue               json.RawMessage `json:"issue"`
	PullRequest         json.RawMessage `json:"pull_request"`
	Comment             json.RawMessage `json:"comment"`
	Discussion          json.RawMessage `json:"discussion"`
	CheckRun            json.RawMessage `json:"check_run"`
	RequestedAction     json.RawMessage `json:"requested_action"`
	Before              json.RawMessage `json:"before"`
	After               json.RawMessage `json:"after"`
	Created             json.RawMessage `json:"created"`
	Deleted             json.RawMessage `json:"deleted"`
	Forced              json.RawMessage `json:"forced"`
	Pusher              json.RawMessage `json:"pusher"`
	Commits             json.RawMessage `json:"commits"`
	RepositorySelection json.RawMessage `json:"repository_selection"`
	RepositoriesAdded   json.RawMessage `json:"repositories_added"`
	RepositoriesRemoved json.RawMessage `json:"repositories_removed"`

	// The wrapped form: {"headers": {...}, "payload": {...}}.
	Headers json.RawMessage `json:"headers"`
	Payload json.RawMessage `json:"payload"`
}

// tableJSON writes the kept top-level values back into one small object, in
// the payload's own key names, for the typed tables' decoders. The values are
// slices of a body json.Unmarshal has validated, so no re-encoding is needed.
func (f *payloadFields) tableJSON() []byte {
	var b bytes.Buffer
	b.WriteByte('{')
	first := true
	add := func(key string, raw json.RawMessage) {
		if raw == nil {
			return
		}
		if !first {
			b.WriteByte(',')
		}
		first = false
		b.WriteString(`"` + key + `":`)
		b.Write(raw)
	}
	action, _ := json.Marshal(f.Action)
	add("action", action)
	for _, kv := range []struct {
		key string
		raw json.RawMessage
	}{
		{"repository", f.Repository}, {"sender", f.Sender}, {"installation", f.Installation},
		{"release", f.Release}, {"workflow_run", f.WorkflowRun}, {"ref", f.Ref}, {"ref_type", f.RefType},
		{"master_branch", f.MasterBranch}, {"issue", f.Issue}, {"pull_request", f.PullRequest},
		{"comment", f.Comment}, {"discussion", f.Discussion}, {"check_run", f.CheckRun},
		{"requested_action", f.RequestedAction}, {"before", f.Before}, {"after", f.After},
		{"created", f.Created}, {"deleted", f.Deleted}, {"forced", f.Forced}, {"pusher", f.Pusher},
		{"commits", f.Commits}, {"repository_selection", f.RepositorySelection},
		{"repositories_added", f.RepositoriesAdded}, {"repositories_removed", f.RepositoriesRemoved},
	} {
		add(kv.key, kv.raw)
	}
	b.WriteByte('}')
	return b.Bytes()
}

// permanentError marks a message that no retry can fix: it goes to -error.
type permanentError struct{ reason string }

func (e *permanentError) Error() string { return e.reason }

func permanent(format string, args ...any) error {
	return &permanentError{reason: fmt.Sprintf(format, args...)}
}

// ErrDuplicate is a handler's answer for a delivery it already finished.
var ErrDuplicate = errors.New("duplicate delivery")

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
	if f.Headers != nil && f.Payload != nil && isWrapped(body) {
		wrapped, err := decodeWrappedHeaders(f.Headers)
		if err != nil {
			return nil, err
		}
		get = func(k string) string {
			if v := wrapped.Get(k); v != "" {
				return v
			}
			return tableString(d.Headers, k)
		}
		body = unwrapPayload(f.Payload)
		if f, err = decodePayload(body); err != nil {
			return nil, err
		}
	}

	ev := &Event{
		DeliveryID: get(hdrDelivery),
		Name:       get(hdrEvent),
		Action:     f.Action,
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
	var small struct {
		FullName string `json:"full_name"`
		Login    string `json:"login"`
		ID       int64  `json:"id"`
	}
	// Each of these is a small object; a value of another type (a payload
	// of an unexpected shape) just leaves the column empty.
	if json.Unmarshal(f.Repository, &small) == nil {
		ev.Repository = small.FullName
	}
	small.Login = ""
	if json.Unmarshal(f.Sender, &small) == nil {
		ev.Sender = small.Login
	}
	small.ID = 0
	if json.Unmarshal(f.Installation, &small) == nil {
		ev.InstallationID = small.ID
	}
	ev.tableJSON = f.tableJSON()
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
	var f payloadFields
	if err := json.Unmarshal(body, &f); err != nil {
		return nil, permanent("body is not valid JSON: %v", err)
	}
	return &f, nil
}

// isWrapped reports whether body is an object with exactly the keys headers
// and payload. Only bodies that have both keys pay for this second look.
func isWrapped(body []byte) bool {
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(body, &keys); err != nil {
		return false
	}
	_, h := keys["headers"]
	_, p := keys["payload"]
	return len(keys) == 2 && h && p
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
