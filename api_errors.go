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

// Request errors of the webhook endpoint, each the kind of its code or
// made with its message where the request fails (errorf).
var (
	// Apart, because GitHub's Recent Deliveries shows the operator the
	// answer: a missing signature means the hook has no secret set, a wrong
	// one that it has another secret than switchyard (badSignature).
	ErrNoSignature  = errorf(CodeUnauthorized, "missing X-Hub-Signature-256: set the hook's secret in GitHub to github.webhook_secret")
	ErrBadSignature = errorKind(CodeUnauthorized, "invalid X-Hub-Signature-256") // badSignature says which secret
	ErrTooLarge     = errorKind(CodeTooLarge, "body too large")
	ErrUnavailable  = errorKind(CodeUnavailable, "broker unavailable, retry later")
	// ErrBusy is a webhook refused for lack of room: too many body bytes
	// are being read at once. 503 with Retry-After.
	ErrBusy = errorf(CodeUnavailable, "too many webhook bytes in flight, retry later")
)

// Errors of the admin API and the operator's pages.
var (
	ErrUnauthorized     = errorf(CodeUnauthorized, "missing or invalid bearer token")
	ErrPageUnauthorized = errorf(CodeUnauthorized, "unauthorized: user operator, the operator token as password")
	ErrForbidden        = errorf(CodeForbidden, "this token may not use this endpoint")
	ErrNotOurPage       = errorf(CodeForbidden, "the request did not come from this server's page")
	ErrStaleForm        = errorf(CodeForbidden, "missing or stale form token: load the delivery's page again")
	ErrNotFound         = errorf(CodeNotFound, "not found")
	ErrMethodNotAllowed = errorf(CodeMethod, "method not allowed")
	ErrTooManyFailures  = errorf(CodeTooMany, "too many failed authentications from this address; retry later")
)

// codeStatus is the one table of the HTTP status each code answers.
var codeStatus = map[ErrorCode]int{
	CodeInvalid:      http.StatusBadRequest,
	CodeUnauthorized: http.StatusUnauthorized,
	CodeForbidden:    http.StatusForbidden,
	CodeNotFound:     http.StatusNotFound,
	CodeMethod:       http.StatusMethodNotAllowed,
	CodeConflict:     http.StatusConflict,
	CodeTooLarge:     http.StatusRequestEntityTooLarge,
	CodeTooMany:      http.StatusTooManyRequests,
	CodeUnavailable:  http.StatusServiceUnavailable,
}

// statusOf is err's HTTP status: its code's (codeStatus), or 500 for an
// error that is no request's answer.
func statusOf(err error) int {
	if e := errorOf(err); e != nil {
		if status, ok := codeStatus[e.Code]; ok {
			return status
		}
	}
	return http.StatusInternalServerError
}

// publicText is the one mapping from an error to the text an answer
// carries, for every path that writes a body: the message of its Error,
// set where it was made, never the chain it was wrapped in; a broker's
// failure says only its kind (the error's public, brokerProblem); anything
// else is "internal error".
func publicText(err error) string {
	var pub interface{ public() string }
	if errors.As(err, &pub) {
		return pub.public()
	}
	if e := errorOf(err); e != nil && statusOf(err) != http.StatusInternalServerError {
		return e.Message
	}
	return "internal error"
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
