package main

import (
	"log/slog"
	"net/netip"
	"sync"
	"time"
)

// Failed authentications on the operator's surfaces (the admin API, the
// status page and its JSON) are logged and throttled per source address:
// a token guessed at line speed must cost the guesser, and the operator must
// see it happen.
const (
	authFailLimit  = 20          // failures a source may make in authFailWindow
	authFailWindow = time.Minute // and how long it is refused after that
	// authTracked bounds the addresses tracked at once, so that a flood
	// from many addresses costs bounded memory; past it, new addresses
	// are not tracked until old ones expire.
	authTracked = 10000
)

// authGuard counts failed authentications per source address.
type authGuard struct {
	log  *slog.Logger
	logs *logLimiter

	mu    sync.Mutex
	fails map[netip.Addr]*authFailures
}

// authFailures are one address's failures in its current window.
type authFailures struct {
	since        time.Time // the window's first failure
	n            int
	blockedUntil time.Time
}

func newAuthGuard(log *slog.Logger) *authGuard {
	return &authGuard{log: log, logs: newLogLimiter(10 * time.Second), fails: map[netip.Addr]*authFailures{}}
}

// blocked reports how long addr is still refused, 0 when it is not.
func (g *authGuard) blocked(addr netip.Addr, now time.Time) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	if f := g.fails[addr]; f != nil && now.Before(f.blockedUntil) {
		return f.blockedUntil.Sub(now)
	}
	return 0
}

// failed records a failed authentication from addr on path and logs it, at
// most one line per kind per 10 s.
func (g *authGuard) failed(addr netip.Addr, path string, now time.Time) {
	g.mu.Lock()
	f := g.fails[addr]
	if f == nil {
		if len(g.fails) >= authTracked {
			g.sweep(now)
		}
		if len(g.fails) < authTracked {
			f = &authFailures{since: now}
			g.fails[addr] = f
		}
	}
	blockedNow := false
	if f != nil {
		if now.Sub(f.since) > authFailWindow {
			f.since, f.n = now, 0
		}
		f.n++
		if f.n >= authFailLimit && !now.Before(f.blockedUntil) {
			f.blockedUntil, blockedNow = now.Add(authFailWindow), true
		}
	}
	g.mu.Unlock()

	kind := "failed"
	if blockedNow {
		kind = "blocked"
	}
	if ok, suppressed := g.logs.allow(kind, now); ok {
		args := []any{"source_ip", addrText(addr), "path", path}
		if suppressed > 0 {
			args = append(args, "suppressed", suppressed)
		}
		if blockedNow {
			g.log.Warn("authentication failures: source refused for a minute", append(args, "failures", authFailLimit)...)
		} else {
			g.log.Warn("authentication failed", args...)
		}
	}
}

// sweep forgets the addresses whose window and block have both passed.
func (g *authGuard) sweep(now time.Time) {
	for a, f := range g.fails {
		if now.Sub(f.since) > authFailWindow && !now.Before(f.blockedUntil) {
			delete(g.fails, a)
		}
	}
}
