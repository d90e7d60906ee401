package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
)

// The errors of the HTTP surface and their statuses, in one place, and how
// every handler answers: JSON.

// Request errors of the webhook endpoint.
var (
	// Apart, because GitHub's Recent Deliveries shows the operator the
	// answer: a missing signature means the hook has no secret set, a wrong
	// one that it has another secret than switchyard (badSignature).
	ErrNoSignature  = errors.New("missing X-Hub-Signature-256: set the hook's secret in GitHub to github.webhook_secret")
	ErrBadSignature = errors.New("invalid X-Hub-Signature-256") // badSignature says which secret
	ErrTooLarge     = errors.New("body too large")
	ErrUnavailable  = errors.New("broker unavailable, retry later")
)

// ErrBusy is a webhook refused for lack of room: too many body bytes are
// being read at once. 503 with Retry-After.
var ErrBusy = fmt.Errorf("%w: too many webhook bytes in flight", ErrUnavailable)

// Errors of the admin API and the operator's pages that map to statuses.
var (
	ErrUnauthorized     = errors.New("missing or invalid bearer token")
	ErrPageUnauthorized = errors.New("unauthorized: user operator, the operator token as password")
	ErrForbidden        = errors.New("this token may not use this endpoint")
	ErrNotOurPage       = errors.New("the request did not come from this server's page")
	ErrStaleForm        = errors.New("missing or stale form token: load the delivery's page again")
	ErrConflict         = errors.New("not possible in this configuration")
	ErrNotFound         = errors.New("not found")
	ErrMethodNotAllowed = errors.New("method not allowed")
	ErrTooManyFailures  = errors.New("too many failed authentications from this address; retry later")
)

// statusOf maps an error to its HTTP status, in one place.
func statusOf(err error) int {
	switch {
	case errors.Is(err, ErrNoSignature), errors.Is(err, ErrBadSignature), errors.Is(err, ErrUnauthorized),
		errors.Is(err, ErrPageUnauthorized):
		return http.StatusUnauthorized
	case errors.Is(err, ErrForbidden), errors.Is(err, ErrNotOurPage), errors.Is(err, ErrStaleForm):
		return http.StatusForbidden
	case errors.Is(err, ErrConflict):
		return http.StatusConflict
	case errors.Is(err, ErrBadRequest):
		return http.StatusBadRequest
	case errors.Is(err, ErrTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrUnknownBroker), errors.Is(err, ErrUnknownDelivery), errors.Is(err, ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrMethodNotAllowed):
		return http.StatusMethodNotAllowed
	case errors.Is(err, ErrTooManyFailures):
		return http.StatusTooManyRequests
	case errors.Is(err, ErrUnavailable):
		return http.StatusServiceUnavailable
	default:
		return http.StatusInternalServerError
	}
}

// publicText is the one mapping from an error to the text an answer
// carries, for every path that writes a body: a request's own fault (4xx)
// says what was wrong with the request; a broker's failure says only its
// kind (brokerProblem); anything else is "internal error".
func publicText(err error) string {
	var pub interface{ public() string }
	switch status := statusOf(err); {
	case errors.As(err, &pub):
		return pub.public()
	case status >= 500 && errors.Is(err, ErrBusy):
		return ErrBusy.Error()
	case status >= 500:
		return "internal error"
	}
	return err.Error()
}

// writeError answers {"error": "..."} with the error's status and its
// public text: every error body goes through it. Only server errors are
// logged, with their whole cause, unless log is nil (the caller logged).
//
// An operator's page (under /status) is answered in plain text, for the
// browser that shows it: the status and the same public text.
func writeError(w http.ResponseWriter, r *http.Request, log *slog.Logger, err error) {
	status := statusOf(err)
	if status >= 500 && log != nil {
		log.Error("request failed", "method", r.Method, "path", r.URL.Path, "error", err)
	}
	if isPage(r) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.WriteHeader(status)
		fmt.Fprintf(w, "%d %s\n", status, publicText(err))
		return
	}
	writeJSON(w, status, map[string]string{"error": publicText(err)})
}

// isPage reports whether r asks for an operator's page, not the API.
func isPage(r *http.Request) bool {
	return r.URL.Path == "/status" || strings.HasPrefix(r.URL.Path, "/status/")
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
