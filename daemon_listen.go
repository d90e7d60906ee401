// The API's listener: the socket systemd passes (socket activation), or
// one serve binds itself.

package main

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"

	"github.com/coreos/go-systemd/v22/activation"
)

// listenFDName is the name switchyard.socket gives its socket
// (FileDescriptorName=).
const listenFDName = "listen"

// apiListener is the API's listener and whether systemd passed it: the
// socket of LISTEN_FDS named "listen" (or the only one), else one bound to
// server.listen. Closing a passed listener closes this process's copy of
// systemd's socket, which stays open: connections that arrive once the
// server stopped accepting wait in its queue for the next process.
func apiListener(cfg ServerConfig, log *slog.Logger) (net.Listener, bool, error) {
	ln, err := passedListener(activation.Files(true))
	if err != nil {
		return nil, false, fmt.Errorf("the socket systemd passed (LISTEN_FDS): %w", err)
	}
	if ln == nil {
		ln, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			return nil, false, fmt.Errorf("listen %s (server.listen): %w", cfg.Listen, err)
		}
		return ln, false, nil
	}
	log.Info("listening on the socket systemd passed", "address", ln.Addr().String())
	if !sameAddr(ln.Addr().String(), cfg.Listen) {
		log.Warn("the socket systemd passed is not server.listen; serving on the passed socket",
			"socket", ln.Addr().String(), "server.listen", cfg.Listen)
	}
	return ln, true, nil
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
