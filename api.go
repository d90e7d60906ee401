package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/julienschmidt/httprouter"
)

// API is switchyard's HTTP surface: the webhook, the broker admin API and the
// health endpoints.
type API struct {
	cfg     *Config
	tokens  atomic.Pointer[APIConfig] // a SIGHUP may change them
	store   *Store
	brokers *Brokers
	queues  *Queues
	webhook *Webhook
	metrics *Metrics
	workers []*Worker // for the status
	usage   *Usage
	hooks   *Hooks // nil without the GitHub App
	leases  *Leases
	// csrfKey signs the tokens of the operator's POST forms; a new one each
	// start, so a page from before a restart must be loaded again.
	csrfKey []byte
	started time.Time
	auth    *authGuard
	log     *slog.Logger
	// draining is set on SIGTERM with server.drain_delay: /readyz answers
	// 503 "draining" while every endpoint still serves.
	draining atomic.Bool
	// inspections are the status page's looks at brokers that outlive the
	// request that started them (a stalled broker answers after the page
	// gave up on it); Close waits for them.
	inspections sync.WaitGroup
	// certificates are the ones served with server.tls (ShowCertificates).
	certificates func() []CertificateView
}

// Close waits for the broker inspections still running for a status
// page; each ends within call_timeout. Call it once the HTTP server has
// stopped, before the queues close.
func (a *API) Close() { a.inspections.Wait() }

// NewAPI builds the HTTP surface over the daemon's parts.
func NewAPI(cfg *Config, store *Store, brokers *Brokers, queues *Queues, webhook *Webhook, metrics *Metrics, workers []*Worker,
	usage *Usage, hooks *Hooks, leases *Leases, log *slog.Logger) *API {
	a := &API{cfg: cfg, store: store, brokers: brokers, queues: queues, webhook: webhook, metrics: metrics,
		workers: workers, usage: usage, hooks: hooks, leases: leases, csrfKey: make([]byte, 32), started: time.Now().UTC(), auth: newAuthGuard(log), log: log}
	tokens := cfg.API
	a.tokens.Store(&tokens)
	_, _ = rand.Read(a.csrfKey) // crypto/rand never fails on Linux
	return a
}

// Drain makes /readyz answer 503 {"status":"draining"} from now on, so
// that a balancer sends webhooks elsewhere; everything else serves as
// before.
func (a *API) Drain() { a.draining.Store(true) }

// Reload takes the webhook's secrets, allow list and proxies and both API
// tokens from cfg (SIGHUP); a config the webhook refuses changes nothing.
func (a *API) Reload(cfg *Config) error {
	if err := a.webhook.Reload(cfg); err != nil {
		return err
	}
	tokens := cfg.API
	a.tokens.Store(&tokens)
	return nil
}

// bearer reads the Authorization header's token.
func bearer(r *http.Request) string {
	v, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return ""
	}
	return strings.TrimSpace(v)
}

func tokenIs(got, want string) bool {
	return want != "" && subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

// operator lets only the operator token in; the producer token gets 403.
func (a *API) operator(h httprouter.Handle) httprouter.Handle {
	return a.guarded(func(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
		tok, tokens := bearer(r), a.tokens.Load()
		switch {
		case tokenIs(tok, tokens.OperatorToken):
			a.bounded(h)(w, r, ps)
		case tokenIs(tok, tokens.ProducerToken):
			writeError(w, r, a.log, ErrForbidden)
		default:
			a.authFailed(r)
			writeError(w, r, a.log, ErrUnauthorized)
		}
	})
}

// producer lets the producer token and the operator token in.
func (a *API) producer(h httprouter.Handle) httprouter.Handle {
	return a.guarded(func(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
		tok, tokens := bearer(r), a.tokens.Load()
		if tokenIs(tok, tokens.ProducerToken) || tokenIs(tok, tokens.OperatorToken) {
			a.bounded(h)(w, r, ps)
			return
		}
		a.authFailed(r)
		writeError(w, r, a.log, ErrUnauthorized)
	})
}

// maxAdminBody caps the admin API's request bodies.
const maxAdminBody = 1 << 20

// bounded reads the request body, at most maxAdminBody bytes, before h
// runs, on every admin route, whether or not h reads it: a body over the
// limit is 413 and changes nothing.
func (a *API) bounded(h httprouter.Handle) httprouter.Handle {
	return func(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
		if r.ContentLength > maxAdminBody {
			writeError(w, r, a.log, errorf(CodeTooLarge, "body over %d bytes", maxAdminBody))
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxAdminBody))
		var mbe *http.MaxBytesError
		switch {
		case errors.As(err, &mbe):
			writeError(w, r, a.log, errorf(CodeTooLarge, "body over %d bytes", maxAdminBody))
			return
		case err != nil:
			writeError(w, r, a.log, &Error{Code: CodeInvalid, Message: "the body could not be read", Err: err})
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		h(w, r, ps)
	}
}

// readyCheckTimeout is each /readyz check's own deadline.
const readyCheckTimeout = 2 * time.Second

// ready answers 503 {"status":"draining"} once the node drains (Drain);
// else 200 {"status":"ready"} while a webhook can be taken: committed to
// the outbox (the database takes writes and this node's outbox is not
// full), or, when not, published to the broker directly (the active
// broker is reachable and takes publishes). The answer names what is not
// right ("database", "outbox", "broker") even while ready, and how the
// outbox stands; it is 503 only when neither path takes a webhook. Anyone
// may ask, so the answer says no more than the kind (brokerProblem); the
// log and the operator's status have the cause. Each check runs at once
// beside the other, with a deadline of its own: a locked database must
// not make the broker look unreachable too.
func (a *API) ready(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	if a.draining.Load() {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "draining"})
		return
	}
	checks := []struct {
		name  string
		check func(ctx context.Context) error
		// problem is the public text of a failed check.
		problem func(err error) string
	}{
		{"database", a.store.Writable, func(err error) string {
			if errors.Is(err, ErrSchemaFloor) {
				return "needs a newer switchyard: upgrade this node"
			}
			return "not writable"
		}},
		{"broker", a.brokerReady, brokerProblem},
	}
	errs := make([]error, len(checks))
	var wg sync.WaitGroup
	for i, c := range checks {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(r.Context(), readyCheckTimeout)
			defer cancel()
			if errs[i] = c.check(ctx); errs[i] != nil {
				a.log.Debug("not ready", "part", c.name, "error", errs[i])
			}
		})
	}
	wg.Wait()
	out := map[string]string{}
	for i, c := range checks {
		if errs[i] != nil {
			out[c.name] = c.problem(errs[i])
		}
	}
	ob := a.webhook.outbox
	if ob.Full() {
		out["outbox"] = "full"
	}
	answer := map[string]any{"status": "ready", "outbox": map[string]any{"waiting_bytes": ob.Waiting(), "full": ob.Full()}}
	if len(out) > 0 {
		answer["problems"] = out
	}
	// A node the database's floor left behind stops for good, whatever
	// the broker does: a balancer sends webhooks to an upgraded one.
	upgrade := errors.Is(errs[0], ErrSchemaFloor) // checks[0]: the database
	if storePath := out["database"] == "" && out["outbox"] == ""; upgrade || !storePath && out["broker"] != "" {
		answer["status"] = "not ready"
		writeJSON(w, http.StatusServiceUnavailable, answer)
		return
	}
	writeJSON(w, http.StatusOK, answer)
}

// brokerReady fails when the active broker cannot be reached, blocks or
// refuses publishes, or would route a webhook to no queue: webhooks sent
// to it would answer 503.
func (a *API) brokerReady(ctx context.Context) error {
	b, err := a.brokers.Get(a.brokers.Cached().Active)
	if err != nil {
		return err
	}
	if err := a.queues.Reachable(ctx, b); err != nil {
		return err
	}
	if st, blocked := a.queues.Blocked(b); blocked {
		return &BrokerRefusal{Kind: st.Kind, Reason: st.Reason}
	}
	return a.queues.Routes(ctx, b)
}

// guarded refuses a source that failed too often with 429 and Retry-After,
// whatever it sends, before h looks at its credentials.
func (a *API) guarded(h httprouter.Handle) httprouter.Handle {
	return func(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
		if wait := a.auth.blocked(a.webhook.sourceIP(r), time.Now()); wait > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(int(wait.Seconds())+1))
			writeError(w, r, a.log, ErrTooManyFailures)
			return
		}
		h(w, r, ps)
	}
}

// authFailed records a failed authentication of r.
func (a *API) authFailed(r *http.Request) {
	a.auth.failed(a.webhook.sourceIP(r), r.URL.Path, time.Now())
}

// CertificateView is a certificate the endpoint serves: the names it is
// for, its issuer, its life, and whether ACME renews it.
type CertificateView struct {
	Names     []string  `json:"names"`
	Issuer    string    `json:"issuer"`
	NotBefore time.Time `json:"not_before"`
	NotAfter  time.Time `json:"not_after"`
	ACME      bool      `json:"acme"`
}

// Overdue reports whether, at now, the certificate should have been
// renewed and was not: ACME renews when a third of its life is left (30
// days of Let's Encrypt's 90, 2 of a 6-day certificate), and half of that
// third gone without a new certificate is a problem: 15 days of 90, one
// of 6. A renewal in progress is not.
func (c CertificateView) Overdue(now time.Time) bool {
	life := c.NotAfter.Sub(c.NotBefore)
	if c.NotBefore.IsZero() || life <= 0 {
		life = 90 * 24 * time.Hour
	}
	return c.NotAfter.Sub(now) < life/6
}

// ShowCertificates has the status show what certs says.
func (a *API) ShowCertificates(certs func() []CertificateView) { a.certificates = certs }
