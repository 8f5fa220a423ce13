package install

// Defaults the external tests check a stream's zero fields against.
const (
	DefaultStreamMaxAge    = defaultStreamMaxAge
	DefaultDuplicateWindow = defaultDuplicateWindow
)
