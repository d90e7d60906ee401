package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Fuzz targets for everything that reads outside input: the webhook request,
// the producer's pending-switch body, broker URLs and consumed messages. The
// seed corpus is in testdata/fuzz; `go test` runs it, `go test -fuzz=Name`
// explores. None may panic, and every rejection must be a clear 4xx or a
// permanent failure (an -error message), never a 5xx or a retry.

func FuzzWebhookRequest(f *testing.F) {
	for _, name := range []string{"opened", "closed"} {
		f.Add(loadFixture(f, "pull_request", name), "application/json", "pull_request", "guid-1", true)
	}
	f.Add([]byte("payload=%7B%7D"), "application/x-www-form-urlencoded", "ping", "guid-2", true)
	f.Add([]byte(`{"a":1}`), "application/json", "", "guid-3", true)
	f.Add([]byte(`not json`), "text/plain", "push", "guid-4", false)
	cfg := DefaultConfig()
	cfg.GitHub.WebhookSecret = testSecret
	wh, err := NewWebhook(cfg, nil, nil, nil, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body []byte, contentType, event, delivery string, signed bool) {
		r := httptest.NewRequest(http.MethodPost, "/webhooks/github", bytes.NewReader(body))
		r.Header.Set("Content-Type", contentType)
		r.Header.Set("X-GitHub-Event", event)
		r.Header.Set("X-GitHub-Delivery", delivery)
		if signed {
			r.Header.Set("X-Hub-Signature-256", sign(testSecret, body))
		}
		payload, release, err := wh.readPayload(httptest.NewRecorder(), r, new([]byte))
		release()
		if err != nil {
			if s := statusOf(err); s < 400 || s > 499 {
				t.Fatalf("rejection %v maps to %d, want a 4xx", err, s)
			}
			return
		}
		if !signed || event == "" || delivery == "" {
			t.Fatalf("accepted a request without signature, event or delivery")
		}
		if _, _, err := decodePayload(payload, event); err != nil {
			t.Fatalf("accepted a payload the workers refuse: %v", err)
		}
	})
}

func FuzzPendingSwitchBody(f *testing.F) {
	f.Add(`{"host": "b.example", "vhost": "y", "switchedAt": "2026-11-29T10:00:00Z"}`)
	f.Add(`{"host": "b.example", "vhost": "", "switchedAt": "2026-11-29T10:00:00.123+02:00"}`)
	f.Add(`{"host": "b.example"}`)
	f.Add(`{"host": 1, "vhost": [], "switchedAt": null}`)
	f.Add(`{} {}`)
	f.Fuzz(func(t *testing.T, body string) {
		host, _, at, err := decodeNotification(strings.NewReader(body))
		if err != nil {
			if s := statusOf(err); s != http.StatusBadRequest && s != http.StatusRequestEntityTooLarge {
				t.Fatalf("rejection %v maps to %d, want 400 or 413", err, s)
			}
			return
		}
		if host == "" || at.IsZero() {
			t.Fatalf("accepted %q without host or time", body)
		}
	})
}

func FuzzBrokerURL(f *testing.F) {
	f.Add("amqps://user:secret@a.example.com/vhost")
	f.Add("amqp://user:secret@b.example.com:5673/%2Fweird%20vhost")
	f.Add("amqp://127.0.0.1")
	f.Add("amqps://user:p%40ss@host/?heartbeat=10")
	f.Add("http://example.com/")
	f.Fuzz(func(t *testing.T, raw string) {
		b, err := ParseBroker(0, raw)
		if err != nil {
			if strings.Contains(err.Error(), "secret") {
				t.Fatalf("error %q quotes the URL", err)
			}
			return
		}
		if b.Host == "" || b.Vhost == "" || b.Port <= 0 {
			t.Fatalf("parsed %q into %+v", raw, b)
		}
		u, _ := amqp.ParseURI(raw)
		if u.Password != "" && strings.Contains(redactAMQPURL(raw), ":"+u.Password+"@") {
			t.Fatalf("redacted URL shows the password: %s", redactAMQPURL(raw))
		}
		bs := &Brokers{list: []*Broker{b}}
		if m, err := bs.Match(strings.ToUpper(b.Host), b.Vhost); err != nil || m != b {
			t.Fatalf("broker %+v does not match its own endpoint: %v", b, err)
		}
	})
}

func FuzzDecodeEvent(f *testing.F) {
	for _, fx := range [][2]string{{"pull_request", "opened"}, {"issues", "opened"},
		{"workflow_run", "completed"}, {"release", "published"},
		{"installation_repositories", "added"}, {"push", "branch"}} {
		f.Add(loadFixture(f, fx[0], fx[1]), fx[0], "guid", "integration", "4242")
	}
	f.Add([]byte(`{"headers": {"X-GitHub-Event": "issues", "X-GitHub-Delivery": "g"}, "payload": {"action": "opened"}}`), "", "", "", "")
	f.Add([]byte(`{"headers": 5, "payload": "{\"a\":1}"}`), "", "m", "", "")
	f.Fuzz(func(t *testing.T, body []byte, event, guid, targetType, targetID string) {
		d := &amqp.Delivery{Body: body, MessageId: guid, Type: event,
			Headers: amqp.Table{hdrTargetType: targetType, hdrTargetID: targetID}}
		ev, err := DecodeEvent(deliveryOf(d))
		var perm *MalformedError
		if err != nil {
			if !errors.As(err, &perm) {
				t.Fatalf("decode error %v is not permanent", err)
			}
			return
		}
		if ev.DeliveryID == "" || ev.Name == "" {
			t.Fatalf("decoded an Event without GUID or name: %+v", ev)
		}
		if _, err := decodeTableRows(ev, decodedPayload{}, 4242); err != nil && !errors.As(err, &perm) {
			t.Fatalf("table decode error %v is not permanent", err)
		}
	})
}

// validJSON, the webhook endpoint's check, must agree with json.Valid on
// every input.
func FuzzValidJSON(f *testing.F) {
	for _, s := range []string{`{}`, `[]`, `{"a":[1,2,{"b":null}],"c":"\u00e9\n"}`, `-0.5e+3`, `01`, `1.`, `"\x"`,
		`{"a":1,}`, `[1 2]`, "\"\x01\"", `{"a" 1}`, `tru`, ` {"k": "v"} `, `"\ud800"`, "\"\xff\"", `{"a":1}{}`} {
		f.Add([]byte(s))
	}
	// Strings are read eight bytes at a time: put each byte that matters
	// inside a string at every offset of a word, and of the next.
	for off := 0; off < 17; off++ {
		for _, c := range []string{`"`, `\n`, `\u00e9`, `\q`, "\x00", "\x1f", " ", "\x7f", "\xc3\xa9", "\xff", `\\`, `\"`, `\\\"`, `\\\\`} {
			f.Add([]byte(`{"k":"` + strings.Repeat("a", off) + c + strings.Repeat("b", 9) + `"}`))
		}
	}
	f.Add(loadFixture(f, "push", "branch"))
	f.Add([]byte(`{"a":{"b":[1,{"c":"}]"}],"d":"x\\"},"e":[],"f":-1.5e3,"g":true ,"h" : null}`))
	// Keys nested, escaped, repeated, and holding other types.
	f.Add([]byte(`{"a":{"b":1,"c":{"k":[2],"x":3},"y":"z"},"d":{"q":1},"log\u0069n":"e","a":{"c":null},"e":{"f":1}}`))
	f.Add([]byte("{\"k\xff\":1,\"k\":\"v\",\"a\":[{\"b\":1}],\"e\":\"s\"}"))
	// encoding/json's nesting limit is 10,000.
	for _, depth := range []int{9999, 10000, 10001} {
		f.Add([]byte(strings.Repeat(`[`, depth) + strings.Repeat(`]`, depth)))
		f.Add([]byte(strings.Repeat(`{"a":`, depth) + `1` + strings.Repeat(`}`, depth)))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := validJSON(b), json.Valid(b); got != want {
			t.Fatalf("validJSON(%q) = %v, json.Valid = %v", b, got, want)
		}
	})
}

// decodeJSON must answer as json.Unmarshal does for every type it decodes
// into: each typed table's payload, the eventPayload of the other Events,
// and strings and numbers. It must refuse what json.Unmarshal refuses, as
// JSON that is not valid, and for valid JSON fill what json.Unmarshal
// fills, the values of a shape error included: DecodeEvent keeps them. The
// seeds are every fixture and values of the wrong type, out of range,
// escaped or repeated.
func FuzzDecodeJSON(f *testing.F) {
	for _, fx := range loadFixtures(f) {
		f.Add(fx.Body)
	}
	for _, s := range []string{`"a\u00e9\ud800b"`, "\"\xff\"", `1e400`, `-9223372036854775809`, `9223372036854775807`,
		`1.5`, `null`, `true`, `[1]`, `{"action":1}`, `{"action":"a","action":"b"}`, `{"ACTION":"x"}`,
		`{"pull_request":{"number":"2","head":null},"repository":{"owner":[]}}`,
		`{"pull_request":{"number":2.0,"draft":1,"updated_at":null}}`, `{"release":{"id":-0,"name":"\/\n"}}`,
		`{"commits":[{"id":"x"},null,{"message":5}]}`, `{"repositories_added":{"a":1}}`,
		`{"headers":null,"payload":"{}"}`, `{"installation":{"id":"1"},"sender":{"login":"a"},"action":"opened"}`,
		`{"repository":{"full_name":7},"sender":"x","action":"closed"}`} {
		f.Add([]byte(s))
	}
	for _, depth := range []int{9998, 9999, 10000, 10001} {
		f.Add([]byte(`{"pull_request":` + strings.Repeat(`[`, depth) + strings.Repeat(`]`, depth) + `}`))
		f.Add([]byte(`{"x":` + strings.Repeat(`{"a":`, depth) + `1` + strings.Repeat(`}`, depth) + `}`))
	}
	targets := []func() any{func() any { return new(string) }, func() any { return new(int64) }}
	targets = append(targets, func() any { return newTablePayload("ping") })
	for _, d := range tableDecoders {
		targets = append(targets, func() any { return d.payload() })
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		valid := json.Valid(b)
		for _, target := range targets {
			want, got := target(), target()
			wantErr, gotErr := json.Unmarshal(b, want), decodeJSON(b, got)
			if (wantErr == nil) != (gotErr == nil) {
				t.Fatalf("%q into %T: decodeJSON %v, json.Unmarshal %v", b, got, gotErr, wantErr)
			}
			if gotErr != nil && isShapeError(gotErr) != valid {
				t.Fatalf("%q (valid: %v) into %T: decodeJSON %v, a shape error: %v", b, valid, got, gotErr, isShapeError(gotErr))
			}
			if valid && !reflect.DeepEqual(got, want) {
				t.Fatalf("%q into %T: decodeJSON %+v, json.Unmarshal %+v", b, got, got, want)
			}
		}
	})
}
