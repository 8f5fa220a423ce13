// Package buildinfo says which build of idem is running, from what the Go
// toolchain recorded in the binary: the module version (a tag, or "(devel)" for a
// build from a checkout), the VCS revision and the Go version. The binaries'
// --version and the idem_build_info metric print it.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Info is one build's identity.
type Info struct {
	// Version is the idem module's version: a tag when idem was built as a
	// dependency at that tag, "(devel)" when built from a checkout.
	Version string `json:"version"`
	// Revision is the VCS commit the binary was built from ("" when unknown), with
	// "-dirty" when the tree had uncommitted changes.
	Revision string `json:"revision"`
	// GoVersion is the toolchain's.
	GoVersion string `json:"go_version"`
}

// modulePath is idem's module; in a user's binary it is a dependency.
const modulePath = "github.com/idemkit/idem"

// Read returns the running binary's Info.
func Read() Info {
	info := Info{Version: "(unknown)", GoVersion: runtime.Version()}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return info
	}
	if bi.Main.Path == modulePath {
		info.Version = bi.Main.Version
	} else {
		for _, d := range bi.Deps {
			if d.Path == modulePath {
				info.Version = d.Version
			}
		}
	}
	var dirty bool
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			info.Revision = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if dirty && info.Revision != "" {
		info.Revision += "-dirty"
	}
	return info
}

// String is the one-line form --version prints.
func (i Info) String() string {
	rev := i.Revision
	if rev == "" {
		rev = "unknown revision"
	}
	return fmt.Sprintf("idem %s (%s, %s)", i.Version, rev, i.GoVersion)
}
