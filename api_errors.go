package main

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
)

// The errors of the HTTP surface and their statuses, in one place, and how
// every handler answers: JSON.

// Request errors of the webhook endpoint.
var (
	// Apart, because GitHub's Recent Deliveries shows the operator the
	// answer: a missing signature means the hook has no secret set, a wrong
	// one that it has another secret than switchyard.
	ErrNoSignature  = errors.New("missing X-Hub-Signature-256: set the hook's secret in GitHub to github.webhook_secret")
	ErrBadSignature = errors.New("invalid X-Hub-Signature-256: the hook's secret in GitHub is not github.webhook_secret")
	ErrTooLarge     = errors.New("body too large")
	ErrUnavailable  = errors.New("broker unavailable, retry later")
)

// Errors of the admin API that map to statuses.
var (
	ErrUnauthorized = errors.New("missing or invalid bearer token")
	ErrForbidden    = errors.New("this token may not use this endpoint")
)

// statusOf maps an error to its HTTP status, in one place.
func statusOf(err error) int {
	switch {
	case errors.Is(err, ErrNoSignature), errors.Is(err, ErrBadSignature), errors.Is(err, ErrUnauthorized):
		return http.StatusUnauthorized
	case errors.Is(err, ErrForbidden):
		return http.StatusForbidden
	case errors.Is(err, ErrBadRequest):
		return http.StatusBadRequest
	case errors.Is(err, ErrTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrUnknownBroker):
		return http.StatusNotFound
	case errors.Is(err, ErrUnavailable):
		return http.StatusServiceUnavailable
	default:
		return http.StatusInternalServerError
	}
}

// writeError answers {"error": "..."} with the error's status; only server
// errors are logged, and their text stays in the log.
func writeError(w http.ResponseWriter, r *http.Request, log *slog.Logger, err error) {
	status := statusOf(err)
	msg := err.Error()
	if status >= 500 {
		log.Error("request failed", "method", r.Method, "path", r.URL.Path, "error", err)
		msg = "internal error"
	}
	writeJSON(w, status, map[string]string{"error": msg})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
