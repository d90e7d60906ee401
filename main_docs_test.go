package main

import (
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// The README is a guide; the reference lives in docs/, and these tests
// hold each page of it to the code: a key, route, command, flag or file
// added without its line in the page fails here, by name.

func readDoc(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("docs", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// configKeys walks the Config's toml tags: every key a file may set, as
// its dotted path ("server.tls.acme_domains"; an array of tables by its
// name, "brokers.url").
func configKeys(t reflect.Type, prefix string) []string {
	var keys []string
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
		if name == "" || name == "-" || !f.IsExported() {
			continue
		}
		path := prefix + name
		ft := f.Type
		for ft.Kind() == reflect.Pointer || ft.Kind() == reflect.Slice {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && ft.PkgPath() == reflect.TypeFor[Config]().PkgPath() && ft.NumField() > 0 && ft.Field(0).Tag.Get("toml") != "" {
			keys = append(keys, configKeys(ft, path+".")...)
			continue
		}
		keys = append(keys, path)
	}
	return keys
}

// Every key of the config is a row of docs/configuration.md: its dotted
// path in backticks, or its name in the row of its section.
func TestDocsConfigurationKeys(t *testing.T) {
	t.Parallel()
	doc := readDoc(t, "configuration.md")
	var rows []string
	for line := range strings.SplitSeq(doc, "\n") {
		if strings.HasPrefix(line, "| `") {
			rows = append(rows, line)
		}
	}
	keys := configKeys(reflect.TypeFor[Config](), "")
	if len(keys) < 80 {
		t.Fatalf("found %d config keys, fewer than the config has: the walk is wrong", len(keys))
	}
	for _, key := range keys {
		if strings.Contains(doc, "`"+key+"`") {
			continue
		}
		section, name := key[:strings.LastIndex(key, ".")+1], key[strings.LastIndex(key, ".")+1:]
		named := regexp.MustCompile("[` .]" + regexp.QuoteMeta(name) + "`")
		found := false
		for _, row := range rows {
			first, _, _ := strings.Cut(strings.TrimPrefix(row, "| "), " |")
			if strings.Contains(first, strings.TrimSuffix(section, ".")) && named.MatchString(row) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("docs/configuration.md does not name the key %s", key)
		}
	}
}

// Every route the API serves is named in docs/endpoints.md, with its
// parameters written in capitals (":guid" as GUID).
func TestDocsEndpoints(t *testing.T) {
	t.Parallel()
	doc := readDoc(t, "endpoints.md")
	src, err := os.ReadFile("api_routes.go")
	if err != nil {
		t.Fatal(err)
	}
	routes := regexp.MustCompile(`"(/[a-z0-9/:_-]*)"`).FindAllStringSubmatch(string(src), -1)
	if len(routes) < 15 {
		t.Fatalf("found %d routes in api_routes.go: the pattern is wrong", len(routes))
	}
	param := regexp.MustCompile(`:([a-z]+)`)
	for _, r := range routes {
		path := param.ReplaceAllStringFunc(r[1], func(p string) string { return strings.ToUpper(p[1:]) })
		if path == "/" {
			continue
		}
		if !strings.Contains(doc, path) {
			t.Errorf("docs/endpoints.md does not name the route %s", path)
		}
	}
}

// Every command and each of its flags is in docs/commands.md.
func TestDocsCommands(t *testing.T) {
	t.Parallel()
	doc := readDoc(t, "commands.md")
	for _, c := range commands {
		if !strings.Contains(doc, "switchyard "+c.name+" ") {
			t.Errorf("docs/commands.md does not name the command %s", c.name)
		}
		if c.flags == nil {
			continue
		}
		fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
		c.flags(fs, &options{})
		fs.VisitAll(func(f *flag.Flag) {
			if !strings.Contains(doc, "-"+f.Name+" ") && !strings.Contains(doc, "-"+f.Name+"]") && !strings.Contains(doc, "-"+f.Name+"`") {
				t.Errorf("docs/commands.md does not name %s's flag -%s", c.name, f.Name)
			}
		})
	}
}

// Every file of the code is named in docs/layout.md, and every room of
// layers.rules in its table of layers.
func TestDocsLayout(t *testing.T) {
	t.Parallel()
	doc := readDoc(t, "layout.md")
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if !strings.HasSuffix(f, "_test.go") && !strings.Contains(doc, "`"+f+"`") {
			t.Errorf("docs/layout.md does not name %s", f)
		}
	}
	rules, err := os.ReadFile("layers.rules")
	if err != nil {
		t.Fatal(err)
	}
	for _, room := range regexp.MustCompile(`(?m)^([a-z]+):`).FindAllStringSubmatch(string(rules), -1) {
		if !strings.Contains(doc, "`"+room[1]+"`") {
			t.Errorf("docs/layout.md's layers do not name the room %s", room[1])
		}
	}
}

// The README stays a guide: short enough to read in order, with its
// table of contents, and every page of the reference linked from it.
func TestReadmeIsAGuide(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	if n := strings.Count(readme, "\n"); n > 600 {
		t.Errorf("README.md is %d lines, more than 600: move reference to docs/", n)
	}
	if !strings.Contains(readme, "\nContents\n") {
		t.Error("README.md has no table of contents")
	}
	pages, _ := filepath.Glob("docs/*.md")
	for _, p := range pages {
		if !strings.Contains(readme, "("+p+")") {
			t.Errorf("README.md does not link %s", p)
		}
	}
}
