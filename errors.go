package main

import (
	"errors"
	"fmt"
	"strings"
)

// Error is an error a request is answered with: its kind (Code, which one
// table maps to an HTTP status, api_errors.go) and the message the answer
// carries, both set where the error is made. Err is the cause, for the
// log only: an answer never carries more than Message, however the error
// was wrapped on its way up.
type Error struct {
	Code    ErrorCode
	Message string
	Err     error
	// kind marks an error that stands for its kind (ErrUnknownDelivery):
	// errors.Is matches to it every Error of its code whose message
	// begins with its own.
	kind bool
}

// ErrorCode is the kind of an Error.
type ErrorCode string

// The codes an answer may carry.
const (
	CodeInvalid      ErrorCode = "invalid"      // the request is malformed
	CodeUnauthorized ErrorCode = "unauthorized" // no or wrong credentials
	CodeForbidden    ErrorCode = "forbidden"    // credentials that may not do this
	CodeNotFound     ErrorCode = "not_found"
	CodeMethod       ErrorCode = "method"      // a method the path does not take
	CodeConflict     ErrorCode = "conflict"    // not possible in this configuration
	CodeTooLarge     ErrorCode = "too_large"   // a body over its bound
	CodeTooMany      ErrorCode = "too_many"    // an address that failed too often
	CodeUnavailable  ErrorCode = "unavailable" // try again later
)

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Message + ": " + e.Err.Error()
	}
	return e.Message
}

func (e *Error) Unwrap() error { return e.Err }

// Is matches an error to a kind (ErrUnknownDelivery and the like) of its
// code whose message its own begins with.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.kind && t.Code == e.Code && strings.HasPrefix(e.Message, t.Message)
}

// errorf is an Error of code whose message is format's.
func errorf(code ErrorCode, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// errorKind is the Error that stands for code, with message as its text.
func errorKind(code ErrorCode, message string) *Error {
	return &Error{Code: code, Message: message, kind: true}
}

// errorOf is err's Error, the outermost of its chain; nil when it has none.
func errorOf(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return nil
}
