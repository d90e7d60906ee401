package main

import (
	"cmp"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// What GitHub's webhooks are and how they are told from forgeries: its
// signature, and the headers a delivery
// carries, checked before any of them is copied into a message, whether
// the delivery came to the webhook endpoint or from GitHub's API.

// maxWebhookBody is GitHub's own cap on a webhook payload.
const maxWebhookBody = 25 << 20

// validSignature checks an X-Hub-Signature-256 header against every
// accepted secret, in constant time per secret.
func validSignature(secrets [][]byte, body []byte, header string) bool {
	sig, ok := strings.CutPrefix(header, "sha256=")
	if !ok {
		return false
	}
	want, err := hex.DecodeString(sig)
	if err != nil || len(want) != sha256.Size {
		return false
	}
	valid := false
	for _, secret := range secrets {
		mac := hmac.New(sha256.New, secret)
		mac.Write(body)
		if hmac.Equal(mac.Sum(nil), want) {
			valid = true
		}
	}
	return valid
}

// Limits on the request headers copied into the AMQP message:
// AMQP short strings (message_id, type) hold 255 bytes, and a header table
// larger than the broker's frame size closes the connection every worker
// shares, so nothing unchecked may reach a publish.
const (
	maxDeliveryLen = 255
	maxEventLen    = 64
	maxHeaderLen   = 255
	// maxHookIDLen is the most digits X-GitHub-Hook-ID may have.
	maxHookIDLen = 20
)

// parseHookID reads X-GitHub-Hook-ID: the hook a copy of an event was sent
// to, part of the delivery's identity (hook, GUID). None is hook 0, the
// hook of messages from before hooks were told apart. More than
// maxHookIDLen digits, anything but digits, or a number past what SQLite
// stores is an error.
func parseHookID(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	bad := fmt.Errorf("X-GitHub-Hook-ID: want 1 to %d decimal digits", maxHookIDLen)
	if len(s) > maxHookIDLen || strings.IndexFunc(s, func(c rune) bool { return c < '0' || c > '9' }) >= 0 {
		return 0, bad
	}
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("X-GitHub-Hook-ID: %s is past the largest hook ID a delivery may have", s)
	}
	return id, nil
}

// validDeliveryID reports whether s may be an X-GitHub-Delivery: 1 to
// maxDeliveryLen bytes of printable ASCII without spaces.
func validDeliveryID(s string) bool {
	return s != "" && len(s) <= maxDeliveryLen && strings.IndexFunc(s, func(c rune) bool { return c <= ' ' || c > '~' }) < 0
}

// claimedIdentity is the delivery a request says it is, as far as its
// headers are well-formed: its GUID ("" when absent or malformed) and its
// hook (-1 when absent or malformed). It is a claim, unverified: a
// refused request's log line and record carry it, nothing trusts it.
func claimedIdentity(h http.Header) (guid string, hook int64) {
	if g := h.Get("X-GitHub-Delivery"); validDeliveryID(g) {
		guid = g
	}
	hook = -1
	if v := h.Get("X-GitHub-Hook-ID"); v != "" {
		if id, err := parseHookID(v); err == nil {
			hook = id
		}
	}
	return guid, hook
}

// eventName reports whether s may be an event (or action) name: at most
// maxEventLen bytes of a-z, 0-9 and _. Empty is one here; callers that
// need a name check that apart.
func eventName(s string) bool {
	return len(s) <= maxEventLen && strings.IndexFunc(s, func(c rune) bool { return (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '_' }) < 0
}

// checkHeaders validates the GitHub headers a message carries; the error
// names the header.
func checkHeaders(h http.Header) error {
	delivery, event := h.Get("X-GitHub-Delivery"), h.Get("X-GitHub-Event")
	if event == "" || delivery == "" {
		return errorf(CodeInvalid, "X-GitHub-Event and X-GitHub-Delivery are required")
	}
	if !validDeliveryID(delivery) {
		return errorf(CodeInvalid, "X-GitHub-Delivery: want 1 to %d bytes of printable ASCII without spaces", maxDeliveryLen)
	}
	// Not [a-z_] alone: GitHub's own event names have digits too
	// (projects_v2_item), and refusing them would lose real deliveries.
	if !eventName(event) {
		return errorf(CodeInvalid, "X-GitHub-Event: want 1 to %d bytes of a-z, 0-9 and _", maxEventLen)
	}
	if _, err := parseHookID(h.Get("X-GitHub-Hook-ID")); err != nil || len(h.Values("X-GitHub-Hook-ID")) > 1 {
		return errorf(CodeInvalid, "%v", cmp.Or(err, errors.New("X-GitHub-Hook-ID: one value only")))
	}
	for _, k := range []string{"X-GitHub-Hook-Installation-Target-ID", "X-GitHub-Hook-Installation-Target-Type"} {
		for _, v := range h.Values(k) {
			if len(v) > maxHeaderLen {
				return errorf(CodeInvalid, "%s: longer than %d bytes", k, maxHeaderLen)
			}
		}
	}
	return nil
}
