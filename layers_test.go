package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
)

// roomOf is a file's room: its name before the first "_" or ".go".
func roomOf(file string) string {
	name := strings.TrimSuffix(filepath.Base(file), ".go")
	room, _, _ := strings.Cut(name, "_")
	return room
}

// readLayers reads a rules file: "room: rooms it may use", # comments.
func readLayers(path string) (map[string][]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	rules := map[string][]string{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line, _, _ := strings.Cut(sc.Text(), "#")
		if strings.TrimSpace(line) == "" {
			continue
		}
		room, uses, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("%s:%d: want \"room: rooms\"", path, n)
		}
		rules[strings.TrimSpace(room)] = strings.Fields(uses)
	}
	return rules, sc.Err()
}

// roomUse is one name a file uses from another file: of another room, or
// of its own.
type roomUse struct {
	file, declFile, name, from, to string
}

// roomUses type-checks the package's production files against the export
// data of its dependencies (go list -export) and returns every use of a
// name (package-level, method or field) declared in another file.
func roomUses(t *testing.T, dir string) []roomUse {
	t.Helper()
	builtBinary(t) // compiles what go list -export reads, once for every test
	cmd := exec.Command("go", "list", buildFlags, "-export", "-deps", "-json=ImportPath,Export", dir)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			err = fmt.Errorf("%w: %s", err, ee.Stderr)
		}
		t.Fatalf("go list -export: %v", err)
	}
	exports := map[string]string{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p struct{ ImportPath, Export string }
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		exports[p.ImportPath] = p.Export
	}
	fset := token.NewFileSet()
	paths, _ := filepath.Glob(filepath.Join(dir, "*.go"))
	var files []*ast.File
	for _, p := range paths {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	conf := types.Config{Importer: importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		if exports[path] == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(exports[path])
	})}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	pkg, err := conf.Check("main", fset, files, info)
	if err != nil {
		t.Fatalf("type-check: %v", err)
	}
	var uses []roomUse
	for id, obj := range info.Uses {
		if obj.Pkg() != pkg || !obj.Pos().IsValid() {
			continue // the standard library's, a dependency's, or a builtin
		}
		if v, ok := obj.(*types.Var); ok && !v.IsField() && obj.Parent() != pkg.Scope() {
			continue // a local variable or parameter
		}
		if _, ok := obj.(*types.PkgName); ok {
			continue
		}
		if obj.Parent() != nil && obj.Parent() != pkg.Scope() && obj.Parent() != types.Universe {
			if _, isFunc := obj.(*types.Func); !isFunc {
				continue // declared inside a function
			}
		}
		user, decl := fset.Position(id.Pos()).Filename, fset.Position(obj.Pos()).Filename
		if user != decl {
			uses = append(uses, roomUse{file: filepath.Base(user), declFile: filepath.Base(decl), name: obj.Name(),
				from: roomOf(user), to: roomOf(decl)})
		}
	}
	sort.Slice(uses, func(i, j int) bool {
		a, b := uses[i], uses[j]
		return a.file+" "+a.declFile+" "+a.name < b.file+" "+b.declFile+" "+b.name
	})
	return uses
}

// fileLoops lists the loops among files, of any length, one message
// each, naming one way round it: files build on each other one way, so
// that a change to one touches only those above it. (Across rooms the
// layers forbid loops already; within a room, and through several files,
// only this finds them.)
func fileLoops(uses []roomUse) []string {
	next := map[string][]string{}
	for _, u := range uses {
		if u.file != u.declFile && !slices.Contains(next[u.file], u.declFile) {
			next[u.file] = append(next[u.file], u.declFile)
		}
	}
	files := make([]string, 0, len(next))
	for f, to := range next {
		files = append(files, f)
		slices.Sort(to)
	}
	slices.Sort(files)
	// A loop through f, found by a walk from f that comes back to it;
	// each loop is told once, from its first file in name order.
	told := map[string]bool{}
	var out []string
	for _, start := range files {
		if told[start] {
			continue
		}
		path := []string{start}
		seen := map[string]bool{start: true}
		var walk func(f string) bool
		walk = func(f string) bool {
			for _, g := range next[f] {
				if g == start {
					return true
				}
				if seen[g] || g < start {
					continue
				}
				seen[g] = true
				path = append(path, g)
				if walk(g) {
					return true
				}
				path = path[:len(path)-1]
			}
			return false
		}
		if walk(start) {
			for _, f := range path {
				told[f] = true
			}
			out = append(out, "loop among files: "+strings.Join(append(path, start), " -> ")+": files use each other one way only")
		}
	}
	return out
}

// broken lists the uses rules forbid, one message each, naming the file,
// the name and the rule.
func broken(uses []roomUse, rules map[string][]string) []string {
	var out []string
	seen := map[string]bool{}
	for _, u := range uses {
		if u.from == u.to {
			continue
		}
		allowed, ok := rules[u.from]
		var msg string
		switch {
		case !ok:
			msg = fmt.Sprintf("%s uses %s of room %s, but room %s has no line in layers.rules: add it in its layer", u.file, u.name, u.to, u.from)
		case !slices.Contains(allowed, u.to):
			msg = fmt.Sprintf("%s uses %s of room %s; layers.rules says %s: %s", u.file, u.name, u.to, u.from, strings.Join(allowed, " "))
		default:
			continue
		}
		if !seen[msg] {
			seen[msg] = true
			out = append(out, msg)
		}
	}
	return out
}

// The rooms keep their layers: every use across rooms is one layers.rules
// allows, and no two rooms use each other.
func TestLayers(t *testing.T) {
	t.Parallel()
	rules, err := readLayers("layers.rules")
	if err != nil {
		t.Fatal(err)
	}
	for room, uses := range rules {
		for _, other := range uses {
			if slices.Contains(rules[other], room) {
				t.Errorf("layers.rules lets %s and %s use each other", room, other)
			}
		}
	}
	uses := roomUses(t, ".")
	if len(uses) == 0 {
		t.Fatal("no uses across rooms found: the walk saw nothing")
	}
	for _, msg := range broken(uses, rules) {
		t.Error(msg)
	}
	for _, msg := range fileLoops(uses) {
		t.Error(msg)
	}
}

// The check fails, naming file, name and rule, on a use the rules forbid.
func TestLayersCatchAViolation(t *testing.T) {
	t.Parallel()
	uses := []roomUse{{file: "queue_settle.go", name: "Event", from: "queue", to: "github"}}
	rules := map[string][]string{"queue": {"config", "metrics", "broker"}}
	got := broken(uses, rules)
	want := "queue_settle.go uses Event of room github; layers.rules says queue: config metrics broker"
	if len(got) != 1 || got[0] != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// The check fails on two files that use each other, and on a loop of
// three, naming the files round it; a chain that does not come back is no
// loop.
func TestLayersCatchFileLoops(t *testing.T) {
	t.Parallel()
	use := func(file, decl string) roomUse {
		return roomUse{file: file, declFile: decl, name: "x", from: roomOf(file), to: roomOf(decl)}
	}
	for _, c := range []struct {
		uses []roomUse
		want []string
	}{
		{[]roomUse{use("queue.go", "queue_conn.go"), use("queue_conn.go", "queue.go"), use("queue_publish.go", "queue_conn.go")},
			[]string{"loop among files: queue.go -> queue_conn.go -> queue.go: files use each other one way only"}},
		{[]roomUse{use("store.go", "store_postgres.go"), use("store_postgres.go", "store_schema.go"), use("store_schema.go", "store.go")},
			[]string{"loop among files: store.go -> store_postgres.go -> store_schema.go -> store.go: files use each other one way only"}},
		{[]roomUse{use("store.go", "store_postgres.go"), use("store_postgres.go", "store_schema.go"), use("store_schema.go", "store_engine.go")}, nil},
	} {
		if got := fileLoops(c.uses); !slices.Equal(got, c.want) {
			t.Errorf("got %q, want %q", got, c.want)
		}
	}
}

// maxFileLines is the most lines a file of the daemon (not a test) may
// have: past it, a file is split by concern, keeping its prefix.
const maxFileLines = 600

// No file of the daemon is over maxFileLines, and every error body goes
// through the one writer (writeError): no http.Error beside it, no
// {"error": ...} written by hand.
func TestFilesStaySmall(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	errorBody := regexp.MustCompile(`writeJSON\([^)]*"error"`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if n := bytes.Count(b, []byte("\n")); n > maxFileLines {
			t.Errorf("%s: %d lines, over %d: split it by concern, keeping its prefix", f, n, maxFileLines)
		}
		if bytes.Contains(b, []byte("http.Error(")) {
			t.Errorf("%s calls http.Error: every error body goes through writeError", f)
		}
		if f != "api_errors.go" && errorBody.Match(b) {
			t.Errorf("%s writes an error body of its own: every error body goes through writeError", f)
		}
	}
}
