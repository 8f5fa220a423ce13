package refapp

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/clients/browser"
)

// PayPagePath is where the payment page is served (Config.PayPage): part of the
// public contract, like the API's routes.
const PayPagePath = "/pay"

// payPageCSP lets the page load only its own scripts and styles, and talk only to
// its own origin (POST /v1/payments, GET /pay/ledger): nothing inline, nothing
// from elsewhere.
const payPageCSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; " +
	"base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// maxLedgerRows bounds one answer of GET /pay/ledger.
const maxLedgerRows = 100

//go:embed paypage
var payPageFiles embed.FS

const (
	sqlLedgerByKey = `
SELECT id, idempotency_key, account, amount_cents, created_at FROM ledger_entries
WHERE idempotency_key = $1 ORDER BY id LIMIT $2`
	sqlLedgerByAccount = `
SELECT id, idempotency_key, account, amount_cents, created_at FROM ledger_entries
WHERE account = $1 ORDER BY id LIMIT $2`
)

// LedgerRow is one row of GET /pay/ledger.
type LedgerRow struct {
	ID          int64     `json:"id"`
	Key         string    `json:"key"`
	Account     string    `json:"account"`
	AmountCents int64     `json:"amount_cents"`
	CreatedAt   time.Time `json:"created_at"`
}

// newPayPage serves the payment page, a demonstration of the browser client
// (package browser): GET /pay, its script and style under /pay/assets/, the client's
// modules under /pay/idem/, and GET /pay/ledger?key=K[&scope=S] or ?account=A, the
// ledger_entries rows of one key or one account, read-only. Everything is embedded
// in the binary.
func newPayPage(pool *pgxpool.Pool, log *slog.Logger) http.Handler {
	assets, err := fs.Sub(payPageFiles, "paypage")
	if err != nil {
		panic("refapp: " + err.Error()) // the directory is embedded above
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+PayPagePath, func(w http.ResponseWriter, r *http.Request) {
		http.ServeFileFS(w, r, assets, "pay.html")
	})
	mux.Handle("GET "+PayPagePath+"/assets/", http.StripPrefix(PayPagePath+"/assets/", http.FileServerFS(assets)))
	mux.Handle("GET "+PayPagePath+"/idem/", http.StripPrefix(PayPagePath+"/idem/", http.FileServerFS(browser.FS())))
	mux.HandleFunc("GET "+PayPagePath+"/ledger", func(w http.ResponseWriter, r *http.Request) {
		ledger(w, r, pool, log)
	})
	return payPageHeaders(mux)
}

func mountPayPage(mux *http.ServeMux, h http.Handler) {
	mux.Handle(PayPagePath, h)
	mux.Handle(PayPagePath+"/", h)
}

// payPageHeaders refuses requests addressed to a host name other than localhost,
// and sets the page's security headers.
//
// A DNS-rebinding page reaches a listener on loopback under a name of its own
// choosing, and could read the ledger from there. It cannot choose an IP literal,
// nor localhost; so those are all the page answers to.
func payPageHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !literalHost(r.Host) {
			writeError(w, http.StatusMisdirectedRequest, "host_not_allowed", fmt.Sprintf(
				"the payment page answers only requests addressed to an IP address or localhost, not %q (a guard against DNS rebinding): open it as http://127.0.0.1:PORT%s",
				r.Host, PayPagePath))
			return
		}
		h := w.Header()
		h.Set("Content-Security-Policy", payPageCSP)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		h.Set("Cross-Origin-Resource-Policy", "same-origin")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

// literalHost reports whether a Host header names an IP address or localhost.
func literalHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	return strings.EqualFold(host, "localhost") || net.ParseIP(host) != nil
}

// ledger answers GET /pay/ledger: {"rows": [...]} for one key (scoped as the charge
// consumer stores it) or one account.
func ledger(w http.ResponseWriter, r *http.Request, pool *pgxpool.Pool, log *slog.Logger) {
	q := r.URL.Query()
	var sql, arg string
	switch key, account := q.Get("key"), q.Get("account"); {
	case key != "" && account == "":
		k, err := idem.ParseKey(key)
		if err == nil {
			err = idem.ValidateScope(q.Get("scope"))
		}
		if err != nil {
			writeError(w, http.StatusBadRequest, "invalid_request", err.Error())
			return
		}
		sql, arg = sqlLedgerByKey, idem.ScopedKey(q.Get("scope"), k)
	case account != "" && key == "":
		sql, arg = sqlLedgerByAccount, account
	default:
		writeError(w, http.StatusBadRequest, "invalid_request", "give one of key (with scope, if the intent had one) or account")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	rows, err := pool.Query(ctx, sql, arg, maxLedgerRows)
	if err != nil {
		ledgerFailed(w, log, err)
		return
	}
	out := struct {
		Rows []LedgerRow `json:"rows"`
	}{Rows: []LedgerRow{}}
	for rows.Next() {
		var row LedgerRow
		if err := rows.Scan(&row.ID, &row.Key, &row.Account, &row.AmountCents, &row.CreatedAt); err != nil {
			rows.Close()
			ledgerFailed(w, log, err)
			return
		}
		out.Rows = append(out.Rows, row)
	}
	if err := rows.Err(); err != nil {
		ledgerFailed(w, log, err)
		return
	}
	body, _ := json.Marshal(out)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(body, '\n'))
}

func ledgerFailed(w http.ResponseWriter, log *slog.Logger, err error) {
	log.Error("refapp: pay page: reading the ledger failed", "err", err)
	status := http.StatusInternalServerError
	if errors.Is(err, context.DeadlineExceeded) {
		status = http.StatusServiceUnavailable
	}
	writeError(w, status, "internal_error", "reading the ledger failed; try again")
}
