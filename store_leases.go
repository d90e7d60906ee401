package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// Several nodes, one database: the rows by which nodes sharing one
// database run each once-only job on one node at a time and know of each
// other, the lock that serializes what two nodes must not interleave, and
// the claim that keeps an SQLite file to one serve. Every time
// here is the database's clock (engine.clock), so that nodes whose clocks
// differ agree on when a lease expires or a node is gone.

// TakeLease takes job's lease for node, or renews it when node holds it,
// until ttl from now: one statement, which takes a lease that is absent or
// expired and renews one only for its holder, so that of two nodes asking
// at once one gets it. It reports whether node holds the lease, and its
// term, raised when another node held it before.
func (tx *Tx) TakeLease(ctx context.Context, job, node string, ttl time.Duration) (held bool, term int64, err error) {
	d := tx.s.engine
	err = tx.row(ctx, `INSERT INTO leases (job, node, expires_at, taken_at, term) VALUES ($1, $2, `+d.clock("$3")+`, `+d.clock("0")+`, 1)
		ON CONFLICT (job) DO UPDATE SET node = excluded.node, expires_at = excluded.expires_at,
			taken_at = CASE WHEN leases.node = excluded.node THEN leases.taken_at ELSE excluded.taken_at END,
			term = CASE WHEN leases.node = excluded.node THEN leases.term ELSE leases.term + 1 END
		WHERE leases.node = excluded.node OR leases.expires_at < `+d.clock("0")+`
		RETURNING term`, job, node, ttl.Milliseconds()).Scan(&term)
	if errors.Is(err, sql.ErrNoRows) {
		return false, 0, nil // another node holds it
	}
	if err != nil {
		return false, 0, fmt.Errorf("take lease %s: %w", job, err)
	}
	return true, term, nil
}

// ReleaseLease gives job's lease up, when node holds it: it expires now,
// and another node takes it at its next try.
func (tx *Tx) ReleaseLease(ctx context.Context, job, node string) error {
	_, err := tx.write(ctx, atOnce, `UPDATE leases SET expires_at = `+tx.s.engine.clock("-1")+` WHERE job = $1 AND node = $2`, job, node)
	if err != nil {
		return fmt.Errorf("release lease %s: %w", job, err)
	}
	return nil
}

// SeeNode writes node's row: its version, when it started, that it reads
// zstd messages, and that it is seen now; rows of nodes gone for nodesKept
// go.
func (tx *Tx) SeeNode(ctx context.Context, node, version string, started time.Time) error {
	d := tx.s.engine
	if _, err := tx.write(ctx, atOnce, `INSERT INTO nodes (name, version, started_at, seen_at, reads) VALUES ($1, $2, $3, `+d.clock("0")+`, $4)
		ON CONFLICT (name) DO UPDATE SET version = excluded.version, started_at = excluded.started_at, seen_at = excluded.seen_at,
			reads = excluded.reads`,
		node, version, formatTime(started), readsZstd+formatTime(started)); err != nil {
		return fmt.Errorf("write node %s: %w", node, err)
	}
	if _, err := tx.write(ctx, atOnce, `DELETE FROM nodes WHERE seen_at < `+d.clock("$1"), -nodesKept.Milliseconds()); err != nil {
		return fmt.Errorf("forget gone nodes: %w", err)
	}
	return nil
}

// readsZstd begins nodes.reads of a node that reads zstd messages; the
// process's start follows it, so that a node of an older version started
// under the same name, which leaves reads as it was, is not taken for one.
const readsZstd = "zstd "

// ZstdReaders reports whether every node seen within gone reads zstd
// messages (nodes.reads names the start of the process that wrote it).
func (tx *Tx) ZstdReaders(ctx context.Context, gone time.Duration) (bool, error) {
	var n int
	err := tx.row(ctx, `SELECT count(*) FROM nodes WHERE reads != ($1 || started_at) AND seen_at >= `+tx.s.engine.clock("$2"),
		readsZstd, -gone.Milliseconds()).Scan(&n)
	if err != nil {
		return false, fmt.Errorf("read what the nodes read: %w", err)
	}
	return n == 0, nil
}

// nodesKept is how long the row of a node gone stays.
const nodesKept = 7 * 24 * time.Hour

// NodeView is one node as the status shows it.
type NodeView struct {
	Name      string    `json:"name"`
	Version   string    `json:"version"`
	StartedAt time.Time `json:"started_at"`
	SeenAt    time.Time `json:"seen_at"`
	// Gone: not seen for 3 x lease_ttl.
	Gone   bool     `json:"gone"`
	Leases []string `json:"leases"`
}

// LeaseView is one job's lease as the status shows it.
type LeaseView struct {
	Job       string    `json:"job"`
	Node      string    `json:"node"`
	ExpiresAt time.Time `json:"expires_at"`
	TakenAt   time.Time `json:"taken_at"`
	// Live: held, not expired, by a node that is not gone. When it is
	// not, Orphaned is how long the job has had no live holder.
	Live     bool          `json:"live"`
	Orphaned time.Duration `json:"orphaned_seconds,omitempty"`
}

// Cluster is the nodes and the leases, read in one read transaction, with
// the database's clock: a node is gone when not seen for 3 x ttl.
func (s *Store) Cluster(ctx context.Context, ttl time.Duration) (nodes []NodeView, leases []LeaseView, err error) {
	tx, err := s.snapshot(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("read the nodes: %w", err)
	}
	defer tx.done()
	var now string
	if err := tx.row(ctx, "SELECT "+s.engine.clock("0")).Scan(&now); err != nil {
		return nil, nil, fmt.Errorf("read the database's clock: %w", err)
	}
	dbNow, _ := time.Parse(timeFormat, now)
	goneBefore := formatTime(dbNow.Add(-3 * ttl))
	rows, err := tx.rows(ctx, `SELECT name, version, started_at, seen_at, seen_at < $1 FROM nodes ORDER BY name`, goneBefore)
	if err != nil {
		return nil, nil, fmt.Errorf("read the nodes: %w", err)
	}
	defer rows.Close()
	gone := map[string]bool{}
	for rows.Next() {
		var n NodeView
		var started, seen string
		if err := rows.Scan(&n.Name, &n.Version, &started, &seen, &n.Gone); err != nil {
			return nil, nil, fmt.Errorf("read the nodes: %w", err)
		}
		n.StartedAt, _ = time.Parse(timeFormat, started)
		n.SeenAt, _ = time.Parse(timeFormat, seen)
		n.Leases = []string{}
		gone[n.Name] = n.Gone
		nodes = append(nodes, n)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	lrows, err := tx.rows(ctx, `SELECT job, node, expires_at, taken_at FROM leases ORDER BY job`)
	if err != nil {
		return nil, nil, fmt.Errorf("read the leases: %w", err)
	}
	defer lrows.Close()
	for lrows.Next() {
		var l LeaseView
		var expires, taken string
		if err := lrows.Scan(&l.Job, &l.Node, &expires, &taken); err != nil {
			return nil, nil, fmt.Errorf("read the leases: %w", err)
		}
		l.ExpiresAt, _ = time.Parse(timeFormat, expires)
		l.TakenAt, _ = time.Parse(timeFormat, taken)
		l.Live = l.ExpiresAt.After(dbNow) && !gone[l.Node]
		if !l.Live {
			l.Orphaned = dbNow.Sub(l.ExpiresAt).Round(time.Second)
		}
		for i := range nodes {
			if nodes[i].Name == l.Node && l.Live {
				nodes[i].Leases = append(nodes[i].Leases, l.Job)
			}
		}
		leases = append(leases, l)
	}
	return nodes, leases, lrows.Err()
}

// VoteDrained records that node found the active broker drained for the
// pending switch whose switchedAt is key, with nothing of it in hand.
func (tx *Tx) VoteDrained(ctx context.Context, node, key string) error {
	_, err := tx.write(ctx, atOnce, "UPDATE nodes SET drained = $1 WHERE name = $2", key, node)
	return err
}

// AllDrained reports whether every live node (seen within gone) has voted
// key drained: only then may the switch complete.
func (tx *Tx) AllDrained(ctx context.Context, key string, gone time.Duration) (bool, error) {
	var n int
	err := tx.row(ctx, `SELECT count(*) FROM nodes WHERE drained != $1 AND seen_at >= `+tx.s.engine.clock("$2"),
		key, -gone.Milliseconds()).Scan(&n)
	if err != nil {
		return false, fmt.Errorf("read the nodes' drain checks: %w", err)
	}
	return n == 0, nil
}

// Lock serializes, until tx ends, every transaction that locks key: what
// reads and then writes (the broker switch, the first copy of an event)
// must not interleave with another node doing the same (engine.lock:
// nothing on SQLite, whose write transactions are serial already; a
// transaction-level advisory lock on PostgreSQL).
func (t *Tx) Lock(ctx context.Context, key string) error {
	if err := t.flush(ctx); err != nil {
		return err
	}
	if err := t.s.engine.lock(ctx, t.tc, key); err != nil {
		return fmt.Errorf("lock %s: %w", key, err)
	}
	return nil
}

// Claim takes the database for this process's serve (engine.claim): an
// SQLite file has one serve, a PostgreSQL database is shared.
func (s *Store) Claim(ctx context.Context) error {
	c, err := s.engine.claim(ctx, s.r)
	if err != nil {
		return err
	}
	s.claim = c
	return nil
}
