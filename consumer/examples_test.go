package consumer_test

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// The package's examples are code a user copies: they import public packages
// only. The examples that need a database and a broker live in package idemtest,
// whose Start gives them both.
func TestExamplesImportOnlyPublicPackages(t *testing.T) {
	files, err := filepath.Glob("example*_test.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("no example files (%v)", err)
	}
	for _, f := range files {
		parsed, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range parsed.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if strings.Contains(path, "/internal/") {
				t.Errorf("%s imports %s, which a user cannot import", f, path)
			}
		}
	}
}
