package main

import (
	"bytes"
	"database/sql"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// pgBin is where Debian puts PostgreSQL 15's programs.
const pgBin = "/usr/lib/postgresql/15/bin"

// pgPair is a primary and a streaming standby of the test's own, on
// ports of their own, run as the postgres user.
type pgPair struct {
	dir                      string
	primary, standby         string // data directories
	primaryPort, standbyPort string
}

// postgresCmd is a PostgreSQL program run as the postgres user.
func postgresCmd(prog string, args ...string) *exec.Cmd {
	cmd := exec.Command("runuser", append([]string{"-u", "postgres", "--", filepath.Join(pgBin, prog)}, args...)...)
	cmd.Dir = os.TempDir() // the postgres user may not enter the test's directory
	return cmd
}

// asPostgres runs a PostgreSQL program as the postgres user.
func asPostgres(t testing.TB, prog string, args ...string) {
	t.Helper()
	if out, err := postgresCmd(prog, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", prog, strings.Join(args, " "), err, out)
	}
}

// newPGPair makes a primary (initdb) and its standby (pg_basebackup -R),
// and starts both; the test's end stops them and removes their files.
func newPGPair(t *testing.T) *pgPair {
	t.Helper()
	if _, err := os.Stat(filepath.Join(pgBin, "initdb")); err != nil {
		t.Fatalf("PostgreSQL 15's programs are needed in %s: %v", pgBin, err)
	}
	dir, err := os.MkdirTemp("", "switchyard-pg-pair")
	if err != nil {
		t.Fatal(err)
	}
	p := &pgPair{dir: dir, primary: filepath.Join(dir, "primary"), standby: filepath.Join(dir, "standby")}
	p.primaryPort, p.standbyPort = portOf(freeAddr(t)), portOf(freeAddr(t))
	if out, err := exec.Command("chown", "postgres", dir).CombinedOutput(); err != nil {
		t.Fatalf("chown: %v %s", err, out)
	}
	t.Cleanup(func() {
		for _, d := range []string{p.standby, p.primary} {
			_ = postgresCmd("pg_ctl", "-D", d, "-m", "immediate", "stop").Run()
		}
		os.RemoveAll(dir)
	})
	asPostgres(t, "initdb", "-D", p.primary, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C")
	conf := fmt.Sprintf("\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '%s'\nwal_level = replica\n"+
		"max_wal_senders = 4\nhot_standby = on\nfsync = off\nshared_buffers = 16MB\n", dir)
	appendFile(t, filepath.Join(p.primary, "postgresql.conf"), conf)
	startPG(t, p.primary, &p.primaryPort, filepath.Join(dir, "primary.log"))
	asPostgres(t, "pg_basebackup", "-h", "127.0.0.1", "-p", p.primaryPort, "-U", "postgres", "-D", p.standby, "-R", "-X", "stream")
	startPG(t, p.standby, &p.standbyPort, filepath.Join(dir, "standby.log"))
	return p
}

// startPG starts the server of data directory data on *port, logging to
// log. The port was free when freeAddr chose it, but the tests beside
// this one open ports all the time: one taken since is chosen anew. Any
// other failure prints the server's log.
func startPG(t *testing.T, data string, port *string, log string) {
	t.Helper()
	for try := 1; ; try++ {
		appendFile(t, filepath.Join(data, "postgresql.conf"), fmt.Sprintf("\nport = %s\n", *port)) // the last one counts
		os.Remove(log)
		out, err := postgresCmd("pg_ctl", "-D", data, "-l", log, "-w", "start").CombinedOutput()
		if err == nil {
			return
		}
		logged, _ := os.ReadFile(log)
		if try < 3 && strings.Contains(string(logged), "Address already in use") {
			t.Logf("port %s taken since it was chosen: %s", *port, bytes.TrimSpace(logged))
			*port = portOf(freeAddr(t))
			continue
		}
		t.Fatalf("pg_ctl -D %s start: %v\n%s\nthe server's log:\n%s", data, err, out, logged)
	}
}

// portOf is the port of a host:port.
func portOf(addr string) string { return addr[strings.LastIndex(addr, ":")+1:] }

func appendFile(t testing.TB, path, text string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(text); err != nil {
		t.Fatal(err)
	}
}

// url is a URL of database db naming both servers, for the writable one.
func (p *pgPair) url(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%s,127.0.0.1:%s/%s?target_session_attrs=read-write&sslmode=disable",
		p.primaryPort, p.standbyPort, db)
}

// open opens database db on the server at port.
func (p *pgPair) open(t testing.TB, port, db string) *sql.DB {
	t.Helper()
	d, err := sql.Open("pgx", fmt.Sprintf("postgres://postgres@127.0.0.1:%s/%s?sslmode=disable", port, db))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// A node on a primary and its streaming standby (a multi-host URL,
// target_session_attrs=read-write), under a steady stream of webhooks:
// the primary turned read-only without closing its connections, then
// writable again; then the primary stopped (immediate) and the standby
// promoted. Each time every 202 is stored once, nothing goes to an -error
// queue, no message is retried, and the leases carry on.
func TestDatabaseFailover(t *testing.T) {
	t.Parallel()
	p := newPGPair(t)
	admin := p.open(t, p.primaryPort, "postgres")
	if _, err := admin.Exec("CREATE DATABASE switchyard"); err != nil {
		t.Fatal(err)
	}
	vhost := newVhost(t)
	addr := freeAddr(t)
	config := writeConfigWith(t, t.TempDir(), addr, fmt.Sprintf("driver = \"postgres\"\nurl = %q\nmax_conns = 4", p.url("switchyard")),
		"node_name = \"node-1\"\nlease_ttl = \"3s\"", amqpURL(vhost))
	cmd, out := startProcess(t, config, addr)
	_ = cmd

	stop, got := webhookStream(t, "http://"+addr, loadFixture(t, "issues", "opened"), 2, 40*time.Millisecond)
	answered := func() int { return len(got()) }
	waitMore := func(what string, n int) {
		before := answered()
		eventually(t, 90*time.Second, what, func() bool { return answered() >= before+n })
	}
	holds := func() bool {
		return scrapeWith(http.DefaultClient, "http://"+addr+"/metrics", "switchyard_lease_held")[jobAlerts] == 1
	}
	eventually(t, 30*time.Second, "the node holding its leases", holds)
	waitMore("webhooks before the read-only spell", 40)

	// The primary turns read-only, its connections left open.
	if _, err := admin.Exec("ALTER SYSTEM SET default_transaction_read_only = on"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec("SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	// /readyz stays 200 while the broker takes webhooks the store does
	// not: it names the database when it cannot write.
	dbReady := func() bool {
		code, body := do(t, httpRequest(t, http.MethodGet, "http://"+addr+"/readyz", "", ""))
		return code == http.StatusOK && !strings.Contains(body, `"database"`)
	}
	eventually(t, 60*time.Second, "the node to find the database read-only", func() bool { return !dbReady() })
	waitMore("webhooks while the primary is read-only", 40)
	if _, err := admin.Exec("ALTER SYSTEM RESET default_transaction_read_only"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec("SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 60*time.Second, "the node to find the database writable again", dbReady)
	waitMore("webhooks after the read-only spell", 40)

	// The primary dies; the standby is promoted.
	asPostgres(t, "pg_ctl", "-D", p.primary, "-m", "immediate", "stop")
	waitMore("webhooks while no primary answers", 20)
	asPostgres(t, "pg_ctl", "-D", p.standby, "-w", "promote")
	waitMore("webhooks after the promotion", 40)
	stop()

	answers := got()
	allAccepted(t, answers, "through a read-only primary and a failover")
	db := p.open(t, p.standbyPort, "switchyard")
	eventually(t, 60*time.Second, fmt.Sprintf("%d deliveries stored", len(answers)), func() bool {
		return queryInt(t, db, "SELECT count(DISTINCT delivery_id) FROM github") >= len(answers)
	})
	if n, distinct := queryInt(t, db, "SELECT count(*) FROM github"), queryInt(t, db, "SELECT count(DISTINCT delivery_id) FROM github"); n != distinct || distinct != len(answers) {
		t.Errorf("github holds %d rows of %d deliveries, want each of the %d once", n, distinct, len(answers))
	}
	for _, q := range []string{queueGitHub, queueDatabase} {
		if n := ready(t, vhost, errorQueue(q)); n != 0 {
			t.Errorf("%s holds %d messages", errorQueue(q), n)
		}
	}
	if strings.Contains(out.String(), "will retry") {
		t.Errorf("a message was retried:\n%s", out)
	}
	eventually(t, 60*time.Second, "the leases held on the new primary", holds)
	if n := queryInt(t, db, "SELECT count(*) FROM leases WHERE node = 'node-1'"); n == 0 {
		t.Errorf("no lease of node-1 on the new primary")
	}
}
