package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// pgbouncer is the one `make test` builds (PGBOUNCER, or .tools/pgbouncer).
func pgbouncer(t testing.TB) string {
	t.Helper()
	p := os.Getenv("PGBOUNCER")
	if p == "" {
		p, _ = filepath.Abs(".tools/pgbouncer")
	}
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no pgbouncer at %s: make .tools/pgbouncer builds it", p)
		}
		t.Skipf("no pgbouncer at %s: make .tools/pgbouncer builds it", p)
	}
	return p
}

// startPgBouncer runs PgBouncer in transaction mode, tracking no prepared
// statements, as the postgres user (it refuses root), in front of the
// local PostgreSQL, and returns db's URL through it: without
// default_query_exec_mode, as a user who missed the README's line would
// write it.
func startPgBouncer(t *testing.T, db string) string {
	t.Helper()
	bin := pgbouncer(t)
	dir, err := os.MkdirTemp("", "switchyard-pgbouncer")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	port := freePort(t)
	ini := fmt.Sprintf("[databases]\n* = host=127.0.0.1 port=5432\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = %d\n"+
		"unix_socket_dir =\nauth_type = trust\nauth_file = %s/users\npool_mode = transaction\nmax_client_conn = 200\n"+
		"default_pool_size = 4\nignore_startup_parameters = extra_float_digits\nlogfile = %s/pgbouncer.log\n"+
		// Prepared statements not tracked, as PgBouncer before 1.21
		// (Debian 12's 1.18) and one configured so do.
		"max_prepared_statements = 0\n", port, dir, dir)
	for name, text := range map[string]string{"pgbouncer.ini": ini, "users": `"postgres" ""` + "\n"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	raw, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "pgbouncer"), raw, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := exec.Command("chown", "-R", "postgres", dir).Run(); err != nil {
		t.Skipf("cannot give %s to the postgres user: %v", dir, err)
	}
	_ = os.Chmod(dir, 0o755)
	cmd := exec.Command("runuser", "-u", "postgres", "--", filepath.Join(dir, "pgbouncer"), filepath.Join(dir, "pgbouncer.ini"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // runuser and pgbouncer, stopped together
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		_ = cmd.Wait()
	})
	eventually(t, 20*time.Second, "pgbouncer listening", func() bool {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	u, err := url.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = fmt.Sprintf("127.0.0.1:%d", port)
	q := u.Query()
	q.Del("default_query_exec_mode")
	u.RawQuery = q.Encode()
	return u.String()
}

// A node whose database.url points at PgBouncer in transaction mode
// without default_query_exec_mode=exec, on a port check-config does not
// know for a pooler's: the first "prepared statement ... already exists"
// (or "does not exist") tells the store a pooler is there, it goes on
// unprepared, warns naming the URL's option, and the status says so;
// every webhook is stored once.
func TestPoolerFoundWithoutExecMode(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	dbURL := startPgBouncer(t, newPostgresDatabase(t))
	vhost := newVhost(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	config := writeConfigWith(t, dir, addr, fmt.Sprintf("driver = \"postgres\"\nurl = %q\nmax_conns = 4", dbURL), "", amqpURL(vhost))
	_, out := startProcess(t, config, addr)
	url := "http://" + addr
	stop := openLoop(t, func() string { return url }, 5*time.Millisecond)
	eventually(t, time.Minute, "the pooler found", func() bool { return strings.Contains(out.String(), "a pooler in transaction mode") })
	eventually(t, time.Minute, "webhooks stored after it", func() bool {
		return scrape(t, url+"/metrics")[`switchyard_messages_consumed_total{outcome="done",queue="github"}`] >= 200
	})
	answers := stop()
	var guids []string
	for _, a := range answers {
		if a.code != http.StatusAccepted {
			t.Errorf("webhook %d: %d %s %v", a.seq, a.code, a.body, a.err)
			continue
		}
		guids = append(guids, a.guid)
	}
	db := DatabaseConfig{Driver: "postgres", URL: dbURL + "&default_query_exec_mode=exec"}
	if !strings.Contains(dbURL, "?") {
		db.URL = dbURL + "?default_query_exec_mode=exec"
	}
	storedAll(t, db, guids, 2*time.Minute)
	conn := openStoreDB(t, db)
	if n := queryInt(t, conn, "SELECT count(*) - count(DISTINCT delivery_id) FROM github"); n != 0 {
		t.Errorf("%d webhooks stored more than once", n)
	}
	if !strings.Contains(out.String(), "default_query_exec_mode=exec") {
		t.Errorf("the warning does not name the URL's option:\n%s", out)
	}
	_, raw := do(t, mustRequestAuth(t, url+"/api/v1/status"))
	var st Status
	if err := json.Unmarshal([]byte(raw), &st); err != nil || st.Database.Unprepared == nil {
		t.Errorf("the status: %v, pooler found at %v, want it said", err, st.Database.Unprepared)
	}
}
