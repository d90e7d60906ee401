package main

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/julienschmidt/httprouter"
)

// brokerRef names a broker in API answers.
type brokerRef struct {
	Index int    `json:"index"`
	Host  string `json:"host"`
	Vhost string `json:"vhost"`
}

type brokerEntry struct {
	Index   int    `json:"index"`
	Host    string `json:"host"`
	Port    int    `json:"port"`
	Vhost   string `json:"vhost"`
	Active  bool   `json:"active"`
	Pending bool   `json:"pending"`
}

type pendingJSON struct {
	brokerRef
	SwitchedAt time.Time `json:"switched_at"`
	RecordedAt time.Time `json:"recorded_at"`
}

// BrokerStatus is the answer of GET /api/v1/broker.
type BrokerStatus struct {
	Active        brokerRef     `json:"active"`
	Brokers       []brokerEntry `json:"brokers"`
	PendingSwitch *pendingJSON  `json:"pending_switch"`
	LastSwitch    *LastSwitch   `json:"last_switch"`
	// Watermark is the switchedAt of the last accepted notification;
	// null when there is none (never, or cleared by the operator).
	Watermark *time.Time `json:"watermark"`
}

func (a *API) status(st SwitchState) BrokerStatus {
	var out BrokerStatus
	for _, b := range a.brokers.List() {
		pending := st.Pending != nil && st.Pending.Index == b.Index
		out.Brokers = append(out.Brokers, brokerEntry{Index: b.Index, Host: b.Host, Port: b.Port, Vhost: b.Vhost,
			Active: b.Index == st.Active, Pending: pending})
		if b.Index == st.Active {
			out.Active = brokerRef{Index: b.Index, Host: b.Host, Vhost: b.Vhost}
		}
	}
	if p := st.Pending; p != nil {
		out.PendingSwitch = &pendingJSON{brokerRef{p.Index, p.Host, p.Vhost}, p.SwitchedAt.UTC(), p.RecordedAt.UTC()}
	}
	out.LastSwitch = st.Last
	if !st.Watermark.IsZero() {
		wm := st.Watermark.UTC()
		out.Watermark = &wm
	}
	return out
}

func (a *API) getBroker(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	st, err := a.brokers.State(r.Context())
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	writeJSON(w, http.StatusOK, a.status(st))
}

func (a *API) switchBroker(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
	index, err := strconv.Atoi(ps.ByName("index"))
	if err != nil {
		writeError(w, r, a.log, errorf(CodeInvalid, "broker index %q is not an integer", ps.ByName("index")))
		return
	}
	st, err := a.brokers.SwitchTo(r.Context(), index)
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	a.log.Info("operator switched broker", "to", index)
	writeJSON(w, http.StatusOK, a.status(st))
}

// switchNotification is the producer's POST body.
type switchNotification struct {
	Host       *string `json:"host"`
	Vhost      *string `json:"vhost"`
	SwitchedAt *string `json:"switchedAt"`
}

func decodeNotification(r io.Reader) (host, vhost string, at time.Time, err error) {
	var n switchNotification
	dec := json.NewDecoder(r)
	if err := dec.Decode(&n); err != nil {
		return "", "", at, errorf(CodeInvalid, "malformed JSON: %v", err)
	}
	if dec.More() {
		return "", "", at, errorf(CodeInvalid, "trailing data after the JSON object")
	}
	if n.Host == nil || *n.Host == "" || n.Vhost == nil || n.SwitchedAt == nil {
		return "", "", at, errorf(CodeInvalid, "host, vhost and switchedAt are required")
	}
	at, err = time.Parse(time.RFC3339, *n.SwitchedAt)
	if err != nil {
		return "", "", at, errorf(CodeInvalid, "switchedAt is not an RFC 3339 time: %q", *n.SwitchedAt)
	}
	return *n.Host, *n.Vhost, at, nil
}

// notifySwitch takes the producer's "I now publish to host/vhost".
func (a *API) notifySwitch(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	host, vhost, at, err := decodeNotification(r.Body)
	if err == nil && time.Until(at) > a.cfg.API.MaxClockSkew {
		// Accepted, it would make every real notification after it stale.
		err = errorf(CodeInvalid, "switchedAt %s is more than %s in the future (api.max_clock_skew)",
			at.UTC().Format(time.RFC3339Nano), a.cfg.API.MaxClockSkew)
	}
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	result, st, err := a.brokers.Notify(r.Context(), host, vhost, at)
	if errors.Is(err, ErrStale) {
		a.log.Info("stale switch notification ignored", "host", host, "vhost", vhost, "switched_at", at)
		writeJSON(w, http.StatusOK, map[string]string{"status": "ignored", "reason": "stale"})
		return
	}
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	a.log.Info("switch notification accepted", "host", host, "vhost", vhost, "switched_at", at, "result", result)
	code := http.StatusOK
	if result == "pending" {
		code = http.StatusAccepted
	}
	writeJSON(w, code, struct {
		Status string `json:"status"`
		BrokerStatus
	}{result, a.status(st)})
}

func (a *API) cancelSwitch(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	had, st, err := a.brokers.CancelPending(r.Context())
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	if had {
		a.log.Info("operator cancelled the pending switch")
	}
	writeJSON(w, http.StatusOK, struct {
		Cancelled bool `json:"cancelled"`
		BrokerStatus
	}{had, a.status(st)})
}

// clearWatermark forgets the switchedAt of the last accepted notification,
// so that the next notification is accepted whatever its time: the way out
// of a watermark set too far ahead by a producer with a wrong clock.
func (a *API) clearWatermark(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	st, err := a.brokers.ClearWatermark(r.Context())
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	a.log.Info("operator cleared the switch watermark")
	writeJSON(w, http.StatusOK, a.status(st))
}
