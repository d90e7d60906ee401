// The API's listeners: the sockets systemd passes (socket activation), or
// ones serve binds itself.

package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
)

// The names systemd's socket units give their sockets
// (FileDescriptorName=): switchyard.socket's serves the API in plain HTTP;
// with server.tls, switchyard-https.socket's serves it in HTTPS and
// switchyard-http.socket's the plain listener (server.tls.http_listen).
const (
	listenFDName = "listen"
	httpsFDName  = "https"
	httpFDName   = "http"
)

// Listeners are what serve listens on: the API's listener and, with
// server.tls, the plain HTTP one (ACME's HTTP-01 and a redirect), if any.
type Listeners struct{ API, HTTP net.Listener }

// Close closes both.
func (ls Listeners) Close() {
	for _, ln := range []net.Listener{ls.API, ls.HTTP} {
		if ln != nil {
			ln.Close()
		}
	}
}

// listen opens the listeners: the sockets systemd passed (LISTEN_FDS),
// by name, else ones bound to server.listen and server.tls.http_listen.
// Closing a passed listener closes this process's copy of systemd's
// socket, which stays open: connections that arrive once the server
// stopped accepting wait in its queue for the next process.
func listen(cfg ServerConfig, log *slog.Logger) (Listeners, error) {
	names := []string{listenFDName}
	if cfg.TLS.On() {
		names = []string{httpsFDName, httpFDName}
	}
	passed, err := passedListeners(activation.Files(true), names...)
	if err != nil {
		return Listeners{}, fmt.Errorf("the sockets systemd passed (LISTEN_FDS): %w", err)
	}
	var ls Listeners
	if ln := passed[names[0]]; ln != nil {
		ls.API = ln
		log.Info("listening on the socket systemd passed", "address", ln.Addr().String(), "name", names[0])
		if !sameAddr(ln.Addr().String(), cfg.Listen) {
			log.Warn("the socket systemd passed is not server.listen; serving on the passed socket",
				"socket", ln.Addr().String(), "server.listen", cfg.Listen)
		}
	} else if ls.API, err = net.Listen("tcp", cfg.Listen); err != nil {
		return Listeners{}, fmt.Errorf("listen %s (server.listen): %w", cfg.Listen, err)
	}
	if !cfg.TLS.On() {
		return ls, nil
	}
	if ln := passed[httpFDName]; ln != nil {
		ls.HTTP = ln
		log.Info("listening on the socket systemd passed", "address", ln.Addr().String(), "name", httpFDName)
	} else if cfg.TLS.HTTPListen != "" {
		if ls.HTTP, err = net.Listen("tcp", cfg.TLS.HTTPListen); err != nil {
			ls.Close()
			return Listeners{}, fmt.Errorf("listen %s (server.tls.http_listen): %w", cfg.TLS.HTTPListen, err)
		}
	}
	return ls, nil
}

// passedListeners are the TCP listeners among files (systemd's sockets) by
// the names given, the first name's also the only socket's whatever its
// name, and required when any is passed; none without any. Every file is closed but the listeners' own
// copies.
func passedListeners(files []*os.File, names ...string) (map[string]*net.TCPListener, error) {
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	out := map[string]*net.TCPListener{}
	fail := func(err error) (map[string]*net.TCPListener, error) {
		for _, ln := range out {
			ln.Close()
		}
		return nil, err
	}
	var all []string
	for _, f := range files {
		name := f.Name()
		all = append(all, name)
		if len(files) == 1 && !slices.Contains(names, name) {
			name = names[0]
		}
		if !slices.Contains(names, name) {
			continue // another unit's: not served here
		}
		if out[name] != nil {
			return fail(fmt.Errorf("two sockets are named %q", name))
		}
		ln, err := tcpListener(f)
		if err != nil {
			return fail(err)
		}
		out[name] = ln
	}
	if len(files) > 0 && out[names[0]] == nil {
		return fail(fmt.Errorf("%d sockets (%s) and none named %q: set FileDescriptorName=%s on the one to serve",
			len(files), strings.Join(all, ", "), names[0], names[0]))
	}
	return out, nil
}

// tcpListener is the listening TCP socket f.
func tcpListener(f *os.File) (*net.TCPListener, error) {
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("socket %s is not a listening stream socket: %w", f.Name(), err)
	}
	tcp, ok := ln.(*net.TCPListener)
	if !ok {
		ln.Close()
		return nil, fmt.Errorf("socket %s is not a TCP listener (%s %s)", f.Name(), ln.Addr().Network(), ln.Addr())
	}
	return tcp, nil
}

// sameAddr reports whether the listener's address a is server.listen's
// b, where b's host may be a name or empty.
func sameAddr(a, b string) bool {
	if a == b {
		return true
	}
	ah, ap, err1 := net.SplitHostPort(a)
	bh, bp, err2 := net.SplitHostPort(b)
	if err1 != nil || err2 != nil || ap != bp {
		return false
	}
	if bh == "" || bh == "0.0.0.0" || bh == "::" {
		ip := net.ParseIP(ah)
		return ip != nil && ip.IsUnspecified()
	}
	if bh == "localhost" {
		ip := net.ParseIP(ah)
		return ip != nil && ip.IsLoopback()
	}
	return ah == bh
}

// gatedListener is the API's listener with a gate, so that a shutdown
// answers every connection it took: Pause stops taking connections
// (those that arrive wait in the socket's queue, for the next process
// under socket activation) without closing the socket, and, keep-alives
// off, WaitClosed waits until each connection taken was answered and
// closed. net/http's Shutdown alone closes, unanswered, a connection whose
// request it reads after the shutdown began: a webhook that had just been
// accepted.
type gatedListener struct {
	*net.TCPListener
	pauseOnce sync.Once
	paused    chan struct{}
	closeOnce sync.Once
	closed    chan struct{}
	// accepting is held through each Accept of the socket, so that Pause
	// returns once every connection taken is in fresh.
	accepting sync.Mutex
	mu        sync.Mutex
	open      map[net.Conn]struct{} // taken, not closed yet
}

func newGatedListener(ln *net.TCPListener) *gatedListener {
	return &gatedListener{TCPListener: ln, paused: make(chan struct{}), closed: make(chan struct{}), open: map[net.Conn]struct{}{}}
}

// Accept takes the next connection until Pause, then waits for Close.
func (l *gatedListener) Accept() (net.Conn, error) {
	select {
	case <-l.paused:
		<-l.closed
		return nil, net.ErrClosed
	case <-l.closed:
		return nil, net.ErrClosed
	default:
	}
	l.accepting.Lock()
	c, err := l.TCPListener.Accept()
	if err == nil {
		l.mu.Lock()
		l.open[c] = struct{}{}
		l.mu.Unlock()
	}
	l.accepting.Unlock()
	if err != nil {
		select {
		case <-l.paused: // the deadline Pause set
			<-l.closed
			return nil, net.ErrClosed
		case <-l.closed:
			return nil, net.ErrClosed
		default:
		}
	}
	return c, err
}

// Pause stops taking connections, at once (a deadline in the past ends
// the Accept under way), and returns once the last one taken is counted.
func (l *gatedListener) Pause() {
	l.pauseOnce.Do(func() {
		close(l.paused)
		l.SetDeadline(time.Unix(1, 0)) //nolint:errcheck // a TCP listener takes a deadline
	})
	l.accepting.Lock()
	defer l.accepting.Unlock()
}

// ConnState is the server's hook: a connection taken is open until it
// closes.
func (l *gatedListener) ConnState(c net.Conn, st http.ConnState) {
	if st != http.StateClosed && st != http.StateHijacked {
		return
	}
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn() // HTTPS: the connection the gate took
	}
	l.mu.Lock()
	delete(l.open, c)
	l.mu.Unlock()
}

// WaitClosed waits until every connection taken has closed (with
// keep-alives off, once answered), or ctx ends.
func (l *gatedListener) WaitClosed(ctx context.Context) {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		l.mu.Lock()
		n := len(l.open)
		l.mu.Unlock()
		if n == 0 {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Close closes this process's copy of the socket.
func (l *gatedListener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		close(l.closed)
		err = l.TCPListener.Close()
	})
	return err
}
