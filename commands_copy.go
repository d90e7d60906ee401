// copy-db: the configured database into an empty one of the other kind.

package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"
)

// copyDB copies every table of the configured database into target, an
// empty database of the other kind (a postgres:// URL, or an SQLite file
// path), migrated to the same schema version first, in one transaction on
// the target; it prints each table's rows, with progress on a terminal. A
// target that holds rows is refused, and nothing is changed.
func copyDB(ctx context.Context, cfg *Config, target string, stdout io.Writer) error {
	tcfg := DefaultConfig().Database
	if strings.HasPrefix(target, "postgres://") || strings.HasPrefix(target, "postgresql://") {
		if err := checkDatabaseURL(target); err != nil {
			return fmt.Errorf("copy-db -to: %w", err)
		}
		tcfg.Driver, tcfg.URL = "postgres", target
	} else {
		tcfg.Path = target
	}
	if tcfg.Driver == cfg.Database.Driver {
		return usagef("copy-db -to: the configured database is %s already; the target must be the other kind "+
			"(a postgres:// URL from SQLite, an SQLite file path from PostgreSQL)", cfg.Database.Driver)
	}
	src, err := openExisting(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := OpenStore(ctx, tcfg, nil)
	if err != nil {
		return fmt.Errorf("copy-db: target: %w", err)
	}
	defer dst.Close()
	if err := dst.CheckEmpty(ctx); err != nil {
		return fmt.Errorf("copy-db: %s: %w", dst.Name(), err)
	}
	if _, _, err := dst.Migrate(ctx); err != nil {
		return fmt.Errorf("copy-db: target: %w", err)
	}
	start := time.Now()
	progress := func(string, int64) {}
	if terminal(stdout) {
		last := time.Now()
		progress = func(table string, n int64) {
			if time.Since(last) > 200*time.Millisecond {
				last = time.Now()
				fmt.Fprintf(stdout, "\r%s: %d rows...\033[K", table, n)
			}
		}
	}
	copied, err := src.CopyTo(ctx, dst, progress)
	if terminal(stdout) {
		fmt.Fprint(stdout, "\r\033[K")
	}
	if err != nil {
		return fmt.Errorf("copy-db: nothing copied: %w", err)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	var total int64
	for _, c := range copied {
		fmt.Fprintf(tw, "%s\t%d\n", c.Table, c.Rows)
		total += c.Rows
	}
	tw.Flush()
	fmt.Fprintf(stdout, "copied %d rows of %s into %s in %s (leases and nodes are the running nodes' own: not copied)\n",
		total, src.Name(), dst.Name(), time.Since(start).Round(time.Millisecond))
	return nil
}

// terminal reports whether w is a terminal, where progress may be drawn.
func terminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
