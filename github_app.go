package main

import (
	"context"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
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

// GitHubApp is the client of the App's own REST endpoints (go-github),
// authenticated with the App JWT. go-github honours GitHub's rate limits: once
// an answer said the limit is spent (X-RateLimit-Remaining: 0 until
// X-RateLimit-Reset) or asked to slow down (a secondary limit, Retry-After),
// it refuses further calls until then without sending them, and those
// refusals are errors the callers retry later.
type GitHubApp struct {
	appID  int64
	key    *rsa.PrivateKey
	client *github.Client
	log    *slog.Logger

	mu         sync.Mutex
	token      string
	tokenExp   time.Time
	pauseUntil time.Time // a 429's Retry-After: nothing is sent before it
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
	a := &GitHubApp{appID: cfg.AppID, key: key, log: log}
	a.client = github.NewClient(&http.Client{Timeout: 30 * time.Second, Transport: appTransport{app: a}})
	if a.client.BaseURL, err = url.Parse(strings.TrimRight(cfg.APIURL, "/") + "/"); err != nil {
		return nil, fmt.Errorf("github.api_url: %w", err)
	}
	a.client.UserAgent = "switchyard/" + version
	return a, nil
}

// appTransport signs every request with the App JWT.
type appTransport struct{ app *GitHubApp }

func (t appTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	t.app.mu.Lock()
	until := t.app.pauseUntil
	t.app.mu.Unlock()
	if time.Now().Before(until) {
		return nil, fmt.Errorf("%w: told to retry after %s, not sending", ErrGitHubRateLimited, until.UTC().Format(time.RFC3339))
	}
	tok, err := t.app.jwt()
	if err != nil {
		return nil, err
	}
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+tok)
	r.Header.Set("X-GitHub-Api-Version", "2022-11-28")
	return http.DefaultTransport.RoundTrip(r)
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
func (a *GitHubApp) apiError(err error) error {
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
		a.mu.Lock()
		a.pauseUntil = time.Now().Add(wait)
		a.mu.Unlock()
		return fmt.Errorf("%w: 429, retry after %s", ErrGitHubRateLimited, wait)
	case errors.As(err, &er) && er.Response != nil && er.Response.StatusCode == http.StatusUnauthorized:
		a.log.Error("GitHub API configuration error", "error", ErrGitHubUnauthorized, "url", er.Response.Request.URL.Path)
		return ErrGitHubUnauthorized
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

// ListDeliveries pages through the App's deliveries, newest first, back to
// since, and returns the attempts delivered at or after it.
func (a *GitHubApp) ListDeliveries(ctx context.Context, since time.Time) ([]hookDelivery, error) {
	var all []hookDelivery
	opts := &github.ListCursorOptions{PerPage: 100}
	for {
		page, resp, err := a.client.Apps.ListHookDeliveries(ctx, opts)
		if err != nil {
			return nil, a.apiError(err)
		}
		older := false
		for _, d := range page {
			hd := fromGitHub(d)
			if hd.DeliveredAt.Before(since) {
				older = true // older than the checkpoint: this page is the last one needed
				continue
			}
			all = append(all, hd)
		}
		if older || resp.Cursor == "" {
			return all, nil
		}
		opts.Cursor = resp.Cursor
	}
}

// Delivery fetches one attempt with its original headers and payload.
func (a *GitHubApp) Delivery(ctx context.Context, id int64) (*hookDeliveryDetail, error) {
	d, _, err := a.client.Apps.GetHookDelivery(ctx, id)
	if err != nil {
		return nil, a.apiError(err)
	}
	out := &hookDeliveryDetail{hookDelivery: fromGitHub(d)}
	if r := d.Request; r != nil {
		out.Request.Headers = r.Headers
		if r.RawPayload != nil {
			out.Request.Payload = *r.RawPayload
		}
	}
	return out, nil
}

// Redeliver asks GitHub to deliver an attempt again (POST
// /app/hook/deliveries/{id}/attempts): the webhook comes back through the
// endpoint like any other, with redelivery set.
func (a *GitHubApp) Redeliver(ctx context.Context, id int64) error {
	if _, _, err := a.client.Apps.RedeliverHookDelivery(ctx, id); err != nil {
		var accepted *github.AcceptedError // 202: queued by GitHub, which is what was asked
		if errors.As(err, &accepted) {
			return nil
		}
		return a.apiError(err)
	}
	return nil
}
