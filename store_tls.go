package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// The certificates' rows: what serving HTTPS by ACME keeps (the ACME
// account, each certificate, its key and metadata, as files by key), and
// the locks that make ordering a certificate one node's at a time. The
// daemon's certificate storage (daemon_tls.go) is these methods.

// ErrNoTLSFile is a key tls_files does not hold.
var ErrNoTLSFile = errors.New("no such TLS file")

// TLSFile is one of tls_files' rows: its key, value and when it was
// written.
type TLSFile struct {
	Key      string
	Value    []byte
	Modified time.Time
}

// LoadTLSFile reads key's file, or ErrNoTLSFile.
func (s *Store) LoadTLSFile(ctx context.Context, key string) (TLSFile, error) {
	f := TLSFile{Key: key}
	var modified string
	err := s.pool().row(ctx, "SELECT value, modified_at FROM tls_files WHERE key = $1", key).Scan(&f.Value, &modified)
	if errors.Is(err, sql.ErrNoRows) {
		return f, fmt.Errorf("%w: %s", ErrNoTLSFile, key)
	}
	if err != nil {
		return f, fmt.Errorf("read TLS file %s: %w", key, err)
	}
	f.Modified, _ = time.Parse(timeFormat, modified)
	return f, nil
}

// StoreTLSFile writes key's file, in place of what it held.
func (tx *Tx) StoreTLSFile(ctx context.Context, key string, value []byte, now time.Time) error {
	_, err := tx.write(ctx, atOnce, `INSERT INTO tls_files (key, value, modified_at) VALUES ($1, $2, $3)
		ON CONFLICT (key) DO UPDATE SET value = excluded.value, modified_at = excluded.modified_at`, key, value, formatTime(now))
	if err != nil {
		return fmt.Errorf("write TLS file %s: %w", key, err)
	}
	return nil
}

// DeleteTLSFiles deletes key's file and every file under it (key/...).
func (tx *Tx) DeleteTLSFiles(ctx context.Context, key string) error {
	lo, hi := under(key + "/")
	_, err := tx.write(ctx, atOnce, "DELETE FROM tls_files WHERE key = $1 OR (key >= $2 AND key < $3)", key, lo, hi)
	if err != nil {
		return fmt.Errorf("delete TLS file %s: %w", key, err)
	}
	return nil
}

// TLSKeys lists the keys under prefix: with recursive every file's key,
// else the names one level down (a file's, or a directory's that holds
// more), each once, in order.
func (s *Store) TLSKeys(ctx context.Context, prefix string, recursive bool) ([]string, error) {
	dir := strings.TrimSuffix(prefix, "/") + "/"
	if prefix == "" {
		dir = ""
	}
	lo, hi := under(dir)
	rows, err := s.pool().rows(ctx, "SELECT key FROM tls_files WHERE key >= $1 AND key < $2 ORDER BY key", lo, hi)
	if err != nil {
		return nil, fmt.Errorf("list TLS files under %s: %w", prefix, err)
	}
	defer rows.Close()
	var keys []string
	for rows.Next() {
		var key string
		if err := rows.Scan(&key); err != nil {
			return nil, err
		}
		if !recursive {
			if next, _, more := strings.Cut(key[len(dir):], "/"); more {
				key = dir + next
			}
		}
		if len(keys) == 0 || keys[len(keys)-1] != key {
			keys = append(keys, key)
		}
	}
	return keys, rows.Err()
}

// under is the range of keys that begin with dir (a path ending in "/",
// or "" for every key), in byte order, as both databases compare them.
func under(dir string) (lo, hi string) {
	if dir == "" {
		return "", "\U0010FFFF"
	}
	return dir, dir[:len(dir)-1] + string(rune(dir[len(dir)-1]+1))
}

// TakeTLSLock takes name's lock for node until ttl from now, when no
// other node holds it or its holder's has expired (a node that died
// holding it), or renews it for its holder. It reports whether node holds
// it.
func (tx *Tx) TakeTLSLock(ctx context.Context, name, node string, ttl time.Duration) (bool, error) {
	d := tx.s.engine
	res, err := tx.write(ctx, atOnce, `INSERT INTO tls_locks (name, node, expires_at) VALUES ($1, $2, `+d.clock("$3")+`)
		ON CONFLICT (name) DO UPDATE SET node = excluded.node, expires_at = excluded.expires_at
		WHERE tls_locks.node = excluded.node OR tls_locks.expires_at < `+d.clock("0"), name, node, ttl.Milliseconds())
	if err != nil {
		return false, fmt.Errorf("take TLS lock %s: %w", name, err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// ReleaseTLSLock gives name's lock up, when node holds it.
func (tx *Tx) ReleaseTLSLock(ctx context.Context, name, node string) error {
	if _, err := tx.write(ctx, atOnce, "DELETE FROM tls_locks WHERE name = $1 AND node = $2", name, node); err != nil {
		return fmt.Errorf("release TLS lock %s: %w", name, err)
	}
	return nil
}
