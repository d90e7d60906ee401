package main

import (
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The unit file passes systemd-analyze verify (with ExecStart pointing at a
// binary that exists, as verify checks that).
func TestSystemdUnitVerifies(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("systemd-analyze"); err != nil {
		if out, err := exec.Command("apt-get", "install", "-y", "-q", "systemd").CombinedOutput(); err != nil {
			t.Fatalf("systemd-analyze missing and cannot be installed: %v\n%s", err, out)
		}
	}
	unit, err := os.ReadFile("deploy/switchyard.service")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Type=notify", "User=switchyard", "StateDirectory=switchyard", "ConfigurationDirectory=switchyard",
		"ExecStart=/usr/local/bin/switchyard serve -config /etc/switchyard/switchyard.toml", "Restart=on-failure",
		"TimeoutStopSec=30", "ProtectSystem=strict", "ProtectHome=yes", "NoNewPrivileges=yes", "PrivateTmp=yes",
		"RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX", "ExecReload=/bin/kill -HUP $MAINPID"} {
		if !strings.Contains(string(unit), want+"\n") {
			t.Errorf("unit lacks %q", want)
		}
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "switchyard.service")
	os.WriteFile(p, []byte(strings.ReplaceAll(string(unit), "/usr/local/bin/switchyard", builtBinary(t))), 0o644)
	out, err := exec.Command("systemd-analyze", "verify", p).CombinedOutput()
	if err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// `make install` puts binary, unit, example config and README under DESTDIR,
// with no Go on the PATH (as under sudo): it installs what `make build` made.
// Without a built binary it fails, saying to build first.
func TestMakeInstall(t *testing.T) {
	t.Parallel()
	dest := t.TempDir()
	noGo := append(os.Environ(), "PATH=/usr/sbin:/usr/bin:/sbin:/bin")
	cmd := exec.Command("make", "install", "DESTDIR="+dest, "BINARY="+builtBinary(t), "PREFIX=/opt/sy")
	cmd.Env = noGo
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make install: %v\n%s", err, out)
	}
	missing := exec.Command("make", "install", "DESTDIR="+t.TempDir(), "BINARY="+filepath.Join(dest, "nothing-here"))
	missing.Env = noGo
	if out, err := missing.CombinedOutput(); err == nil || !strings.Contains(string(out), "run 'make build' first") {
		t.Errorf("make install without a binary: %v\n%s", err, out)
	}
	for _, f := range []string{"opt/sy/bin/switchyard", "etc/systemd/system/switchyard.service",
		"etc/switchyard/switchyard.toml.example", "opt/sy/share/doc/switchyard/README.md"} {
		if _, err := os.Stat(filepath.Join(dest, f)); err != nil {
			t.Errorf("not installed: %s", f)
		}
	}
	unit, _ := os.ReadFile(filepath.Join(dest, "etc/systemd/system/switchyard.service"))
	if !strings.Contains(string(unit), "ExecStart=/opt/sy/bin/switchyard serve") {
		t.Errorf("unit ExecStart not moved to PREFIX:\n%s", unit)
	}
}

// serve sends READY=1 to NOTIFY_SOCKET only once its listener accepts
// connections, and STOPPING=1 on SIGTERM.
func TestServeNotifiesSystemd(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	addr := freeAddr(t)
	config := writeConfig(t, dir, addr, filepath.Join(dir, "sy.db"), amqpURL(vhost))
	cmd := exec.Command(builtBinary(t), "serve", "-config", config)
	cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+sock)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	}()
	read := func() string {
		t.Helper()
		buf := make([]byte, 4096)
		conn.SetReadDeadline(time.Now().Add(30 * time.Second))
		n, err := conn.Read(buf)
		if err != nil {
			t.Fatalf("no notification: %v\n%s", err, out.String())
		}
		return string(buf[:n])
	}
	if msg := read(); msg != "READY=1" {
		t.Fatalf("first notification %q, want READY=1", msg)
	}
	// Right after READY=1 the listener must take a connection at once.
	resp, err := (&http.Client{Timeout: 2 * time.Second}).Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatalf("READY=1 sent before the listener accepts: %v", err)
	}
	resp.Body.Close()
	cmd.Process.Signal(syscall.SIGTERM)
	if msg := read(); msg != "STOPPING=1" {
		t.Errorf("notification on SIGTERM %q, want STOPPING=1", msg)
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("exit: %v\n%s", err, out.String())
	}
}
