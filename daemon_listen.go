// The API's listener: the socket systemd passes (socket activation), or
// one serve binds itself.

package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
)

// listenFDName is the name switchyard.socket gives its socket
// (FileDescriptorName=).
const listenFDName = "listen"

// apiListener is the API's listener: the socket of LISTEN_FDS named
// "listen" (or the only one) that systemd passed, else one bound to
// server.listen. Closing a passed listener closes this process's copy of
// systemd's socket, which stays open: connections that arrive once the
// server stopped accepting wait in its queue for the next process.
func apiListener(cfg ServerConfig, log *slog.Logger) (net.Listener, error) {
	ln, err := passedListener(activation.Files(true))
	if err != nil {
		return nil, fmt.Errorf("the socket systemd passed (LISTEN_FDS): %w", err)
	}
	if ln == nil {
		ln, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("listen %s (server.listen): %w", cfg.Listen, err)
		}
		return ln, nil
	}
	log.Info("listening on the socket systemd passed", "address", ln.Addr().String())
	if !sameAddr(ln.Addr().String(), cfg.Listen) {
		log.Warn("the socket systemd passed is not server.listen; serving on the passed socket",
			"socket", ln.Addr().String(), "server.listen", cfg.Listen)
	}
	return ln, nil
}

// passedListener is the one TCP listener among files (systemd's sockets):
// the one named listenFDName, or the only one; nil without any. Every
// file is closed but the listener's own copy.
func passedListener(files []*os.File) (*net.TCPListener, error) {
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	if len(files) == 0 {
		return nil, nil
	}
	pick := -1
	var names []string
	for i, f := range files {
		names = append(names, f.Name())
		if f.Name() == listenFDName {
			if pick >= 0 {
				return nil, fmt.Errorf("two sockets are named %q", listenFDName)
			}
			pick = i
		}
	}
	if pick < 0 {
		if len(files) > 1 {
			return nil, fmt.Errorf("%d sockets (%s) and none named %q: set FileDescriptorName=%s on the one to serve",
				len(files), strings.Join(names, ", "), listenFDName, listenFDName)
		}
		pick = 0
	}
	ln, err := net.FileListener(files[pick])
	if err != nil {
		return nil, fmt.Errorf("socket %s is not a listening stream socket: %w", names[pick], err)
	}
	tcp, ok := ln.(*net.TCPListener)
	if !ok {
		ln.Close()
		return nil, fmt.Errorf("socket %s is not a TCP listener (%s %s)", names[pick], ln.Addr().Network(), ln.Addr())
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
