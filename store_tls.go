package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/certmagic"
)

// The certificates' rows: what serving HTTPS by ACME keeps (the ACME
// account, each certificate, its key and metadata, as files by key), and
// certmagic's storage over them. tls_locks, where an older version kept
// the locks that made ordering one node's at a time, is read no more: the
// acme lease does that now (a migration drops the table once no floor
// needs it).

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

// CertStorage is certmagic's storage in the store: the ACME account, the
// certificates and their keys as tls_files, so that of the nodes sharing a
// database every one serves the certificate and the one holding the acme
// lease orders and renews it (daemon_tls.go). Its locks are this process's
// only: ordering is that one node's, under its lease.
func (s *Store) CertStorage() certmagic.Storage {
	return &certStorage{store: s, held: map[string]chan struct{}{}}
}

type certStorage struct {
	store *Store
	mu    sync.Mutex
	held  map[string]chan struct{} // the names locked: closed at Unlock
}

func (c *certStorage) Store(ctx context.Context, key string, value []byte) error {
	return c.store.WriteTx(ctx, func(tx *Tx) error { return tx.StoreTLSFile(ctx, key, value, time.Now()) })
}

func (c *certStorage) Load(ctx context.Context, key string) ([]byte, error) {
	f, err := c.store.LoadTLSFile(ctx, key)
	if errors.Is(err, ErrNoTLSFile) {
		return nil, fmt.Errorf("%w: %w", fs.ErrNotExist, err)
	}
	return f.Value, err
}

func (c *certStorage) Delete(ctx context.Context, key string) error {
	return c.store.WriteTx(ctx, func(tx *Tx) error { return tx.DeleteTLSFiles(ctx, key) })
}

func (c *certStorage) Exists(ctx context.Context, key string) bool {
	_, err := c.Stat(ctx, key)
	return err == nil
}

func (c *certStorage) List(ctx context.Context, path string, recursive bool) ([]string, error) {
	keys, err := c.store.TLSKeys(ctx, path, recursive)
	if err == nil && len(keys) == 0 {
		return nil, fmt.Errorf("%w: nothing under %s", fs.ErrNotExist, path)
	}
	return keys, err
}

func (c *certStorage) Stat(ctx context.Context, key string) (certmagic.KeyInfo, error) {
	f, err := c.store.LoadTLSFile(ctx, key)
	if err == nil {
		return certmagic.KeyInfo{Key: key, Modified: f.Modified, Size: int64(len(f.Value)), IsTerminal: true}, nil
	}
	if !errors.Is(err, ErrNoTLSFile) {
		return certmagic.KeyInfo{}, err
	}
	if keys, err := c.store.TLSKeys(ctx, key, false); err != nil || len(keys) > 0 {
		return certmagic.KeyInfo{Key: key}, err
	}
	return certmagic.KeyInfo{}, fmt.Errorf("%w: %s", fs.ErrNotExist, key)
}

// Lock takes name's lock in this process, waiting while another goroutine
// holds it, until ctx ends.
func (c *certStorage) Lock(ctx context.Context, name string) error {
	for {
		c.mu.Lock()
		other, busy := c.held[name]
		if !busy {
			c.held[name] = make(chan struct{})
		}
		c.mu.Unlock()
		if !busy {
			return nil
		}
		select {
		case <-other:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (c *certStorage) Unlock(_ context.Context, name string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if done, ok := c.held[name]; ok {
		close(done)
		delete(c.held, name)
	}
	return nil
}
