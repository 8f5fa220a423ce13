package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/internal/ops"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config configures the console. Ops is required; the rest is optional and each
// missing part hides what it would show.
type Config struct {
	// Ops reads idem's tables and, through its Effects hook, the application's
	// rows for a key (the key inspector).
	Ops *ops.Reader
	// DeadLetters lists and replays dead letters. Nil hides the dead-letter page.
	DeadLetters *deadletter.Queue
	// JetStream and Stream name the stream whose consumers' lag is shown. Nil
	// JetStream shows no stream.
	JetStream jetstream.JetStream
	Stream    string
	// Lag is the history of the stream's consumers the worker keeps
	// (worker.Worker.LagHistory): the overview plots each consumer's lag and rate
	// over its last minutes. Without it the console reads the stream each time an
	// open overview refreshes, and plots only what it saw since.
	Lag *ops.LagHistory
	// Metrics, when set, is read for the folds (duplicates the consumers' inboxes
	// absorbed and replays the ingress answered) counted since the process
	// started: the idem_* counters of worker.RegisterMetrics.
	Metrics prometheus.Gatherer
	// Logger records replays (default slog.Default()).
	Logger *slog.Logger
	// Prefix is the path the console is mounted at (default "/console").
	Prefix string

	// Token, when set, must be presented on every request: as "Authorization:
	// Bearer TOKEN", or by signing in on the console's login page, which sets an
	// HttpOnly cookie.
	Token string
	// BasicUser and BasicPassword, when BasicUser is set, require HTTP basic
	// authentication on every request. With both Token and BasicUser set, either
	// one admits. With neither, the console admits only requests addressed to
	// localhost, 127.0.0.1 or [::1] (the Host header), and a POST only with an
	// Origin of the same host: serve it on a loopback listener.
	BasicUser, BasicPassword string
}

// Handler is the console. It is safe for concurrent use.
type Handler struct {
	cfg    Config
	log    *slog.Logger
	secret []byte // per process: CSRF tokens and the auth cookie
	pages  map[string]*template.Template
	mux    *http.ServeMux

	own *ops.LagHistory // the stream's readings without Config.Lag
}

const (
	csrfCookie = "idem_console_csrf"
	authCookie = "idem_console_auth"
	csrfField  = "csrf"
)

// New returns the console handler. Mount it at Config.Prefix and Prefix+"/".
func New(cfg Config) (*Handler, error) {
	if cfg.Ops == nil {
		return nil, errors.New("console: Config.Ops is required")
	}
	if cfg.JetStream != nil && cfg.Stream == "" {
		return nil, errors.New("console: Config.Stream is required with JetStream")
	}
	if cfg.BasicUser == "" && cfg.BasicPassword != "" {
		return nil, errors.New("console: BasicPassword without BasicUser")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "/console"
	}
	cfg.Prefix = "/" + strings.Trim(cfg.Prefix, "/")
	h := &Handler{cfg: cfg, log: cfg.Logger, secret: make([]byte, 32), pages: map[string]*template.Template{}, own: ops.NewLagHistory(plotSpan)}
	if _, err := rand.Read(h.secret); err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	for _, page := range []string{"overview", "deadletters", "replay", "inspect", "streams", "login", "error", "live"} {
		files := []string{"templates/layout.html", "templates/" + page + ".html"}
		switch page {
		case "overview":
			files = append(files, "templates/live.html")
		case "live": // a part of the overview, without the layout
			files = files[1:]
		}
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, files...)
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", page, err)
		}
		h.pages[page] = t
	}
	static, err := fs.Sub(staticFS, "static")
	if err != nil {
		return nil, err
	}
	p := cfg.Prefix
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+p+"/{$}", h.overview)
	mux.HandleFunc("GET "+p, h.overview)
	mux.HandleFunc("GET "+p+"/live", h.live)
	mux.HandleFunc("GET "+p+"/dead-letters", h.deadLetters)
	mux.HandleFunc("POST "+p+"/dead-letters/replay", h.replay)
	mux.HandleFunc("GET "+p+"/inspect", h.inspect)
	mux.HandleFunc("GET "+p+"/streams", h.streams)
	mux.HandleFunc("GET "+p+"/login", h.loginPage)
	mux.HandleFunc("POST "+p+"/login", h.login)
	mux.Handle("GET "+p+"/static/", http.StripPrefix(p+"/static/", http.FileServerFS(static)))
	h.mux = mux
	return h, nil
}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Referrer-Policy", "same-origin")
	w.Header().Set("Cache-Control", "no-store")
	// Without credentials, whoever reaches the listener is admitted; on loopback
	// that is this machine's users, and any web page their browser shows that
	// rebinds its own name to 127.0.0.1. Such a page can choose Host and Origin
	// but not make them name this machine.
	if h.open() && !localHost(r.Host) {
		http.Error(w, fmt.Sprintf("console: this console has no credentials, so it answers only requests addressed to localhost, 127.0.0.1 or [::1], not %q: "+
			"open it under one of those names, or set a token (or basic auth) to serve it under another", r.Host), http.StatusForbidden)
		return
	}
	login := r.URL.Path == h.cfg.Prefix+"/login" || strings.HasPrefix(r.URL.Path, h.cfg.Prefix+"/static/")
	if !login && !h.authenticated(r) {
		if h.cfg.BasicUser != "" {
			w.Header().Set("WWW-Authenticate", `Basic realm="idem console", charset="UTF-8"`)
		}
		if h.cfg.Token != "" && r.Method == http.MethodGet && h.cfg.BasicUser == "" {
			http.Redirect(w, r, h.cfg.Prefix+"/login", http.StatusSeeOther)
			return
		}
		http.Error(w, "console: authentication required", http.StatusUnauthorized)
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		if h.open() && r.Header.Get("Origin") == "" {
			http.Error(w, "console: a state-changing request without an Origin header is refused by a console without credentials", http.StatusForbidden)
			return
		}
		if !h.sameOrigin(r) {
			http.Error(w, "console: cross-origin request refused", http.StatusForbidden)
			return
		}
		if !h.validCSRF(r) {
			http.Error(w, "console: missing or invalid CSRF token; reload the page and try again", http.StatusForbidden)
			return
		}
	}
	h.mux.ServeHTTP(w, r)
}

// open reports a console without credentials: every request is admitted.
func (h *Handler) open() bool { return h.cfg.Token == "" && h.cfg.BasicUser == "" }

// localHost reports whether a Host header names this machine's loopback
// interface: localhost, 127.0.0.1 or [::1], with any port (an SSH tunnel's local
// port differs from the listener's; a rebinding page cannot choose the name).
func localHost(host string) bool {
	name := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		name = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		name = host[1 : len(host)-1]
	}
	switch strings.ToLower(name) {
	case "localhost", "127.0.0.1", "::1":
		return true
	}
	return false
}

// authenticated reports whether r may use the console.
func (h *Handler) authenticated(r *http.Request) bool {
	if h.open() {
		return true
	}
	if h.cfg.Token != "" {
		if b, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && equal(b, h.cfg.Token) {
			return true
		}
		if c, err := r.Cookie(authCookie); err == nil && equal(c.Value, h.authValue()) {
			return true
		}
	}
	if h.cfg.BasicUser != "" {
		if u, p, ok := r.BasicAuth(); ok && equal(u, h.cfg.BasicUser) && equal(p, h.cfg.BasicPassword) {
			return true
		}
	}
	return false
}

func equal(a, b string) bool { return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 }

func (h *Handler) mac(parts ...string) string {
	m := hmac.New(sha256.New, h.secret)
	for _, p := range parts {
		m.Write([]byte(p))
		m.Write([]byte{0})
	}
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// authValue is the login cookie: it proves the token without holding it, and
// dies with the process.
func (h *Handler) authValue() string { return h.mac("auth", h.cfg.Token) }

// sameOrigin refuses a state-changing request whose Origin (or, without one,
// Referer) names another host. Browsers send Origin on every POST ("null" under
// a no-referrer policy, hence same-origin above).
func (h *Handler) sameOrigin(r *http.Request) bool {
	src := r.Header.Get("Origin")
	if src == "" {
		src = r.Header.Get("Referer")
	}
	if src == "" {
		return true // not a browser; the CSRF token still applies
	}
	u, err := url.Parse(src)
	return err == nil && u.Host == r.Host
}

// csrfToken returns the token for r's forms, setting the browser's CSRF cookie
// when it has none.
func (h *Handler) csrfToken(w http.ResponseWriter, r *http.Request) string {
	id := ""
	if c, err := r.Cookie(csrfCookie); err == nil && len(c.Value) >= 16 {
		id = c.Value
	} else {
		b := make([]byte, 18)
		_, _ = rand.Read(b)
		id = base64.RawURLEncoding.EncodeToString(b)
		http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: id, Path: h.cfg.Prefix, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	}
	return h.mac("csrf", id)
}

// validCSRF: the form's token is the HMAC of the browser's cookie under this
// process's secret (double submit, signed: a cookie planted by a sibling host
// does not help without the secret).
func (h *Handler) validCSRF(r *http.Request) bool {
	c, err := r.Cookie(csrfCookie)
	if err != nil || c.Value == "" {
		return false
	}
	tok := r.PostFormValue(csrfField)
	return tok != "" && hmac.Equal([]byte(tok), []byte(h.mac("csrf", c.Value)))
}

// page is what every template gets.
type page struct {
	Title  string
	Prefix string
	CSRF   string
	Nav    string
	Data   any
	Err    string
}

func (h *Handler) render(w http.ResponseWriter, r *http.Request, name, title string, status int, data any) {
	p := page{Title: title, Prefix: h.cfg.Prefix, CSRF: h.csrfToken(w, r), Nav: name, Data: data}
	var buf strings.Builder
	if err := h.pages[name].Execute(&buf, p); err != nil {
		h.log.Error("console: render", "page", name, "err", err)
		http.Error(w, "console: render failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(buf.String()))
}

func (h *Handler) fail(w http.ResponseWriter, r *http.Request, status int, err error) {
	h.render(w, r, "error", "Error", status, err.Error())
}

const readTimeout = 20 * time.Second

func (h *Handler) ctx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), readTimeout)
}

var funcs = template.FuncMap{
	"ts": func(t any) string {
		switch v := t.(type) {
		case time.Time:
			if v.IsZero() {
				return "—"
			}
			return v.UTC().Format("2006-01-02 15:04:05.000Z")
		case *time.Time:
			if v == nil {
				return "—"
			}
			return v.UTC().Format("2006-01-02 15:04:05.000Z")
		}
		return fmt.Sprint(t)
	},
	"dur": func(d time.Duration) string { return d.Round(time.Millisecond).String() },
	// span is a window of readings, to the second.
	"span": func(d time.Duration) string { return max(d.Round(time.Second), time.Second).String() },
	"secs": func(s float64) string {
		return (time.Duration(s * float64(time.Second))).Round(time.Millisecond).String()
	},
	"deref": func(v any) any {
		switch p := v.(type) {
		case *string:
			if p == nil {
				return "—"
			}
			return *p
		case *int64:
			if p == nil {
				return "—"
			}
			return *p
		case *int:
			if p == nil {
				return "—"
			}
			return *p
		}
		return v
	},
	// livePage is the page the overview's live part is rendered with, inside
	// the overview as on its own.
	"livePage": func(p page, live *liveData) page { p.Data = live; return p },
	"str":      func(b any) string { return fmt.Sprint(b) },
	"payload":  func(b []byte) string { return ops.Bytes(b).String() },
	"join":     strings.Join,
}
