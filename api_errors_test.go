package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// Every kind of bad request, to the webhook and to the admin API, gets
// its status and, as its body, the one message set where the error was
// made: never a chain of wrapped errors, nor an internal cause.
func TestEveryBadRequestBody(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, amqpURL(newVhost(t)))
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	webhook := func(mutate func(r *http.Request)) *http.Request {
		r := webhookRequest(t, d.URL, "issues", newGUID(), body)
		mutate(r)
		return r
	}
	admin := func(method, path, body, token string) *http.Request {
		return httpRequest(t, method, d.URL+path, body, token)
	}
	const op = "operator-token-for-tests"
	cases := []struct {
		name   string
		req    *http.Request
		status int
		body   string
	}{
		{"no signature", webhook(func(r *http.Request) { r.Header.Del("X-Hub-Signature-256") }), 401,
			"missing X-Hub-Signature-256: set the hook's secret in GitHub to github.webhook_secret"},
		{"wrong signature", webhook(func(r *http.Request) { r.Header.Set("X-Hub-Signature-256", sign("another-secret-entirely", body)) }), 401,
			"invalid X-Hub-Signature-256: the hook's secret in GitHub is not github.webhook_secret"},
		{"no event", webhook(func(r *http.Request) { r.Header.Del("X-GitHub-Event") }), 400,
			"X-GitHub-Event and X-GitHub-Delivery are required"},
		{"bad delivery", webhook(func(r *http.Request) { r.Header.Set("X-GitHub-Delivery", "has spaces") }), 400,
			"X-GitHub-Delivery: want 1 to 255 bytes of printable ASCII without spaces"},
		{"bad event", webhook(func(r *http.Request) { r.Header.Set("X-GitHub-Event", "Issues!") }), 400,
			"X-GitHub-Event: want 1 to 64 bytes of a-z, 0-9 and _"},
		{"long target", webhook(func(r *http.Request) {
			r.Header.Set("X-GitHub-Hook-Installation-Target-Type", strings.Repeat("x", 300))
		}), 400, "X-GitHub-Hook-Installation-Target-Type: longer than 255 bytes"},
		{"not JSON", func() *http.Request {
			r := webhookRequest(t, d.URL, "issues", newGUID(), []byte("[1]"))
			return r
		}(), 400, "payload is not a JSON object"},
		{"form without payload", func() *http.Request {
			r := webhookRequest(t, d.URL, "issues", newGUID(), []byte("x=1"))
			r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			return r
		}(), 400, "form body without payload="},
		{"no token", admin("GET", "/api/v1/broker", "", ""), 401, "missing or invalid bearer token"},
		{"producer token elsewhere", admin("POST", "/api/v1/broker/switch/0", "", "producer-token-for-tests"), 403,
			"this token may not use this endpoint"},
		{"index not a number", admin("POST", "/api/v1/broker/switch/x", "", op), 400, `broker index "x" is not an integer`},
		{"index out of range", admin("POST", "/api/v1/broker/switch/7", "", op), 404, "no configured broker matches: index 7 of 1"},
		{"malformed JSON", admin("POST", "/api/v1/broker/pending-switch", "{", op), 400, "malformed JSON: unexpected EOF"},
		{"missing fields", admin("POST", "/api/v1/broker/pending-switch", "{}", op), 400, "host, vhost and switchedAt are required"},
		{"bad time", admin("POST", "/api/v1/broker/pending-switch", `{"host":"h","vhost":"v","switchedAt":"soon"}`, op), 400,
			`switchedAt is not an RFC 3339 time: "soon"`},
		{"admin body too large", admin("POST", "/api/v1/broker/pending-switch", strings.Repeat("x", 2<<20), op), 413,
			"body over 1048576 bytes"},
		{"unknown path", admin("GET", "/api/v1/nothing", "", op), 404, "not found"},
		{"bad search", admin("GET", "/api/v1/deliveries?hook=abc", "", op), 400,
			"hook: want the X-GitHub-Hook-ID of a copy, up to 20 digits"},
		{"unknown delivery", admin("GET", "/api/v1/deliveries/no-such-guid", "", op), 404,
			"no delivery with this GUID is known: no-such-guid"},
	}
	for _, c := range cases {
		code, raw := do(t, c.req)
		var answer map[string]string
		if err := json.Unmarshal([]byte(raw), &answer); err != nil {
			t.Errorf("%s: %d %q: not a JSON error body: %v", c.name, code, raw, err)
			continue
		}
		if code != c.status || answer["error"] != c.body {
			t.Errorf("%s: %d %q, want %d %q", c.name, code, answer["error"], c.status, c.body)
		}
	}
}
