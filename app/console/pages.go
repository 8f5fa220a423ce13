package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/deadletter"
	"github.com/idemkit/idem/internal/ops"
)

// --- overview -------------------------------------------------------------------

// The overview's live part is read again every liveEvery by the console's script;
// rates and Behind are over lagWindow, the plot spans plotSpan.
const (
	liveEvery = 5 * time.Second
	lagWindow = time.Minute
	plotSpan  = 15 * time.Minute
)

type overviewData struct {
	Live *liveData
	// Stats are the exact counts, read when the page is loaded.
	Stats *ops.Stats
}

// liveData is the part of the overview that refreshes by itself: cheap reads only
// (ops.Summary, the consumers' history, the metrics' counters).
type liveData struct {
	Summary *ops.Summary
	// Trends are the stream's consumers over the last minutes (nil: no reading).
	Trends    *ops.Trends
	TrendsErr string
	// Plots show each consumer's lag and rate over plotSpan.
	Plots         []plot
	OpenDead      []namedCount
	OpenDeadTotal int64
	// Folds are counters since the process started (nil: no Config.Metrics).
	Folds *folds
	// FoldMap is Folds.Consumer by consumer.
	FoldMap map[string]int64
	// Every is how often the page reads this part again, in milliseconds.
	Every int64
}

type namedCount struct {
	Name string
	N    int64
}

type folds struct {
	Consumer []namedCount // idem_consumer_messages_total{outcome="duplicate"}
	Total    int64
	Replayed int64 // idem_ingress_requests_total{outcome="replayed"}
}

func (h *Handler) overview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := h.ctx(r)
	defer cancel()
	live, err := h.readLive(ctx)
	if err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	st, err := h.cfg.Ops.Stats(ctx)
	if err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	h.render(w, r, "overview", "Overview", http.StatusOK, overviewData{Live: live, Stats: st})
}

// live is the overview's live part alone, for the page's script.
func (h *Handler) live(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := h.ctx(r)
	defer cancel()
	live, err := h.readLive(ctx)
	if err != nil {
		http.Error(w, "console: "+err.Error(), http.StatusInternalServerError)
		return
	}
	var buf strings.Builder
	if err := h.pages["live"].ExecuteTemplate(&buf, "live", page{Prefix: h.cfg.Prefix, Data: live}); err != nil {
		h.log.Error("console: render", "page", "live", "err", err)
		http.Error(w, "console: render failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = w.Write([]byte(buf.String()))
}

func (h *Handler) readLive(ctx context.Context) (*liveData, error) {
	sum, err := h.cfg.Ops.Summary(ctx)
	if err != nil {
		return nil, err
	}
	d := &liveData{Summary: sum, OpenDead: sortedCounts(sum.OpenDeadLetters), FoldMap: map[string]int64{}, Every: liveEvery.Milliseconds()}
	for _, c := range d.OpenDead {
		d.OpenDeadTotal += c.N
	}
	d.Trends, d.TrendsErr = h.trends(ctx)
	if d.Trends != nil {
		d.Plots = plots(d.Trends)
	}
	if d.Folds = h.folds(); d.Folds != nil {
		for _, c := range d.Folds.Consumer {
			d.FoldMap[c.Name] = c.N
		}
	}
	return d, nil
}

// trends are the stream's consumers over time: the worker's history
// (Config.Lag), or else the console's own, read at each refresh of an open page.
func (h *Handler) trends(ctx context.Context) (*ops.Trends, string) {
	hist := h.cfg.Lag
	if hist == nil {
		if h.cfg.JetStream == nil {
			return nil, "no JetStream configured"
		}
		js, err := ops.ReadJetStream(ctx, h.cfg.JetStream, h.cfg.Stream)
		if err != nil {
			return nil, err.Error()
		}
		h.own.Add(js)
		hist = h.own
	}
	tr := hist.Trends(lagWindow)
	if tr == nil {
		return nil, "the stream's consumers have not been read yet"
	}
	return tr, ""
}

func (h *Handler) readJetStream(ctx context.Context) (*ops.JetStreamStats, string) {
	if h.cfg.JetStream == nil {
		return nil, "no JetStream configured"
	}
	js, err := ops.ReadJetStream(ctx, h.cfg.JetStream, h.cfg.Stream)
	if err != nil {
		return nil, err.Error()
	}
	return js, ""
}

func (h *Handler) folds() *folds {
	if h.cfg.Metrics == nil {
		return nil
	}
	mfs, err := h.cfg.Metrics.Gather()
	if err != nil {
		h.log.Warn("console: gather metrics", "err", err)
	}
	f := &folds{}
	per := map[string]int64{}
	for _, mf := range mfs {
		switch mf.GetName() {
		case "idem_consumer_messages_total":
			for _, m := range mf.GetMetric() {
				if label(m, "outcome") == "duplicate" {
					per[label(m, "consumer")] += int64(m.GetCounter().GetValue())
				}
			}
		case "idem_ingress_requests_total":
			for _, m := range mf.GetMetric() {
				if label(m, "outcome") == "replayed" {
					f.Replayed += int64(m.GetCounter().GetValue())
				}
			}
		}
	}
	f.Consumer = sortedCounts(per)
	for _, c := range f.Consumer {
		f.Total += c.N
	}
	return f
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func sortedCounts(m map[string]int64) []namedCount {
	out := make([]namedCount, 0, len(m))
	for k, v := range m {
		out = append(out, namedCount{k, v})
	}
	slices.SortFunc(out, func(a, b namedCount) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// --- dead letters -----------------------------------------------------------------

type filterForm struct {
	Consumer, Reason, Since, Until string
	Replayed                       bool
	Limit                          int
}

type deadLettersData struct {
	Form    filterForm
	Letters []deadletter.Letter
	Limit   int
}

const listLimit = 200

// filter reads a dead-letter filter from r's query or form.
func readFilter(get func(string) string) (filterForm, deadletter.Filter, error) {
	ff := filterForm{Consumer: strings.TrimSpace(get("consumer")), Reason: get("reason"),
		Since: strings.TrimSpace(get("since")), Until: strings.TrimSpace(get("until")), Replayed: get("replayed") != ""}
	f := deadletter.Filter{Consumer: ff.Consumer, ReasonPrefix: ff.Reason, IncludeReplayed: ff.Replayed}
	var err error
	if f.Since, err = parseTime(ff.Since); err != nil {
		return ff, f, fmt.Errorf("since: %w", err)
	}
	if f.Until, err = parseTime(ff.Until); err != nil {
		return ff, f, fmt.Errorf("until: %w", err)
	}
	return ff, f, nil
}

// parseTime reads an RFC 3339 time, a datetime-local value (UTC), or a duration
// ago ("1h").
func parseTime(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(s); err == nil {
		return time.Now().Add(-d), nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02T15:04", "2006-01-02 15:04:05", "2006-01-02"} {
		if t, err := time.ParseInLocation(layout, s, time.UTC); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("want an RFC 3339 time, YYYY-MM-DDTHH:MM (UTC) or a duration ago such as 1h; got %q", s)
}

func (h *Handler) deadLetters(w http.ResponseWriter, r *http.Request) {
	if h.cfg.DeadLetters == nil {
		h.fail(w, r, http.StatusNotFound, errors.New("dead letters are not configured in this console"))
		return
	}
	ff, f, err := readFilter(r.URL.Query().Get)
	if err != nil {
		h.fail(w, r, http.StatusBadRequest, err)
		return
	}
	f.Limit = listLimit
	ctx, cancel := h.ctx(r)
	defer cancel()
	list, err := h.cfg.DeadLetters.Find(ctx, f)
	if err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	h.render(w, r, "deadletters", "Dead letters", http.StatusOK, deadLettersData{Form: ff, Letters: list, Limit: listLimit})
}

type replayData struct {
	DryRun bool
	Force  bool
	// All: the dry run selects by the filter, and its confirmation the IDs the dry
	// run listed, whatever the filter would select by then.
	All     bool
	Form    filterForm
	IDs     []int64
	Results []deadletter.ReplayResult
	Counts  map[string]int
	Err     string
}

// replay is POST only: a dry run (the default, also the confirmation page) or,
// with confirm=yes, the replay. A confirmation replays exactly the dead letters
// its dry run listed: a filter evaluated again would take in dead letters filed
// since (and a relative "since" would have moved).
func (h *Handler) replay(w http.ResponseWriter, r *http.Request) {
	if h.cfg.DeadLetters == nil {
		h.fail(w, r, http.StatusNotFound, errors.New("dead letters are not configured in this console"))
		return
	}
	if err := r.ParseForm(); err != nil {
		h.fail(w, r, http.StatusBadRequest, err)
		return
	}
	ff, f, err := readFilter(r.PostForm.Get)
	if err != nil {
		h.fail(w, r, http.StatusBadRequest, err)
		return
	}
	d := replayData{DryRun: r.PostForm.Get("confirm") != "yes", Force: r.PostForm.Get("force") != "", All: r.PostForm.Get("all") != "", Form: ff}
	if !d.All || !d.DryRun {
		for _, v := range r.PostForm["id"] {
			id, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				h.fail(w, r, http.StatusBadRequest, fmt.Errorf("dead letter id %q: %w", v, err))
				return
			}
			d.IDs = append(d.IDs, id)
		}
		if len(d.IDs) == 0 {
			h.fail(w, r, http.StatusBadRequest, errors.New("no dead letter selected"))
			return
		}
	}
	if d.All && !d.DryRun {
		// The dry run's list, as it was judged: replayed ones stay out unless the
		// filter took them in.
		f = deadletter.Filter{IDs: d.IDs, IncludeReplayed: ff.Replayed}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Minute)
	defer cancel()
	opts := deadletter.ReplayOptions{DryRun: d.DryRun, Force: d.Force}
	var rep deadletter.ReplayReport
	if d.All {
		rep, err = h.cfg.DeadLetters.Replay(ctx, f, opts)
	} else {
		// The operator picked these: each one, replayed before or not.
		for _, id := range d.IDs {
			res, rerr := h.cfg.DeadLetters.ReplayID(ctx, id, opts)
			if rerr != nil && !errors.Is(rerr, deadletter.ErrReplayRefused) {
				err = rerr
				break
			}
			rep.Results = append(rep.Results, res)
		}
	}
	d.Results = rep.Results
	if err != nil {
		d.Err = err.Error()
	}
	d.Counts = map[string]int{}
	for _, res := range rep.Results {
		d.Counts[res.Action]++
	}
	if !d.DryRun {
		h.log.Info("console: dead letters replayed", "replayed", d.Counts[deadletter.ActionReplayed],
			"refused", d.Counts[deadletter.ActionRefused], "force", d.Force, "ids", d.IDs, "all", d.All, "err", err)
	}
	status := http.StatusOK
	if err != nil {
		status = http.StatusInternalServerError
	}
	h.render(w, r, "replay", "Replay", status, d)
}

// --- key inspector ----------------------------------------------------------------

type inspectData struct {
	Key, Scope string
	Report     *ops.KeyReport
	Err        string
}

func (h *Handler) inspect(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	d := inspectData{Key: strings.TrimSpace(q.Get("key")), Scope: strings.TrimSpace(q.Get("scope"))}
	if d.Key == "" {
		h.render(w, r, "inspect", "Key inspector", http.StatusOK, d)
		return
	}
	// A scoped key pasted from a log is split back into scope and key, as
	// `worker inspect` does.
	scope, key, err := idem.ParseScopedKey(d.Key)
	if err == nil && scope != "" {
		if d.Scope != "" && d.Scope != scope {
			err = fmt.Errorf("the key is scoped to %q but the scope field says %q", scope, d.Scope)
		}
		d.Scope = scope
	}
	if err != nil {
		d.Err = err.Error()
		h.render(w, r, "inspect", "Key inspector", http.StatusBadRequest, d)
		return
	}
	ctx, cancel := h.ctx(r)
	defer cancel()
	rep, err := h.cfg.Ops.Inspect(ctx, d.Scope, key)
	if err != nil {
		d.Err = err.Error()
		h.render(w, r, "inspect", "Key inspector", http.StatusBadRequest, d)
		return
	}
	d.Report = rep
	h.render(w, r, "inspect", "Key inspector", http.StatusOK, d)
}

// --- consumers and streams --------------------------------------------------------

type streamsData struct {
	Err       string
	Stream    *jetstream.StreamInfo
	Lag       *ops.JetStreamStats
	Consumers []*jetstream.ConsumerInfo
	// Registered are the consumers of idem_consumers (their key lifetimes).
	Stats *ops.Stats
}

func (h *Handler) streams(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := h.ctx(r)
	defer cancel()
	d := streamsData{}
	var err error
	if d.Stats, err = h.cfg.Ops.Stats(ctx); err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	d.Lag, d.Err = h.readJetStream(ctx)
	if h.cfg.JetStream != nil && d.Err == "" {
		// The configuration is the broker's, read from its API; the lag above is
		// ops' reading of the same.
		st, err := h.cfg.JetStream.Stream(ctx, h.cfg.Stream)
		if err == nil {
			d.Stream, err = st.Info(ctx)
		}
		if err == nil {
			list := st.ListConsumers(ctx)
			for ci := range list.Info() {
				d.Consumers = append(d.Consumers, ci)
			}
			err = list.Err()
		}
		if err != nil {
			d.Err = err.Error()
		}
		slices.SortFunc(d.Consumers, func(a, b *jetstream.ConsumerInfo) int { return strings.Compare(a.Name, b.Name) })
	}
	h.render(w, r, "streams", "Consumers and streams", http.StatusOK, d)
}

// --- login --------------------------------------------------------------------------

func (h *Handler) loginPage(w http.ResponseWriter, r *http.Request) {
	h.render(w, r, "login", "Sign in", http.StatusOK, nil)
}

func (h *Handler) login(w http.ResponseWriter, r *http.Request) {
	if h.cfg.Token == "" || !equal(r.PostFormValue("token"), h.cfg.Token) {
		h.render(w, r, "login", "Sign in", http.StatusUnauthorized, "wrong token")
		return
	}
	http.SetCookie(w, &http.Cookie{Name: authCookie, Value: h.authValue(), Path: h.cfg.Prefix, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, h.cfg.Prefix, http.StatusSeeOther)
}
