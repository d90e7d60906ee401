package main

import (
	"context"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/google/go-github/v75/github"
)

// githubAPI is a client of GitHub's REST API (go-github) for one
// credential, the App's JWT or a hook's token: every request carries what
// auth gives, every answer is bounded before it is decoded, and GitHub's
// rate limits are honoured for that credential. go-github does the
// limits: once an answer said the limit is spent (X-RateLimit-Remaining: 0
// until X-RateLimit-Reset) or asked to slow down (a secondary limit,
// Retry-After), it refuses further calls until then without sending them;
// a 429's Retry-After is kept here. Those refusals are errors the callers
// retry later.
type githubAPI struct {
	client *github.Client
	log    *slog.Logger
	auth   func(ctx context.Context) (string, error)
	// refused is what a 401 means for this credential.
	refused error

	mu         sync.Mutex
	pauseUntil time.Time // a 429's Retry-After: nothing is sent before it
}

// newGitHubAPI is a client of the API at apiURL (github.api_url) whose
// requests carry auth's credential.
func newGitHubAPI(apiURL string, auth func(ctx context.Context) (string, error), refused error, log *slog.Logger) (*githubAPI, error) {
	c := &githubAPI{auth: auth, refused: refused, log: log}
	c.client = github.NewClient(&http.Client{Timeout: 30 * time.Second, Transport: apiTransport{c}})
	var err error
	if c.client.BaseURL, err = url.Parse(strings.TrimRight(apiURL, "/") + "/"); err != nil {
		return nil, fmt.Errorf("github.api_url: %w", err)
	}
	c.client.UserAgent = "switchyard/" + version
	return c, nil
}

// GitHubApp is the App (github.app_id): its JWT, the client of its own
// REST endpoints, and its installations' tokens, which the ledgers of
// hooks without a token of their own use.
type GitHubApp struct {
	appID int64
	key   *rsa.PrivateKey
	api   *githubAPI
	log   *slog.Logger

	// redeliveries paces the redeliveries asked with the App's
	// credentials (its hook's and its installations'), every caller
	// together.
	redeliveries *rateWindow

	mu            sync.Mutex
	token         string
	tokenExp      time.Time
	installations map[string]installationToken // by repos/OWNER/NAME or orgs/ORG
}

// installationToken is an installation's access token and when it ends.
type installationToken struct {
	token   string
	expires time.Time
}

// NewGitHubApp reads the App's PEM key and points a go-github client at
// api_url.
func NewGitHubApp(cfg GitHubConfig, log *slog.Logger) (*GitHubApp, error) {
	pem, err := os.ReadFile(cfg.PrivateKeyFile)
	if err != nil {
		return nil, fmt.Errorf("github.private_key_file: %w", err)
	}
	key, err := jwt.ParseRSAPrivateKeyFromPEM(pem)
	if err != nil {
		return nil, fmt.Errorf("github.private_key_file: not an RSA private key in PEM: %w", err)
	}
	a := &GitHubApp{appID: cfg.AppID, key: key, log: log, redeliveries: newRateWindow(cfg.RedeliverPerMinute, time.Minute),
		installations: map[string]installationToken{}}
	a.api, err = newGitHubAPI(cfg.APIURL, func(context.Context) (string, error) { return a.jwt() }, ErrGitHubUnauthorized, log)
	if err != nil {
		return nil, err
	}
	return a, nil
}

// apiTransport signs every request with its client's credential and
// bounds every answer.
type apiTransport struct{ c *githubAPI }

func (t apiTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	t.c.mu.Lock()
	until := t.c.pauseUntil
	t.c.mu.Unlock()
	if time.Now().Before(until) {
		return nil, fmt.Errorf("%w: told to retry after %s, not sending", ErrGitHubRateLimited, until.UTC().Format(time.RFC3339))
	}
	tok, err := t.c.auth(r.Context())
	if err != nil {
		return nil, err
	}
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+tok)
	r.Header.Set("X-GitHub-Api-Version", "2022-11-28")
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	// Every answer is bounded before it is decoded: a body that says it is
	// larger is refused unread, one that turns out larger fails its decode.
	limit := int64(maxAPIResponse)
	if strings.HasSuffix(r.URL.Path, "/deliveries") { // a page of a hook's deliveries
		limit = maxDeliveriesPage
	}
	if resp.ContentLength > limit {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %s says %d bytes, over %d", ErrAPIResponseTooLarge, r.URL.Path, resp.ContentLength, limit)
	}
	resp.Body = &boundedBody{ReadCloser: resp.Body, left: limit}
	return resp, nil
}

// maxAPIResponse bounds any answer of GitHub's API: a delivery with its
// request holds a payload of up to GitHub's 25 MB webhook limit, but one
// over 16 MiB is more than switchyard takes. maxDeliveriesPage bounds a
// page of the deliveries list: 100 deliveries weigh some 70 KB, and the JSON
// decoder holds the whole page before it decodes.
const (
	maxAPIResponse    = 16 << 20
	maxDeliveriesPage = 1 << 20
)

// ErrAPIResponseTooLarge is an answer of GitHub's API over its bound.
var ErrAPIResponseTooLarge = errors.New("GitHub API answer too large")

// boundedBody fails a read past left bytes.
type boundedBody struct {
	io.ReadCloser
	left int64
}

func (b *boundedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, ErrAPIResponseTooLarge
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}

// jwt returns the App JWT: RS256, issued 60 s in the past against clock
// drift, expiring in 9 minutes (GitHub refuses more than 10). It is reused
// until a minute before it expires.
func (a *GitHubApp) jwt() (string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	if a.token != "" && now.Before(a.tokenExp.Add(-time.Minute)) {
		return a.token, nil
	}
	exp := now.Add(9 * time.Minute)
	tok, err := jwt.NewWithClaims(jwt.SigningMethodRS256, jwt.RegisteredClaims{
		IssuedAt:  jwt.NewNumericDate(now.Add(-60 * time.Second)),
		ExpiresAt: jwt.NewNumericDate(exp),
		Issuer:    strconv.FormatInt(a.appID, 10),
	}).SignedString(a.key)
	if err != nil {
		return "", fmt.Errorf("sign app jwt: %w", err)
	}
	a.token, a.tokenExp = tok, exp
	return tok, nil
}

// installationToken is an access token of the App's installation on owner
// (a repository, "OWNER/NAME", or an organization): found and made with
// the App's JWT, kept until 5 minutes before it ends (GitHub's last an
// hour).
func (a *GitHubApp) installationToken(ctx context.Context, repo, org string) (string, error) {
	target := "orgs/" + org
	if repo != "" {
		target = "repos/" + repo
	}
	a.mu.Lock()
	t, ok := a.installations[target]
	a.mu.Unlock()
	if ok && time.Now().Before(t.expires.Add(-5*time.Minute)) {
		return t.token, nil
	}
	var inst *github.Installation
	var err error
	if repo != "" {
		owner, name, _ := strings.Cut(repo, "/")
		inst, _, err = a.api.client.Apps.FindRepositoryInstallation(ctx, owner, name)
	} else {
		inst, _, err = a.api.client.Apps.FindOrganizationInstallation(ctx, org)
	}
	if err != nil {
		return "", fmt.Errorf("the App's installation on %s: %w", target, a.api.apiError(err))
	}
	tok, _, err := a.api.client.Apps.CreateInstallationToken(ctx, inst.GetID(), nil)
	if err != nil {
		return "", fmt.Errorf("a token of the App's installation on %s: %w", target, a.api.apiError(err))
	}
	if tok.GetToken() == "" {
		return "", fmt.Errorf("a token of the App's installation on %s: GitHub gave none", target)
	}
	a.mu.Lock()
	a.installations[target] = installationToken{token: tok.GetToken(), expires: tok.GetExpiresAt().Time}
	a.mu.Unlock()
	return tok.GetToken(), nil
}

// githubStatusError is an unsuccessful answer of GitHub's API.
type githubStatusError struct {
	Status int
	Msg    string
}

func (e *githubStatusError) Error() string {
	return fmt.Sprintf("GitHub API answered %d: %s", e.Status, e.Msg)
}

// ErrGitHubUnauthorized is a 401: the App id or key is wrong.
var ErrGitHubUnauthorized = errors.New("GitHub rejected the App JWT (401): check github.app_id and github.private_key_file")

// ErrGitHubRateLimited is GitHub's rate limit, primary or secondary: nothing
// is sent to GitHub until the time the error names.
var ErrGitHubRateLimited = errors.New("GitHub API rate limit")

// apiError says what a go-github error means here: a 401 is
// ErrGitHubUnauthorized, logged as the configuration error it is; a rate
// limit is ErrGitHubRateLimited with the time it ends; any other answer a
// githubStatusError (a 404 the caller may take as permanent); all of them,
// but a 404, are transient for the callers.
func (c *githubAPI) apiError(err error) error {
	var rl *github.RateLimitError
	var abuse *github.AbuseRateLimitError
	var er *github.ErrorResponse
	switch {
	case errors.As(err, &rl):
		return fmt.Errorf("%w: spent until %s", ErrGitHubRateLimited, rl.Rate.Reset.Time.UTC().Format(time.RFC3339))
	case errors.As(err, &abuse):
		wait := "a while"
		if abuse.RetryAfter != nil {
			wait = abuse.RetryAfter.String()
		}
		return fmt.Errorf("%w: secondary limit, retry after %s", ErrGitHubRateLimited, wait)
	case errors.As(err, &er) && er.Response != nil && er.Response.StatusCode == http.StatusTooManyRequests:
		// go-github leaves 429 to its callers: honour its Retry-After here.
		wait := time.Minute
		if secs, err := strconv.Atoi(er.Response.Header.Get("Retry-After")); err == nil && secs >= 0 {
			wait = time.Duration(secs) * time.Second
		}
		c.mu.Lock()
		c.pauseUntil = time.Now().Add(wait)
		c.mu.Unlock()
		return fmt.Errorf("%w: 429, retry after %s", ErrGitHubRateLimited, wait)
	case errors.As(err, &er) && er.Response != nil && er.Response.StatusCode == http.StatusUnauthorized:
		c.log.Error("GitHub API configuration error", "error", c.refused, "url", er.Response.Request.URL.Path)
		return c.refused
	case errors.As(err, &er) && er.Response != nil:
		return &githubStatusError{Status: er.Response.StatusCode, Msg: er.Message}
	}
	return fmt.Errorf("GitHub API: %w", err)
}

// hookDelivery is one attempt in GET /app/hook/deliveries.
type hookDelivery struct {
	ID          int64     `json:"id"`
	GUID        string    `json:"guid"`
	DeliveredAt time.Time `json:"delivered_at"`
	Redelivery  bool      `json:"redelivery"`
	Status      string    `json:"status"`
	StatusCode  int       `json:"status_code"`
	Event       string    `json:"event"`
	Action      *string   `json:"action"`
}

// hookDeliveryDetail is GET /app/hook/deliveries/{id}: the attempt with the
// original request.
type hookDeliveryDetail struct {
	hookDelivery
	Request struct {
		Headers map[string]string
		Payload json.RawMessage
	}
}

// fromGitHub reads go-github's delivery into switchyard's.
func fromGitHub(d *github.HookDelivery) hookDelivery {
	return hookDelivery{ID: d.GetID(), GUID: d.GetGUID(), DeliveredAt: d.GetDeliveredAt().Time, Redelivery: d.GetRedelivery(),
		Status: d.GetStatus(), StatusCode: d.GetStatusCode(), Event: d.GetEvent(), Action: d.Action}
}

// rateWindow lets at most n events through in any span of per.
type rateWindow struct {
	n   int
	per time.Duration

	mu    sync.Mutex
	times []time.Time // the events of the last span, oldest first
}

func newRateWindow(n int, per time.Duration) *rateWindow {
	return &rateWindow{n: max(n, 1), per: per}
}

// take reports whether one more event may happen at now, and counts it if so.
func (w *rateWindow) take(now time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for len(w.times) > 0 && now.Sub(w.times[0]) >= w.per {
		w.times = w.times[1:]
	}
	if len(w.times) >= w.n {
		return false
	}
	w.times = append(w.times, now)
	return true
}
