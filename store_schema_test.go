package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// laterSchema writes into a migrated database what a newer switchyard's
// migration would: a later version, with its floor.
func laterSchema(t *testing.T, cfg DatabaseConfig, version, floor int) {
	t.Helper()
	db := openWritableDB(t, cfg)
	if _, err := db.Exec(`INSERT INTO schema_migrations (version, name, applied_at, floor) VALUES ($1, $2, $3, $4)`,
		version, "a later one", formatTime(time.Now()), floor); err != nil {
		t.Fatal(err)
	}
	if cfg.Driver != "postgres" {
		if _, err := db.Exec(fmt.Sprintf("PRAGMA user_version = %d", version)); err != nil {
			t.Fatal(err)
		}
	}
}

// Each migration's floor: additive migrations keep the one before, a
// "-- floor:" line sets it, and none is above its own version.
func TestMigrationFloors(t *testing.T) {
	t.Parallel()
	for _, src := range []string{schemaSQL, schemaPostgresSQL} {
		ms, err := parseMigrations(src)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ms {
			if m.version < firstFloored && m.floor != m.version || m.version == firstFloored && m.floor != firstFloored {
				t.Errorf("migration %d: floor %d", m.version, m.floor)
			}
		}
	}
	ms, err := parseMigrations("-- migration 19: a\n-- floor: 19\nA;\n-- migration 20: additive\nB;\n-- migration 21: drops a column\n-- floor: 21\nC;\n")
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(ms[0].floor, ms[1].floor, ms[2].floor); got != "19 19 21" {
		t.Errorf("floors %s, want 19 19 21", got)
	}
	if _, err := parseMigrations("-- migration 19: a\n-- floor: 20\nA;\n"); err == nil {
		t.Error("a floor above its own version taken")
	}
}

// A rolling upgrade: serve starts on a database a newer version migrated
// when its floor is this binary's version or older, saying so, and
// refuses one whose floor is above it, naming both (exit 1).
func TestServeOnNewerDatabase(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		cfg := testStore(t)
		store, err := OpenStore(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := store.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		ours := store.Version()
		store.Close()
		vhost := newVhost(t)
		dir := t.TempDir()
		addr := freeAddr(t)
		config := writeConfigWith(t, dir, addr, databaseKeys(cfg), "", amqpURL(vhost))

		laterSchema(t, cfg, ours+1, ours)
		cmd, out := startProcess(t, config, addr)
		stopProcess(t, cmd, out, 30*time.Second)
		if !strings.Contains(out.String(), "newer than this binary's, and its floor allows this binary") {
			t.Errorf("serve on a newer database whose floor it meets does not say so:\n%s", out)
		}

		laterSchema(t, cfg, ours+2, ours+2)
		msg, code := runBinary(t, "serve", "-config", config)
		want := fmt.Sprintf("database schema version %d works with switchyard of schema version %d or later (its floor); this binary's is %d: upgrade switchyard",
			ours+2, ours+2, ours)
		if code != 1 || !strings.Contains(msg, want) {
			t.Errorf("serve on a database whose floor is above it: exit %d, want 1 saying %q:\n%s", code, want, msg)
		}
	})
}

// A running node whose database's floor rises above it (another node's
// migration) stops consuming, burns no attempt, says why on /readyz and
// in the status, and takes webhooks still; once the floor is back within
// its version it stores them.
func TestNodeBelowRisingFloor(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	vhost := newVhost(t)
	dbURL := newPostgresDatabase(t)
	n := startNode(t, "node-1", dbURL, amqpURL(vhost))
	body := loadFixture(t, "issues", "opened")
	db := openStoreDB(t, DatabaseConfig{Driver: "postgres", URL: dbURL})
	first := newGUID()
	if code := postWebhook(t, "http://"+n.addr, "issues", first, body); code != http.StatusAccepted {
		t.Fatalf("webhook: %d", code)
	}
	eventually(t, 20*time.Second, "the first webhook stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", first) == 1
	})
	ours := queryInt(t, db, "SELECT max(version) FROM schema_migrations")
	laterSchema(t, DatabaseConfig{Driver: "postgres", URL: dbURL}, ours+1, ours+1)
	eventually(t, 20*time.Second, "/readyz saying the node needs upgrading", func() bool {
		code, body := do(t, httpRequest(t, http.MethodGet, "http://"+n.addr+"/readyz", "", ""))
		return code == http.StatusServiceUnavailable && strings.Contains(body, "needs a newer switchyard")
	})
	second := newGUID()
	if code := postWebhook(t, "http://"+n.addr, "issues", second, body); code != http.StatusAccepted {
		t.Fatalf("webhook while the node is below the floor: %d", code)
	}
	eventually(t, 10*time.Second, "the webhook waiting on the broker", func() bool {
		return ready(t, vhost, queueGitHub) == 1 && ready(t, vhost, queueDatabase) == 1
	})
	_, status := do(t, httpRequest(t, http.MethodGet, "http://"+n.addr+"/api/v1/status", "", "operator-token-for-tests"))
	if !strings.Contains(status, "this node stopped consuming, upgrade it") {
		t.Errorf("the status does not say to upgrade the node:\n%s", status)
	}
	if c := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", second); c != 0 {
		t.Errorf("a node below the floor stored a webhook")
	}
	for _, q := range []string{queueGitHub, queueDatabase} {
		if r, e := ready(t, vhost, retryQueue(q)), ready(t, vhost, errorQueue(q)); r+e != 0 {
			t.Errorf("%s: %d in -retry, %d in -error: an attempt burned", q, r, e)
		}
	}
	// The newer version rolled back (its row gone): the node consumes again.
	if _, err := db.Exec("DELETE FROM schema_migrations WHERE version = $1", ours+1); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the waiting webhook stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", second) == 1
	})
	if strings.Contains(n.out.String(), "will retry") {
		t.Errorf("a message failed while the node was below the floor:\n%s", n.out)
	}
}

// A lease's term rises when another node takes it over, not when its
// holder renews it; a write transaction fenced by a stale holding fails
// and changes nothing, one by the current holding writes.
func TestLeaseTermsFenceStaleWrites(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		ctx := context.Background()
		store := migratedStore(t)
		take := func(node string, ttl time.Duration) (held bool, term int64) {
			t.Helper()
			if err := store.WriteTx(ctx, func(tx *Tx) (err error) {
				held, term, err = tx.TakeLease(ctx, jobAlerts, node, ttl)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return held, term
		}
		if held, term := take("node-1", time.Minute); !held || term != 1 {
			t.Fatalf("a new lease: held %v, term %d; want held, term 1", held, term)
		}
		if held, term := take("node-1", time.Millisecond); !held || term != 1 {
			t.Fatalf("renewed by its holder: held %v, term %d; want held, term 1", held, term)
		}
		eventually(t, 5*time.Second, "the lease expired and taken by node 2", func() bool {
			held, term := take("node-2", time.Minute)
			return held && term == 2
		})
		if held, _ := take("node-1", time.Minute); held {
			t.Fatal("node 1 took a lease node 2 holds")
		}
		write := func(f Fence, value string) error {
			return store.WriteTxUnder(ctx, f, func(tx *Tx) error {
				return tx.SetSetting(ctx, "fenced", value, time.Now())
			})
		}
		if err := write(Fence{Job: jobAlerts, Node: "node-1", Term: 1}, "stale"); !errors.Is(err, ErrStaleLease) {
			t.Errorf("a write of the stale holding: %v, want ErrStaleLease", err)
		}
		if v, _ := store.Setting(ctx, "fenced"); v != "" {
			t.Errorf("the stale holding's write changed the setting to %q", v)
		}
		if err := write(Fence{Job: jobAlerts, Node: "node-2", Term: 2}, "current"); err != nil {
			t.Fatalf("a write of the current holding: %v", err)
		}
		if v, _ := store.Setting(ctx, "fenced"); v != "current" {
			t.Errorf("the setting is %q, want the current holding's", v)
		}
	})
}

// Nodes started together on a new PostgreSQL database migrate it once
// between them: each migration waits on the others' lock and then sees
// what they committed, the tables they created included, not a catalog
// it cached before the lock.
func TestMigrateNodesAtOnce(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	for round := range 5 {
		cfg := postgresConfig(t)
		const nodes = 4
		stores := make([]*Store, nodes)
		for i := range stores {
			s, err := OpenStore(context.Background(), cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			// The version read once before, as serve's start does: the
			// connection has looked for schema_migrations and not found it.
			if v, err := s.SchemaVersion(context.Background()); err != nil || v != 0 {
				t.Fatalf("a new database's version: %d %v", v, err)
			}
			stores[i] = s
		}
		start := make(chan struct{})
		errs := make(chan error, nodes)
		for _, s := range stores {
			go func() {
				<-start
				_, _, err := s.Migrate(context.Background())
				errs <- err
			}()
		}
		close(start)
		for range nodes {
			if err := <-errs; err != nil {
				t.Errorf("round %d: a node's migration: %v", round, err)
			}
		}
		if t.Failed() {
			return
		}
	}
}
