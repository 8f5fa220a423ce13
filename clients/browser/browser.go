// Package browser holds idem's browser client, the ES modules of the npm package
// in this directory, so that a Go server can serve them from its own binary, on
// its own origin, with nothing fetched from elsewhere at run time. The reference
// application's payment page (refapp) serves them this way.
//
// The client is documented in its sources (src/idem.js is the entry) and in the
// README.md of this directory.
package browser

import (
	"embed"
	"io/fs"
)

//go:embed src/*.js
var files embed.FS

// FS holds the client's ES modules at its root: idem.js, the entry, and the
// modules it imports by relative URL. Serve them together, under one path.
func FS() fs.FS {
	sub, err := fs.Sub(files, "src")
	if err != nil {
		panic("browser: " + err.Error()) // "src" is a valid path; fs.Sub cannot fail on it
	}
	return sub
}
