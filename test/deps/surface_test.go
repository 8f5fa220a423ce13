package deps

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/importer"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// The modules whose packages a user imports (the browser client's Go package
// included), by import path pattern; the reference application, commands, process
// tests and examples are not API.
var publicPatterns = []string{
	"github.com/idemkit/idem/...",
}

// listed is the part of `go list -export -json` the surface check reads.
type listed struct {
	ImportPath string
	Name       string
	Export     string
	Standard   bool
}

// isInternal reports whether path is one of idem's internal packages.
func isInternal(path string) bool {
	return strings.HasPrefix(path, "github.com/idemkit/idem/") &&
		(strings.Contains(path, "/internal/") || strings.HasSuffix(path, "/internal"))
}

// isPublic reports whether p is a package a user may import.
func isPublic(p listed) bool {
	if p.Name == "main" || isInternal(p.ImportPath) {
		return false
	}
	rest := strings.TrimPrefix(p.ImportPath, "github.com/idemkit/idem")
	for _, not := range []string{"/app", "/cmd", "/test", "/examples"} {
		if rest == not || strings.HasPrefix(rest, not+"/") {
			return false
		}
	}
	return true
}

// No exported identifier of a public package (a function's signature, a method, a
// field, a type, a variable) mentions a type of idem's internal/ packages: a user
// could call it and hold the value, but neither name it nor rely on it.
func TestPublicAPIMentionsNoInternalType(t *testing.T) {
	_, here, _, _ := runtime.Caller(0)
	repo := filepath.Join(filepath.Dir(here), "..", "..")
	cmd := exec.CommandContext(t.Context(), "go", append([]string{"list", "-e", "-export", "-deps", "-json"}, publicPatterns...)...)
	cmd.Dir = repo
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	exports := map[string]string{}
	var roots []string
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p listed
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		exports[p.ImportPath] = p.Export
		if !p.Standard && strings.HasPrefix(p.ImportPath, "github.com/idemkit/idem") && isPublic(p) {
			roots = append(roots, p.ImportPath)
		}
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		f, ok := exports[path]
		if !ok || f == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(f)
	})
	if len(roots) < 5 {
		t.Fatalf("only %d public packages found (%v): the pattern is wrong", len(roots), roots)
	}
	for _, path := range roots {
		pkg, err := imp.Import(path)
		if err != nil {
			t.Fatalf("import %s: %v", path, err)
		}
		for _, where := range internalMentions(pkg) {
			t.Errorf("%s", where)
		}
	}
	t.Logf("checked %d public packages", len(roots))
}

// internalMentions lists the exported identifiers of pkg whose types mention an
// internal type, each as "pkg.Name: type".
func internalMentions(pkg *types.Package) []string {
	var found []string
	report := func(name string, t types.Type) {
		if n := mentionsInternal(t, map[types.Type]bool{}); n != "" {
			found = append(found, fmt.Sprintf("%s.%s mentions %s", pkg.Path(), name, n))
		}
	}
	scope := pkg.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		tn, ok := obj.(*types.TypeName)
		if !ok {
			report(name, obj.Type())
			continue
		}
		if tn.IsAlias() {
			report(name, obj.Type())
			continue
		}
		named, _ := obj.Type().(*types.Named)
		if named == nil {
			continue
		}
		// The type's shape: exported fields (embedded ones promote theirs) and
		// interface methods.
		switch u := named.Underlying().(type) {
		case *types.Struct:
			for i := range u.NumFields() {
				if f := u.Field(i); f.Exported() || f.Embedded() {
					report(name+"."+f.Name(), f.Type())
				}
			}
		case *types.Interface:
			for i := range u.NumMethods() {
				if m := u.Method(i); m.Exported() {
					report(name+"."+m.Name(), m.Type())
				}
			}
		default:
			report(name, u)
		}
		// Its methods, promoted ones included, on the value and the pointer.
		ms := types.NewMethodSet(types.NewPointer(named))
		for i := range ms.Len() {
			if m := ms.At(i).Obj(); m.Exported() {
				report(name+"."+m.Name(), m.Type())
			}
		}
	}
	return found
}

// mentionsInternal returns the first internal type t mentions, or "". A named type
// of another package is not entered: a public one is checked as its own package's.
func mentionsInternal(t types.Type, seen map[types.Type]bool) string {
	if seen[t] {
		return ""
	}
	seen[t] = true
	switch t := t.(type) {
	case *types.Alias:
		if o := t.Obj(); o.Pkg() != nil && isInternal(o.Pkg().Path()) {
			return o.Pkg().Path() + "." + o.Name()
		}
		return mentionsInternal(types.Unalias(t), seen)
	case *types.Named:
		if o := t.Obj(); o.Pkg() != nil && isInternal(o.Pkg().Path()) {
			return o.Pkg().Path() + "." + o.Name()
		}
		for i := range t.TypeArgs().Len() {
			if n := mentionsInternal(t.TypeArgs().At(i), seen); n != "" {
				return n
			}
		}
		return ""
	case *types.Pointer:
		return mentionsInternal(t.Elem(), seen)
	case *types.Slice:
		return mentionsInternal(t.Elem(), seen)
	case *types.Array:
		return mentionsInternal(t.Elem(), seen)
	case *types.Chan:
		return mentionsInternal(t.Elem(), seen)
	case *types.Map:
		if n := mentionsInternal(t.Key(), seen); n != "" {
			return n
		}
		return mentionsInternal(t.Elem(), seen)
	case *types.Signature:
		for _, tup := range []*types.Tuple{t.Params(), t.Results()} {
			for i := range tup.Len() {
				if n := mentionsInternal(tup.At(i).Type(), seen); n != "" {
					return n
				}
			}
		}
		return ""
	case *types.Struct:
		for i := range t.NumFields() {
			if f := t.Field(i); f.Exported() || f.Embedded() {
				if n := mentionsInternal(f.Type(), seen); n != "" {
					return n
				}
			}
		}
		return ""
	case *types.Interface:
		for i := range t.NumMethods() {
			if n := mentionsInternal(t.Method(i).Type(), seen); n != "" {
				return n
			}
		}
		for i := range t.NumEmbeddeds() {
			if n := mentionsInternal(t.EmbeddedType(i), seen); n != "" {
				return n
			}
		}
		return ""
	}
	return ""
}
