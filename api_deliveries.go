package main

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/julienschmidt/httprouter"
)

// The operator's search of the stored deliveries: GET /status/deliveries
// lists them newest first, 50 a page by default, narrowed by GUID prefix,
// event, action, repository, sender, outcome and time range, with keyset
// pages; GET /status/deliveries/GUID tells one delivery's story with its
// payload. Both behind the status page's Basic auth.

const (
	deliveriesPageSize = 50
	maxDeliveriesLimit = 200
	// shownPayload is the most of a payload the delivery page shows; the
	// whole one is a download.
	shownPayload = 256 << 10
)

// deliveriesQuery reads a search from the query string; a malformed field
// is a CodeInvalid Error naming it.
func deliveriesQuery(q url.Values) (f DeliveryFilter, limit int, err error) {
	bad := func(field, format string, args ...any) error {
		return errorf(CodeInvalid, "%s: %s", field, fmt.Sprintf(format, args...))
	}
	name := func(field string) (string, error) {
		v := q.Get(field)
		if !eventName(v) {
			return "", bad(field, "want up to %d of a-z, 0-9 and _", maxEventLen)
		}
		return v, nil
	}
	text := func(field string) (string, error) {
		v := q.Get(field)
		if len(v) > maxHeaderLen || strings.IndexFunc(v, func(c rune) bool { return c < ' ' }) >= 0 {
			return "", bad(field, "want up to %d printable bytes", maxHeaderLen)
		}
		return v, nil
	}
	when := func(field string) (time.Time, error) {
		v := q.Get(field)
		if v == "" {
			return time.Time{}, nil
		}
		t, err := time.Parse(time.RFC3339, v)
		if err != nil {
			return time.Time{}, bad(field, "want an RFC 3339 time such as 2026-12-01T00:00:00Z")
		}
		return t, nil
	}
	if f.GUIDPrefix, err = text("guid"); err != nil {
		return f, 0, err
	}
	if f.Event, err = name("event"); err != nil {
		return f, 0, err
	}
	if f.Action, err = name("action"); err != nil {
		return f, 0, err
	}
	if f.Repository, err = text("repository"); err != nil {
		return f, 0, err
	}
	if f.Sender, err = text("sender"); err != nil {
		return f, 0, err
	}
	switch f.Outcome = q.Get("outcome"); f.Outcome {
	case "", "stored", "forbidden", "stale":
	case "rejected":
		for _, field := range []string{"action", "repository", "sender"} {
			if q.Get(field) != "" {
				return f, 0, bad(field, "a refused webhook's body is not kept: outcome=rejected is narrowed by guid, event, hook and time only")
			}
		}
	default:
		return f, 0, bad("outcome", "want stored, forbidden, stale or rejected")
	}
	hook, err := hookQuery(q)
	if err != nil {
		return f, 0, err
	}
	if hook >= 0 {
		f.Hook = &hook
	}
	if f.From, err = when("from"); err != nil {
		return f, 0, err
	}
	if f.To, err = when("to"); err != nil {
		return f, 0, err
	}
	if !f.From.IsZero() && !f.To.IsZero() && !f.From.Before(f.To) {
		return f, 0, bad("to", "want a time after from")
	}
	limit = deliveriesPageSize
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 1 || limit > maxDeliveriesLimit {
			return f, 0, bad("limit", "want 1 to %d", maxDeliveriesLimit)
		}
	}
	if v := q.Get("after"); v != "" {
		at, id, ok := strings.Cut(v, "_")
		t, terr := time.Parse(time.RFC3339Nano, at)
		n, nerr := strconv.ParseInt(id, 10, 64)
		if !ok || terr != nil || nerr != nil {
			return f, 0, bad("after", "not a cursor this page gave")
		}
		f.AfterTime, f.AfterID = t, n
	}
	return f, limit, nil
}

// searchPage is one page of the search r's query asks for, and the query
// of the next page ("" for the last). A malformed field is an
// CodeInvalid Error naming it.
func (a *API) searchPage(r *http.Request) (rows []DeliveryRow, next string, err error) {
	f, limit, err := deliveriesQuery(r.URL.Query())
	if err != nil {
		return nil, "", err
	}
	rows, more, err := a.store.SearchDeliveries(r.Context(), f, limit)
	if err != nil {
		return nil, "", err
	}
	if more {
		q := r.URL.Query()
		last := rows[len(rows)-1]
		q.Set("after", last.ReceivedAt.UTC().Format(time.RFC3339Nano)+"_"+strconv.FormatInt(last.ID, 10))
		next = q.Encode()
	}
	return rows, next, nil
}

// deliveriesPage is GET /status/deliveries.
func (a *API) deliveriesPage(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	rows, next, err := a.searchPage(r)
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	page := struct {
		Query url.Values
		Rows  []DeliveryRow
		Next  string
	}{Query: r.URL.Query(), Rows: rows}
	if next != "" {
		page.Next = "/status/deliveries?" + next
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := deliveriesTemplate.Execute(w, page); err != nil {
		a.log.Warn("deliveries page", "error", err)
	}
}

// deliveryPage is GET /status/deliveries/GUID: the story (every hook's
// copy, or with ?hook=ID that hook's only) and each copy's payload under
// its hook ID, or with ?download=1&hook=ID that copy's whole payload as
// application/json.
func (a *API) deliveryPage(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
	guid := ps.ByName("guid")
	hook, err := hookQuery(r.URL.Query())
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	st, err := a.store.Story(r.Context(), guid)
	if err == nil && hook >= 0 {
		err = st.Narrow(hook)
	}
	if err == nil {
		st.LinkTraces(a.cfg.Tracing.UIURL)
	}
	if errors.Is(err, ErrUnknownDelivery) {
		// Not stored: it may still wait in an -error queue, so the page
		// offers the replay.
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.WriteHeader(http.StatusNotFound)
		_ = unknownTemplate.Execute(w, a.actions(r, guid))
		return
	}
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	if r.URL.Query().Get("download") == "1" {
		// The copy ?hook= names (narrowed above), else the first one.
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Disposition", `attachment; filename="delivery.json"`)
		_, _ = w.Write([]byte(st.Payload()))
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := deliveryTemplate.Execute(w, struct {
		*DeliveryStory
		pageActions
		GUID     string // both embed one
		Lines    []StoryLine
		Payloads []pagePayload
	}{st, a.actions(r, guid), guid, st.Lines(), pagePayloads(st)}); err != nil {
		a.log.Warn("delivery page", "error", err)
	}
}

// getDeliveries is GET /api/v1/deliveries: the search of the deliveries
// page (its query parameters) as JSON, newest first, and the URL of the
// next page (its cursor) while there is one.
func (a *API) getDeliveries(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	rows, next, err := a.searchPage(r)
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	page := struct {
		Deliveries []DeliveryRow `json:"deliveries"`
		Next       string        `json:"next,omitempty"`
	}{Deliveries: rows}
	if page.Deliveries == nil {
		page.Deliveries = []DeliveryRow{}
	}
	if next != "" {
		page.Next = "/api/v1/deliveries?" + next
	}
	writeJSON(w, http.StatusOK, page)
}

// getDelivery is GET /api/v1/deliveries/GUID: the delivery's story as
// JSON, every hook's copy or, with ?hook=ID, that hook's only; 404 for a
// GUID the database does not know.
func (a *API) getDelivery(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
	hook, err := hookQuery(r.URL.Query())
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	st, err := a.store.Story(r.Context(), ps.ByName("guid"))
	if err == nil && hook >= 0 {
		err = st.Narrow(hook)
	}
	if err == nil {
		st.LinkTraces(a.cfg.Tracing.UIURL)
	}
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	writeJSON(w, http.StatusOK, st)
}

// pagePayload is one copy's payload as the delivery page shows it: under
// its hook ID, the first shownPayload bytes, and a link to the whole.
type pagePayload struct {
	Hook     int64
	Shown    string
	Cut      bool
	Download string
}

// pagePayloads are the payloads of the story's stored copies, each under
// its hook: two hooks' copies of one event are two payloads (GitHub sends
// each hook its own), and each downloads apart.
func pagePayloads(st *DeliveryStory) []pagePayload {
	var out []pagePayload
	for _, c := range st.Copies {
		if c.Received == nil || c.Payload == "" {
			continue
		}
		p := pagePayload{Hook: c.Hook, Shown: c.Payload, Download: "?download=1&hook=" + strconv.FormatInt(c.Hook, 10)}
		if p.Cut = len(p.Shown) > shownPayload; p.Cut {
			p.Shown = p.Shown[:shownPayload]
		}
		out = append(out, p)
	}
	return out
}

// hookQuery reads ?hook=, the hook whose copy alone a page shows; -1 when
// it is not given.
func hookQuery(q url.Values) (int64, error) {
	v := q.Get("hook")
	if v == "" {
		return -1, nil
	}
	id, err := parseHookID(v)
	if err != nil {
		return 0, errorf(CodeInvalid, "hook: want the X-GitHub-Hook-ID of a copy, up to %d digits", maxHookIDLen)
	}
	return id, nil
}

// csrfToken is the token the delivery page's form for action on guid
// carries: only a page this daemon served can post it.
func (a *API) csrfToken(action, guid string) string {
	mac := hmac.New(sha256.New, a.csrfKey)
	mac.Write([]byte(action + "\x00" + guid))
	return hex.EncodeToString(mac.Sum(nil))
}

// sameOrigin reports whether a browser's POST came from a page of this
// host: its Origin, else its Referer, names the host the request was sent to.
func sameOrigin(r *http.Request) bool {
	from := r.Header.Get("Origin")
	if from == "" {
		from = r.Header.Get("Referer")
	}
	u, err := url.Parse(from)
	return err == nil && from != "" && u.Host == r.Host
}

// replayDelivery is POST /status/deliveries/GUID/replay: the delivery's
// message, wherever it waits in an -error queue of any broker, goes back to
// its queue on the active broker, as the replay command moves it. It takes
// only a form this daemon served (same origin, CSRF token), logs who asked,
// and a second ask finds nothing and says so.
func (a *API) replayDelivery(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
	guid := ps.ByName("guid")
	if !a.formAllowed(w, r, "replay", guid) {
		return
	}
	src := addrText(a.webhook.sourceIP(r))
	to, err := a.brokers.Get(a.brokers.Cached().Active)
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	done := "none"
	for _, from := range a.brokers.List() {
		for _, queue := range logicalQueues {
			found, err := a.queues.ReplayOne(r.Context(), from, to, queue, guid)
			if err != nil {
				a.log.Warn("replay from -error: a broker could not be searched", "broker", from.String(), "queue", errorQueue(queue), "error", err)
				continue
			}
			if found {
				done = queue
				a.log.Info("replayed from -error at the operator's request", "delivery_id", guid, "from", from.String(),
					"queue", errorQueue(queue), "to", to.String(), "source_ip", src)
				break
			}
		}
		if done != "none" {
			break
		}
	}
	if done == "none" {
		a.log.Info("replay from -error asked: not in any -error queue, nothing done", "delivery_id", guid, "source_ip", src)
	}
	http.Redirect(w, r, "/status/deliveries/"+url.PathEscape(guid)+"?replayed="+url.QueryEscape(done), http.StatusSeeOther)
}

// pageActions are a delivery page's forms and what their last press did.
type pageActions struct {
	GUID, ReplayToken, RedeliverToken string
	Replayed, Redelivered             string
	App                               bool // the GitHub App is configured: GitHub can be asked
}

func (a *API) actions(r *http.Request, guid string) pageActions {
	q := r.URL.Query()
	return pageActions{GUID: guid, ReplayToken: a.csrfToken("replay", guid), RedeliverToken: a.csrfToken("redeliver", guid),
		Replayed: q.Get("replayed"), Redelivered: q.Get("redelivered"), App: a.hooks != nil}
}

// formAllowed checks that a POST of action on guid came from this daemon's
// page (same origin, the form's token) and answers 403 when it did not.
func (a *API) formAllowed(w http.ResponseWriter, r *http.Request, action, guid string) bool {
	if !sameOrigin(r) {
		writeError(w, r, a.log, ErrNotOurPage)
		return false
	}
	if err := r.ParseForm(); err != nil || !hmac.Equal([]byte(r.PostForm.Get("token")), []byte(a.csrfToken(action, guid))) {
		writeError(w, r, a.log, ErrStaleForm)
		return false
	}
	return true
}

// redeliverDelivery is POST /status/deliveries/GUID/redeliver: ask GitHub
// to deliver it again (Hooks.RedeliverOne), with the App configured.
func (a *API) redeliverDelivery(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
	guid := ps.ByName("guid")
	if !a.formAllowed(w, r, "redeliver", guid) {
		return
	}
	if a.hooks == nil {
		writeError(w, r, a.log, errorf(CodeConflict, "no GitHub App is configured (github.app_id): redeliver it from GitHub's Recent Deliveries"))
		return
	}
	done, err := a.hooks.RedeliverOne(r.Context(), guid)
	if err != nil {
		a.log.Warn("redelivery asked at the operator's request failed", "delivery_id", guid, "error", err)
		done = "failed"
	}
	a.log.Info("redelivery asked at the operator's request", "delivery_id", guid, "outcome", done,
		"source_ip", addrText(a.webhook.sourceIP(r)))
	http.Redirect(w, r, "/status/deliveries/"+url.PathEscape(guid)+"?redelivered="+url.QueryEscape(done), http.StatusSeeOther)
}

var pageFuncs = template.FuncMap{
	"when": func(v any) string {
		switch t := v.(type) {
		case time.Time:
			return t.UTC().Format("2006-01-02 15:04:05 UTC")
		case *time.Time:
			if t != nil {
				return t.UTC().Format("2006-01-02 15:04:05 UTC")
			}
		}
		return ""
	},
	"escape": url.PathEscape,
	"split":  strings.Fields,
}

var deliveriesTemplate = template.Must(template.New("deliveries").Funcs(pageFuncs).Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>switchyard deliveries</title>
<style>body{font:15px/1.4 system-ui,sans-serif;margin:0 auto;max-width:70rem;padding:.8rem}table{border-collapse:collapse;width:100%;font-size:.9rem}th,td{text-align:left;padding:.2rem .4rem;border-bottom:1px solid #eaeef2}input,select{font:inherit}</style>
</head><body>
<h1><a href="/status">switchyard</a> · deliveries</h1>
<form method="get" action="/status/deliveries" id="search">
<input name="guid" placeholder="GUID prefix" value="{{.Query.Get "guid"}}">
<input name="event" placeholder="event" value="{{.Query.Get "event"}}">
<input name="action" placeholder="action" value="{{.Query.Get "action"}}">
<input name="repository" placeholder="owner/name" value="{{.Query.Get "repository"}}">
<input name="sender" placeholder="sender" value="{{.Query.Get "sender"}}">
<input name="hook" placeholder="hook ID" value="{{.Query.Get "hook"}}">
<select name="outcome"><option value="">any outcome</option>{{$o := .Query.Get "outcome"}}{{range $v := (split "stored forbidden stale rejected")}}<option{{if eq $v $o}} selected{{end}}>{{$v}}</option>{{end}}</select>
<input name="from" placeholder="from (RFC 3339)" value="{{.Query.Get "from"}}">
<input name="to" placeholder="to (RFC 3339)" value="{{.Query.Get "to"}}">
<button type="submit">Search</button>
</form>
<table id="deliveries">
<tr><th>received</th><th>delivery</th><th>hook</th><th>event</th><th>repository</th><th>sender</th><th>outcome</th></tr>
{{range .Rows}}<tr><td>{{when .ReceivedAt}}</td><td>{{if .GUID}}<a href="/status/deliveries/{{escape .GUID}}{{if ge .Hook 0}}?hook={{.Hook}}{{end}}">{{.GUID}}</a>{{else}}-{{end}}</td><td>{{if ge .Hook 0}}{{.Hook}}{{else}}-{{end}}{{with .TargetType}} ({{.}}){{end}}</td><td>{{.Event}}{{if .Action}}.{{.Action}}{{end}}</td><td>{{.Repository}}</td><td>{{.Sender}}</td><td>{{.Outcome}}{{if .Status}} {{.Status}} from {{.SourceIP}}: {{.Reason}}{{end}}{{if .Pruned}} (payload pruned){{end}}</td></tr>
{{else}}<tr><td colspan="7">No delivery matches.</td></tr>{{end}}
</table>
{{with .Next}}<p><a id="next" href="{{.}}">Older →</a></p>{{end}}
</body></html>`))

var deliveryTemplate = template.Must(template.Must(template.New("delivery").Funcs(pageFuncs).Parse(replayForm)).Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>switchyard delivery {{.GUID}}</title>
<style>body{font:15px/1.4 system-ui,sans-serif;margin:0 auto;max-width:70rem;padding:.8rem}table{border-collapse:collapse}th,td{text-align:left;padding:.2rem .4rem;border-bottom:1px solid #eaeef2;vertical-align:top}pre{white-space:pre-wrap;word-break:break-all;background:#f6f8fa;padding:.5rem}</style>
</head><body>
<h1><a href="/status">switchyard</a> · <a href="/status/deliveries">deliveries</a> · {{.GUID}}</h1>
<table id="story">
{{range .Lines}}{{if .Head}}<tr class="copy"><th colspan="2">{{.Text}}</th></tr>{{else}}<tr><th>{{.Label}}</th><td>{{.Text}}</td></tr>{{end}}
{{end}}</table>
{{range .Copies}}{{$hook := .Hook}}{{with .Received}}<h2>Request headers, hook {{$hook}}</h2>
<table class="headers">
<tr><th>X-GitHub-Delivery</th><td>{{$.GUID}}</td></tr>
<tr><th>X-GitHub-Event</th><td>{{.Event}}</td></tr>
{{if $hook}}<tr><th>X-GitHub-Hook-ID</th><td>{{$hook}}</td></tr>{{end}}
{{if .TargetType}}<tr><th>X-GitHub-Hook-Installation-Target-Type</th><td>{{.TargetType}}</td></tr>
<tr><th>X-GitHub-Hook-Installation-Target-ID</th><td>{{.TargetID}}</td></tr>{{end}}
<tr><th>from</th><td>{{.SourceIP}}</td></tr>
</table>{{end}}{{end}}
{{template "replay" .}}
{{range .Payloads}}<h2>Payload, hook {{.Hook}}</h2>
{{if .Cut}}<p>The first 256 KiB; <a href="{{.Download}}">download the whole payload</a>.</p>{{else}}<p><a href="{{.Download}}">Download</a></p>{{end}}
<pre class="payload" id="payload-{{.Hook}}">{{.Shown}}</pre>
{{end}}
</body></html>`))

// replayForm is the delivery pages' replay button, and what the last
// press found.
const replayForm = `{{define "replay"}}{{with .Replayed}}<p id="replayed">{{if eq . "none"}}Not in any -error queue: nothing was done.{{else}}Moved from {{.}}-error back to {{.}} on the active broker.{{end}}</p>{{end}}
<form method="post" action="/status/deliveries/{{escape .GUID}}/replay" id="replay">
<input type="hidden" name="token" value="{{.ReplayToken}}">
<button type="submit">Replay from -error</button> <span>moves its message, if an -error queue of any broker holds it, back to its queue on the active broker</span>
</form>
{{if .App}}{{with .Redelivered}}<p id="redelivered">{{if eq . "asked"}}GitHub was asked to deliver it again.{{else if eq . "already"}}GitHub was asked before: nothing was sent.{{else if eq . "unknown"}}GitHub's id of this delivery is not known here (it is neither a gap nor a failed delivery the ledger queued): use GitHub's Recent Deliveries.{{else if eq . "paced"}}github.redeliver_per_minute reached: try again in a minute.{{else if eq . "refused"}}GitHub refused: it no longer has the delivery, or will not deliver it again.{{else}}The request failed; the log says why.{{end}}</p>{{end}}
<form method="post" action="/status/deliveries/{{escape .GUID}}/redeliver" id="redeliver">
<input type="hidden" name="token" value="{{.RedeliverToken}}">
<button type="submit">Ask GitHub to redeliver</button> <span>when GitHub still holds it (3 days)</span>
</form>{{end}}{{end}}`

var unknownTemplate = template.Must(template.Must(template.New("unknown").Funcs(pageFuncs).Parse(replayForm)).Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>switchyard delivery {{.GUID}}</title></head><body>
<h1><a href="/status">switchyard</a> · <a href="/status/deliveries">deliveries</a> · {{.GUID}}</h1>
<p>No delivery {{.GUID}} is stored.</p>
{{template "replay" .}}
</body></html>`))
