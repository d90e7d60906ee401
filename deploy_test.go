package main

import (
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
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
	for _, want := range []string{"Requires=switchyard.socket", "After=switchyard.socket", "Also=switchyard.socket"} {
		if !strings.Contains(string(unit), want+"\n") {
			t.Errorf("unit lacks %q", want)
		}
	}
	socket, err := os.ReadFile("deploy/switchyard.socket")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"ListenStream=127.0.0.1:8080", "FileDescriptorName=listen", "WantedBy=sockets.target"} {
		if !strings.Contains(string(socket), want+"\n") {
			t.Errorf("socket unit lacks %q", want)
		}
	}
	if m := regexp.MustCompile(`(?m)^Backlog=(\d+)$`).FindSubmatch(socket); m == nil || len(m[1]) < 4 {
		t.Errorf("socket unit's Backlog= not at least 1024: %q", m)
	}
	// The socket's address is the default server.listen.
	if !strings.Contains(string(socket), "ListenStream="+DefaultConfig().Server.Listen+"\n") {
		t.Errorf("socket unit's ListenStream is not the default server.listen %s", DefaultConfig().Server.Listen)
	}
	// Serving HTTPS itself: a socket for 443 named https, one for 80 named
	// http, each a unit of its own (a unit names all its sockets alike).
	units := []string{"switchyard.socket"}
	for name, want := range map[string][]string{
		"switchyard-https.socket": {"ListenStream=443", "FileDescriptorName=" + httpsFDName, "Service=switchyard.service", "WantedBy=sockets.target"},
		"switchyard-http.socket":  {"ListenStream=80", "FileDescriptorName=" + httpFDName, "Service=switchyard.service", "WantedBy=sockets.target"},
	} {
		b, err := os.ReadFile("deploy/" + name)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range want {
			if !strings.Contains(string(b), w+"\n") {
				t.Errorf("%s lacks %q", name, w)
			}
		}
		if m := regexp.MustCompile(`(?m)^Backlog=(\d+)$`).FindSubmatch(b); m == nil || len(m[1]) < 4 {
			t.Errorf("%s's Backlog= not at least 1024: %q", name, m)
		}
		units = append(units, name)
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "switchyard.service")
	os.WriteFile(p, []byte(strings.ReplaceAll(string(unit), "/usr/local/bin/switchyard", builtBinary(t))), 0o644)
	args := []string{"verify", p}
	for _, u := range units {
		b, _ := os.ReadFile("deploy/" + u)
		os.WriteFile(filepath.Join(dir, u), b, 0o644)
		args = append(args, filepath.Join(dir, u))
	}
	// The drop-in, as the README installs it, verified with the service.
	os.MkdirAll(filepath.Join(dir, "switchyard.service.d"), 0o755)
	dropIn, _ := os.ReadFile("deploy/switchyard-https.conf")
	os.WriteFile(filepath.Join(dir, "switchyard.service.d", "https.conf"), dropIn, 0o644)
	out, err := exec.Command("systemd-analyze", args...).CombinedOutput()
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
		"etc/systemd/system/switchyard.socket", "etc/switchyard/switchyard.toml.example", "opt/sy/share/doc/switchyard/README.md",
		"opt/sy/share/doc/switchyard/docs/configuration.md", "opt/sy/share/doc/switchyard/docs/status.png"} {
		if _, err := os.Stat(filepath.Join(dest, f)); err != nil {
			t.Errorf("not installed: %s", f)
		}
	}
	// Both enabled: the socket by sockets.target, the service by
	// multi-user.target.
	for _, link := range []string{"etc/systemd/system/sockets.target.wants/switchyard.socket",
		"etc/systemd/system/multi-user.target.wants/switchyard.service"} {
		if target, err := os.Readlink(filepath.Join(dest, link)); err != nil || !strings.HasSuffix(target, filepath.Base(link)) {
			t.Errorf("not enabled: %s (%q, %v)", link, target, err)
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

// promtool is the one `make test` unpacks from Debian's prometheus package
// (PROMTOOL), or one on PATH; without it the rules test fails saying so.
func promtool(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("PROMTOOL"); p != "" {
		return p
	}
	if p, err := exec.LookPath("promtool"); err == nil {
		return p
	}
	if p, _ := filepath.Abs(".tools/promtool"); p != "" {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Fatal("no promtool: `make test` unpacks it from Debian's prometheus package into .tools/ (make .tools/promtool); the alert rules cannot be checked without it")
	return ""
}

// deploy/switchyard.rules.yml is valid for Prometheus, and its alerts fire
// on the series of switchyard.rules.test.yml as that file expects; every
// metric the rules read is one switchyard exports.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	bin := promtool(t)
	for _, args := range [][]string{{"check", "rules", "switchyard.rules.yml"}, {"test", "rules", "switchyard.rules.test.yml"}} {
		cmd := exec.Command(bin, args...)
		cmd.Dir = "deploy"
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	rules, err := os.ReadFile("deploy/switchyard.rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	// The names switchyard registers are the string literals of its code.
	exported := map[string]bool{}
	sources, _ := filepath.Glob("*.go")
	for _, f := range sources {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range regexp.MustCompile(`"(switchyard_[a-z_]+)"`).FindAllSubmatch(src, -1) {
			exported[string(m[1])] = true
		}
	}
	for _, name := range regexp.MustCompile(`switchyard_[a-z_]+`).FindAllString(string(rules), -1) {
		if series, ok := strings.CutSuffix(name, "_bucket"); ok && exported[series] {
			continue // a histogram's buckets
		}
		if !exported[name] {
			t.Errorf("the rules read %s, which switchyard does not export", name)
		}
	}
}

// `make deb` builds a package whose control data and contents are as the
// README describes: the binary in /usr/bin, the unit pointing at it, the
// config as a conffile of mode 0640, the rules and the README, and a postinst
// that creates the switchyard user and its state directory.
func TestDebPackage(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("dpkg-deb"); err != nil {
		t.Fatal("dpkg-deb is needed to check the package (Debian's dpkg)")
	}
	out := t.TempDir()
	builtBinary(t) // make deb then links what it compiled
	cmd := exec.Command("make", "deb", "VERSION=9.9.9")
	cmd.Env = append(os.Environ(), "GOFLAGS=-buildvcs=false")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make deb: %v\n%s", err, b)
	}
	deb := "dist/switchyard_9.9.9_amd64.deb"
	info, err := exec.Command("dpkg-deb", "-I", deb).CombinedOutput()
	if err != nil {
		t.Fatalf("dpkg-deb -I: %v\n%s", err, info)
	}
	for _, want := range []string{"Package: switchyard", "Version: 9.9.9", "Architecture: amd64", "Depends: adduser",
		"postinst", "prerm", "postrm", "conffiles"} {
		if !strings.Contains(string(info), want) {
			t.Errorf("dpkg-deb -I lacks %q:\n%s", want, info)
		}
	}
	contents, err := exec.Command("dpkg-deb", "-c", deb).CombinedOutput()
	if err != nil {
		t.Fatalf("dpkg-deb -c: %v\n%s", err, contents)
	}
	for _, want := range []string{"-rwxr-xr-x root/root .* ./usr/bin/switchyard$", "-rw-r----- root/root .* ./etc/switchyard/switchyard.toml$",
		" ./lib/systemd/system/switchyard.service$", " ./lib/systemd/system/switchyard.socket$", " ./usr/share/switchyard/switchyard.rules.yml$",
		" ./lib/systemd/system/switchyard-https.socket$", " ./lib/systemd/system/switchyard-http.socket$", " ./usr/share/switchyard/switchyard-https.conf$",
		" ./usr/share/switchyard/haproxy.cfg$",
		" ./usr/share/doc/switchyard/README.md$", " ./usr/share/doc/switchyard/docs/configuration.md$", " ./usr/share/doc/switchyard/docs/status.png$"} {
		if !regexp.MustCompile("(?m)" + want).Match(contents) {
			t.Errorf("dpkg-deb -c lacks %s:\n%s", want, contents)
		}
	}
	if b, err := exec.Command("dpkg-deb", "-x", deb, out).CombinedOutput(); err != nil {
		t.Fatalf("dpkg-deb -x: %v\n%s", err, b)
	}
	unit, _ := os.ReadFile(filepath.Join(out, "lib/systemd/system/switchyard.service"))
	if !strings.Contains(string(unit), "ExecStart=/usr/bin/switchyard serve -config /etc/switchyard/switchyard.toml\n") {
		t.Errorf("the packaged unit does not run /usr/bin/switchyard:\n%s", unit)
	}
	control := filepath.Join(out, "DEBIAN")
	if b, err := exec.Command("dpkg-deb", "-e", deb, control).CombinedOutput(); err != nil {
		t.Fatalf("dpkg-deb -e: %v\n%s", err, b)
	}
	postinst, _ := os.ReadFile(filepath.Join(control, "postinst"))
	for _, want := range []string{"adduser --system --ingroup switchyard", "chown switchyard:switchyard /var/lib/switchyard",
		"chown root:switchyard /etc/switchyard/switchyard.toml", "install -d -o switchyard -g switchyard -m 0750 /var/backups/switchyard"} {
		if !strings.Contains(string(postinst), want) {
			t.Errorf("postinst lacks %q", want)
		}
	}
	// Both units enabled; an upgrade restarts the service, never the
	// socket, whose queue holds the webhooks that arrive meanwhile.
	if !strings.Contains(string(postinst), "systemctl enable switchyard.socket switchyard.service") {
		t.Errorf("postinst does not enable the socket and the service:\n%s", postinst)
	}
	for _, line := range strings.Split(string(postinst), "\n") {
		if strings.Contains(line, "restart") && strings.Contains(line, "switchyard.socket") {
			t.Errorf("postinst restarts the socket: %s", line)
		}
	}
	if !strings.Contains(string(postinst), "systemctl try-restart switchyard.service") {
		t.Errorf("postinst does not restart the service on upgrade:\n%s", postinst)
	}
	if conffiles, _ := os.ReadFile(filepath.Join(control, "conffiles")); strings.TrimSpace(string(conffiles)) != "/etc/switchyard/switchyard.toml" {
		t.Errorf("conffiles: %q", conffiles)
	}
	// The package's version is the binary's.
	v, err := exec.Command(filepath.Join(out, "usr/bin/switchyard"), "--version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(v), "switchyard 9.9.9 (") {
		t.Errorf("the packaged binary's --version: %v %q, want switchyard 9.9.9, the package's", err, v)
	}
}
