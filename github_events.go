package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
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
	// PayloadZstd is Payload zstd-compressed, as its message came (the
	// raw log stores it as it is); nil when it came otherwise.
	PayloadZstd []byte
	ReceivedAt  time.Time
	// Broker is the broker ("host/vhost") the delivery came through to
	// the worker; empty when not known.
	Broker string
	// TraceID is the ID of the trace its message carried (traceparent),
	// "" when none.
	TraceID string
}

// traceIDOf is the trace ID of a W3C traceparent header
// (version-traceid-spanid-flags), "" when it is none.
func traceIDOf(traceparent string) string {
	parts := strings.Split(traceparent, "-")
	if len(parts) != 4 || len(parts[1]) != 32 || strings.Trim(parts[1], "0") == "" ||
		strings.Trim(parts[1], "0123456789abcdef") != "" {
		return ""
	}
	return parts[1]
}

// DeliveryKey is a delivery's identity: the hook its copy of the event was
// sent to (0 when the message does not say) and the event's GUID.
type DeliveryKey struct {
	Hook int64
	GUID string
}

// Key is the Event's delivery identity.
func (ev *Event) Key() DeliveryKey { return DeliveryKey{Hook: ev.HookID, GUID: ev.DeliveryID} }

// AppCopy reports whether this copy of the event is the one GitHub sent to
// App appID's hook (installation target "integration", the App's id): the
// copy the App's record of its deliveries (the ledger) speaks of. A copy
// with no hook or target recorded, from before hooks were told apart,
// counts as the App's, as it did then. The store's appCopy clause says
// the same of github rows.
func (ev *Event) AppCopy(appID int64) bool {
	return (ev.TargetType == "integration" && ev.TargetID == appID) || (ev.HookID == 0 && ev.TargetType == "")
}

// Message header names.
const (
	hdrEvent      = "x-github-event"
	hdrDelivery   = "x-github-delivery"
	hdrHookID     = "x-github-hook-id"
	hdrTargetID   = "x-github-hook-installation-target-id"
	hdrTargetType = "x-github-hook-installation-target-type"
	hdrSourceIP   = "x-source-ip"
	// hdrReceivedAt is when the webhook endpoint took the delivery, in
	// timeFormat: the message's timestamp property has whole seconds only.
	hdrReceivedAt = "x-received-at"
)

// MalformedError is a delivery that does not have the shape GitHub's
// deliveries have: no retry can help it.
type MalformedError struct{ Reason string }

func (e *MalformedError) Error() string { return e.Reason }

func malformed(format string, args ...any) error {
	return &MalformedError{Reason: fmt.Sprintf(format, args...)}
}

// eventHeaders are the GitHub request headers a message carries, lower-cased.
var eventHeaders = []string{hdrEvent, hdrDelivery, hdrHookID, hdrTargetID, hdrTargetType}

// newPublishing builds the message for one webhook delivery: the raw payload as
// body and the GitHub headers as message headers.
func newPublishing(h http.Header, payload []byte, sourceIP string, now time.Time) amqp.Publishing {
	headers := amqp.Table{hdrSourceIP: sourceIP, hdrReceivedAt: formatTime(now)}
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

// eventPayload is what DecodeEvent reads of every payload: the wrapped
// form's two members, and the fields the Event's columns come from. Every
// typed table's payload type embeds it (newTablePayload), so that one pass
// decodes both; the tables read the repository and the sender from it too.
type eventPayload struct {
	Headers      json.RawMessage   `json:"headers"`
	Payload      json.RawMessage   `json:"payload"`
	Action       string            `json:"action"`
	Repository   *jsonRepo         `json:"repository"`
	Sender       *jsonUser         `json:"sender"`
	Installation *jsonInstallation `json:"installation"`
}

// jsonInstallation is a payload's installation: the id on every Event of an
// App's hook, the rest on installation Events.
type jsonInstallation struct {
	ID                  int64   `json:"id"`
	AppID               int64   `json:"app_id"`
	RepositorySelection string  `json:"repository_selection"`
	SuspendedAt         *string `json:"suspended_at"`
	Account             *struct {
		Login string `json:"login"`
		Type  string `json:"type"`
	} `json:"account"`
}

// tablePayload is a payload type of newTablePayload: an eventPayload and
// what the typed tables read.
type tablePayload interface{ event() *eventPayload }

func (p *eventPayload) event() *eventPayload { return p }

// Delivery is a message as DecodeEvent reads it: its AMQP message id, type,
// a reader of its headers, its body and when it was published.
type Delivery struct {
	MessageID string
	Type      string
	Header    func(k string) string
	Body      []byte
	// Zstd is Body as the message came, when it came zstd-compressed.
	Zstd      []byte
	Timestamp time.Time
}

// Payload pieces shared by several Events.
type (
	jsonUser struct {
		Login string `json:"login"`
	}
	jsonRepo struct {
		ID       int64  `json:"id"`
		FullName string `json:"full_name"`
		Name     string `json:"name"`
		Private  *bool  `json:"private"`
		Owner    *struct {
			Login string `json:"login"`
		} `json:"owner"`
	}
)

// repoParts splits the repository into owner and name, requiring both.
func repoParts(event string, r *jsonRepo) (owner, name string, err error) {
	if r == nil || r.FullName == "" {
		return "", "", malformed("%s: payload has no repository.full_name", event)
	}
	owner, name, ok := strings.Cut(r.FullName, "/")
	if !ok || owner == "" || name == "" {
		return "", "", malformed("%s: repository.full_name %q is not owner/name", event, r.FullName)
	}
	return owner, name, nil
}

func login(u *jsonUser) string {
	if u == nil {
		return ""
	}
	return u.Login
}

// decodedPayload is an Event's payload as the one pass of DecodeEvent
// read it, in the type the typed tables read (newTablePayload), and the
// first of its values that did not fit (shapeErr); the zero value for an
// Event built by hand.
type decodedPayload struct {
	value    tablePayload
	shapeErr error
}

// decodeInto is the Event's payload as T: src, the one DecodeEvent decoded,
// or, for an Event built by hand or of another name, the payload decoded
// now. A payload that does not fit the Event's shape is a permanent
// failure.
func decodeInto[T any](ev *Event, src decodedPayload) (*T, error) {
	p, ok := any(src.value).(*T)
	err := src.shapeErr
	if !ok {
		p = new(T)
		err = decodeJSON(ev.Payload, p)
	}
	if err != nil {
		return nil, malformed("%s: payload does not have the %s shape: %v", ev.Name, ev.Name, err)
	}
	return p, nil
}

// Actions that change the typed rows. Others are acked and logged at debug.
var (
	issueActions = []string{"opened", "reopened", "closed", "edited", "labeled", "unlabeled"}
	pullActions  = []string{"opened", "reopened", "closed", "edited", "labeled", "unlabeled",
		"synchronize", "ready_for_review", "converted_to_draft"}
	commentActions    = []string{"created", "edited", "deleted"}
	discussionActions = []string{"created", "edited", "deleted", "answered", "unanswered", "category_changed",
		"labeled", "unlabeled", "locked", "unlocked", "pinned", "unpinned", "transferred", "closed", "reopened"}
	checkRunActions     = []string{"created", "rerequested", "requested_action", "completed"}
	installationActions = []string{"created", "deleted", "suspend", "unsuspend", "new_permissions_accepted"}
)

// creationActions are the actions that ask for a row's work again when the
// row exists: a repeated creation is RE_REQUESTED, anything else UPDATED.
var creationActions = []string{"created", "opened", "reopened", "rerequested", "requested_action"}

// entityState is the processing state for an existing row of the tables
// without a state table of their own.
func entityState(action string) string {
	if slices.Contains(creationActions, action) {
		return "RE_REQUESTED"
	}
	return "UPDATED"
}

// timeFormat is how every time is stored, and how typed rows carry the
// payload's times: RFC 3339 in UTC with a fixed six fraction digits, so that
// text order is time order (GitHub's own times, with no fraction, would
// otherwise sort after the same second with one).
const timeFormat = "2006-01-02T15:04:05.000000Z"

func formatTime(t time.Time) string { return t.UTC().Format(timeFormat) }

// normalizeTime rewrites an RFC 3339 time from a payload in timeFormat; ok is
// false when s is not one.
func normalizeTime(s string) (string, bool) {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return "", false
	}
	return formatTime(t), true
}

// normalizedPtr rewrites a payload time in timeFormat; nil or unparsable is nil.
func normalizedPtr(s *string) *string {
	if s == nil {
		return nil
	}
	if t, ok := normalizeTime(*s); ok {
		return &t
	}
	return nil
}
