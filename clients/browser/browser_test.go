package browser_test

import (
	"io/fs"
	"os"
	"regexp"
	"slices"
	"testing"

	"github.com/idemkit/idem/clients/browser"
)

// importFrom matches the module a static import or re-export names.
var importFrom = regexp.MustCompile(`(?m)^(?:import|export)\b[^;]*?\bfrom "(\./[^"]+)";`)

// FS holds every module of src/, and every module the entry imports, directly
// or through another, resolves inside it: a page served FS loads the client
// whole.
func TestFS(t *testing.T) {
	t.Parallel()
	src, err := os.ReadDir("src")
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, e := range src {
		want = append(want, e.Name())
	}
	got, err := fs.Glob(browser.FS(), "*")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("FS holds %q, src/ %q", got, want)
	}

	seen := map[string]bool{}
	var visit func(name, from string)
	visit = func(name, from string) {
		if seen[name] {
			return
		}
		seen[name] = true
		text, err := fs.ReadFile(browser.FS(), name)
		if err != nil {
			t.Errorf("%s imports ./%s, which FS does not hold: %v", from, name, err)
			return
		}
		for _, m := range importFrom.FindAllStringSubmatch(string(text), -1) {
			visit(m[1][len("./"):], name)
		}
	}
	visit("idem.js", "the page")
	if len(seen) < 2 {
		t.Errorf("idem.js imports nothing (%v): the import pattern no longer matches the sources", seen)
	}
}
