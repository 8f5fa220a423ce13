// Package deploy_test checks the files of the compose stack (docker-compose.yml and
// deploy/) against the code they describe: every metric the Grafana dashboard
// queries must be one a real reference worker exports, Prometheus must scrape the
// port the worker's metrics listener is given, and Grafana's provisioning must
// load the dashboard file and query the datasource it provisions.
//
// The compose file's own validity (the compose-spec schema) is checked by the
// nested module in ./compose, which keeps its dependencies out of the main go.mod.
package deploy_test

import (
	"bufio"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/refapptest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The files under test, relative to this directory.
var (
	composeFile    = filepath.Join("..", "..", "docker-compose.yml")
	prometheusFile = filepath.Join("..", "..", "deploy", "prometheus", "prometheus.yml")
	dashboardFile  = filepath.Join("..", "..", "deploy", "grafana", "dashboards", "idem.json")
	datasourceFile = filepath.Join("..", "..", "deploy", "grafana", "provisioning", "datasources", "prometheus.yml")
	providerFile   = filepath.Join("..", "..", "deploy", "grafana", "provisioning", "dashboards", "idem.yml")
)

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// dashboard is the part of a Grafana dashboard this test reads.
type dashboard struct {
	UID    string  `json:"uid"`
	Title  string  `json:"title"`
	Panels []panel `json:"panels"`
}

type panel struct {
	Title      string      `json:"title"`
	Type       string      `json:"type"`
	Datasource *datasource `json:"datasource"`
	Targets    []struct {
		Expr       string      `json:"expr"`
		Datasource *datasource `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's
}

type datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

func parseDashboard(t *testing.T, b []byte) dashboard {
	t.Helper()
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// eachPanel calls f for every panel, those of collapsed rows included.
func (d dashboard) eachPanel(f func(panel)) {
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			f(p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
}

// metricRef is one metric name a dashboard's query refers to.
type metricRef struct {
	Name  string // as written: idem_x_seconds_bucket
	Panel string
	Expr  string
}

// references lists every metric name in every panel target's expr.
func (d dashboard) references() []metricRef {
	var refs []metricRef
	d.eachPanel(func(p panel) {
		for _, tg := range p.Targets {
			for _, n := range metricNames(tg.Expr) {
				refs = append(refs, metricRef{Name: n, Panel: p.Title, Expr: tg.Expr})
			}
		}
	})
	return refs
}

var (
	// Quoted strings: label values, and regexps in label matchers.
	reString = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'` + "|`[^`]*`")
	// Label matchers, range and subquery selectors.
	reBraces   = regexp.MustCompile(`\{[^{}]*\}`)
	reBrackets = regexp.MustCompile(`\[[^\[\]]*\]`)
	// Label lists of aggregations and vector matching: by (consumer, le).
	reLabelList = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)`)
	// A token: a Grafana variable, a duration (offset 1h30m), a number (1e3, 0x1f,
	// 0.99), or an identifier
	// with what follows it (an identifier followed by "(" is a function call).
	reToken = regexp.MustCompile(`\$\{?\w+\}?|\b(?:(?:\d+(?:ms|[smhdwy]))+|0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)|([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?`)
)

// promqlWords are PromQL keywords that look like identifiers.
var promqlWords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"bool": true, "and": true, "or": true, "unless": true, "offset": true, "atan2": true,
	"inf": true, "nan": true,
}

// metricNames returns the metric names a PromQL expression selects, in order,
// once each: what is left of it once strings, label matchers, range selectors,
// label lists, function calls, keywords, numbers and Grafana variables are set
// aside.
func metricNames(expr string) []string {
	s := reString.ReplaceAllString(expr, `""`)
	for prev := ""; prev != s; {
		prev = s
		s = reBraces.ReplaceAllString(s, " ")
		s = reBrackets.ReplaceAllString(s, " ")
	}
	s = reLabelList.ReplaceAllString(s, " ")
	var names []string
	for _, m := range reToken.FindAllStringSubmatch(s, -1) {
		name, call := m[1], m[2]
		if name == "" || call != "" || promqlWords[strings.ToLower(name)] {
			continue
		}
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	return names
}

// exposition is what a /metrics page declares: each family with its type, and the
// name of every sample.
type exposition struct {
	families map[string]string // name → counter, gauge, histogram, ...
	samples  map[string]bool
}

func parseExposition(t *testing.T, body string) exposition {
	t.Helper()
	e := exposition{families: map[string]string{}, samples: map[string]bool{}}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "":
		case strings.HasPrefix(line, "# TYPE "):
			if f := strings.Fields(line); len(f) == 4 {
				e.families[f[2]] = f[3]
			}
		case strings.HasPrefix(line, "#"):
		default:
			name := line
			if i := strings.IndexAny(line, "{ "); i >= 0 {
				name = line[:i]
			}
			e.samples[name] = true
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return e
}

// family is the family a sample name belongs to: idem_x_seconds_bucket is a sample
// of the histogram idem_x_seconds (a counter's name keeps its _total, as
// Prometheus's text format writes it).
func (e exposition) family(name string) string {
	for suffix, types := range map[string][]string{
		"_bucket": {"histogram"},
		"_sum":    {"histogram", "summary"},
		"_count":  {"histogram", "summary"},
	} {
		if f, ok := strings.CutSuffix(name, suffix); ok && slices.Contains(types, e.families[f]) {
			return f
		}
	}
	return name
}

// missing returns, sorted and once each, the referenced metrics the exposition
// does not have, each with the panel that wants it.
func (e exposition) missing(refs []metricRef) []string {
	seen := map[string]bool{}
	var out []string
	for _, r := range refs {
		f := e.family(r.Name)
		if _, ok := e.families[f]; ok && e.samples[r.Name] {
			continue
		}
		msg := r.Name + " (panel " + `"` + r.Panel + `": ` + r.Expr + ")"
		if f != r.Name {
			msg = r.Name + " (family " + f + ", panel " + `"` + r.Panel + `": ` + r.Expr + ")"
		}
		if !seen[msg] {
			seen[msg] = true
			out = append(out, msg)
		}
	}
	sort.Strings(out)
	return out
}

func TestMetricNames(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want []string
	}{
		{`idem_outbox_pending_rows`, []string{"idem_outbox_pending_rows"}},
		{`sum(rate(idem_ingress_requests_total{outcome="new"}[$__rate_interval]))`, []string{"idem_ingress_requests_total"}},
		{`histogram_quantile(0.99, sum by (consumer, le) (rate(idem_end_to_end_latency_seconds_bucket{consumer=~"charges|emails"}[5m])))`,
			[]string{"idem_end_to_end_latency_seconds_bucket"}},
		{`sum without (instance) (rate(a_total[1m] offset 5m)) / on (job) group_left (x) b_count > bool 1e3`, []string{"a_total", "b_count"}},
		{`max by (consumer) (idem_dead_letters) or vector(0)`, []string{"idem_dead_letters"}},
		{`rate(x_sum[${__interval}]) / rate(x_count[$interval]) unless absent(up{job="by (x)"})`, []string{"x_sum", "x_count", "up"}},
		{`max_over_time(idem_outbox_pending_rows[10m:1m]) + idem_outbox_pending_rows`, []string{"idem_outbox_pending_rows"}},
	} {
		if got := metricNames(tc.expr); !slices.Equal(got, tc.want) {
			t.Errorf("metricNames(%s) = %q, want %q", tc.expr, got, tc.want)
		}
	}
}

// worker starts the reference application on a real Postgres and an embedded
// JetStream, with /metrics on a listener of its own as in docker-compose.yml,
// sends one payment through it and waits until it has been processed, so that
// every series (the end-to-end histogram's among them) has a sample. It returns
// the /metrics page.
func workerMetrics(t *testing.T) string {
	t.Helper()
	env := testenv.New(t)
	svc := refapptest.Start(t, env.DB.Pool, env.NC, refapp.Config{HTTPAddr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0"})

	req, _ := http.NewRequest(http.MethodPost, "http://"+svc.Addr()+"/v1/payments", strings.NewReader(`{"account":"acct_deploy","amount_cents":100}`))
	req.Header.Set(idem.HeaderKey, "deploy-test-1")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		t.Fatalf("POST /v1/payments: %d", resp.StatusCode)
	}

	get := func() string {
		t.Helper()
		resp, err := http.Get("http://" + svc.MetricsAddr() + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /metrics: %d, %v", resp.StatusCode, err)
		}
		return string(b)
	}
	var body string
	testenv.Eventually(t, 45*time.Second, "the payment processed, as /metrics says", func() bool {
		body = get()
		return regexp.MustCompile(`(?m)^idem_consumer_messages_total\{consumer="charges",outcome="processed"\} [1-9]`).MatchString(body)
	})
	return body
}

// Every metric the dashboard queries is one the worker exports. The table's second
// case is the test's own check: a dashboard with a metric the worker does not have
// must fail, naming it.
func TestDashboardMetricsAreExported(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	exported := parseExposition(t, workerMetrics(t))

	// A copy of the dashboard with two metrics the worker does not export: a
	// misspelt counter, and a histogram's bucket of a family that is a gauge.
	var bogus map[string]any
	if err := json.Unmarshal(raw, &bogus); err != nil {
		t.Fatal(err)
	}
	bogus["panels"] = append(bogus["panels"].([]any), map[string]any{
		"title": "bogus", "type": "timeseries",
		"targets": []any{
			map[string]any{"expr": `sum(rate(idem_consumer_mesages_total{outcome="processed"}[5m]))`},
			map[string]any{"expr": `histogram_quantile(0.9, rate(idem_outbox_pending_rows_bucket[5m]))`},
		},
	})
	bogusRaw, err := json.Marshal(bogus)
	if err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name        string
		dashboard   []byte
		wantMissing []string // the names the failure must give; none: it must pass
	}{
		{"the dashboard", raw, nil},
		{"with bogus metrics", bogusRaw, []string{"idem_consumer_mesages_total", "idem_outbox_pending_rows_bucket"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := parseDashboard(t, tc.dashboard)
			refs := d.references()
			if len(refs) == 0 {
				t.Fatal("the dashboard queries no metric")
			}
			missing := exported.missing(refs)
			if tc.wantMissing == nil {
				if len(missing) > 0 {
					t.Errorf("%s queries %d metric(s) the worker does not export:\n  %s", dashboardFile, len(missing), strings.Join(missing, "\n  "))
				}
				return
			}
			if len(missing) != len(tc.wantMissing) {
				t.Errorf("missing = %q, want exactly %q", missing, tc.wantMissing)
			}
			for _, w := range tc.wantMissing {
				if !slices.ContainsFunc(missing, func(m string) bool { return strings.HasPrefix(m, w+" ") }) {
					t.Errorf("the failure does not name %s: %q", w, missing)
				}
			}
		})
	}
}

// The dashboard covers what the operations issue asks of it: each of these
// metrics is queried by some panel.
func TestDashboardCoversTheWorker(t *testing.T) {
	t.Parallel()
	d := parseDashboard(t, []byte(read(t, dashboardFile)))
	queried := map[string]bool{}
	for _, r := range d.references() {
		queried[r.Name] = true
	}
	for _, want := range []string{
		"idem_ingress_requests_total", "idem_consumer_messages_total",
		"idem_end_to_end_latency_seconds_bucket", "idem_ingress_request_duration_seconds_bucket",
		"idem_outbox_pending_rows", "idem_outbox_oldest_unpublished_age_seconds",
		"idem_outbox_unproven_rows", "idem_outbox_oldest_unproven_age_seconds",
		"idem_consumer_pending_messages", "idem_consumer_ack_pending_messages",
		"idem_dead_letters", "idem_relay_messages_total", "idem_scrape_errors_total",
	} {
		if !queried[want] {
			t.Errorf("no panel of %s queries %s", dashboardFile, want)
		}
	}
	for _, outcome := range []string{"new", "processed", "duplicate", "dead_lettered"} {
		if !strings.Contains(read(t, dashboardFile), `outcome=\"`+outcome+`\"`) {
			t.Errorf(`no panel of %s selects outcome="%s"`, dashboardFile, outcome)
		}
	}
}

// yamlValue finds `key: value` in a YAML file (the first one, at any depth) and
// returns the value unquoted. The main module has no YAML parser (./compose
// parses these files for real); the files here are flat enough for a line match.
func yamlValue(t *testing.T, path, text, key string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^\s*(?:-\s+)?` + regexp.QuoteMeta(key) + `:\s*(.+?)\s*(?:#.*)?$`).FindStringSubmatch(text)
	if m == nil {
		t.Fatalf("%s: no %s", path, key)
	}
	return strings.Trim(m[1], `"'`)
}

// Prometheus scrapes the worker at the port its metrics listener is given.
func TestPrometheusScrapesTheWorkerMetricsPort(t *testing.T) {
	t.Parallel()
	compose := read(t, composeFile)
	addr := yamlValue(t, composeFile, compose, "IDEM_METRICS_ADDR")
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s: IDEM_METRICS_ADDR %q: %v", composeFile, addr, err)
	}
	if !strings.Contains(compose, "\n  worker:\n") {
		t.Fatalf("%s: no worker service", composeFile)
	}

	prom := read(t, prometheusFile)
	m := regexp.MustCompile(`(?m)^\s*-?\s*targets:\s*\[([^\]]*)\]`).FindStringSubmatch(prom)
	if m == nil {
		t.Fatalf("%s: no static targets", prometheusFile)
	}
	var targets []string
	for _, s := range strings.Split(m[1], ",") {
		targets = append(targets, strings.Trim(strings.TrimSpace(s), `"'`))
	}
	if want := net.JoinHostPort("worker", port); !slices.Contains(targets, want) {
		t.Errorf("%s scrapes %q; the worker's metrics listener (IDEM_METRICS_ADDR %s in %s) is %s", prometheusFile, targets, addr, composeFile, want)
	}
	if p := yamlValue(t, prometheusFile, prom, "metrics_path"); p != "/metrics" {
		t.Errorf("%s: metrics_path %q, want /metrics", prometheusFile, p)
	}
}

// Grafana's dashboard provider reads the directory docker-compose.yml mounts the
// dashboard's directory at, and the dashboard queries the datasource Grafana is
// given.
func TestGrafanaProvisioningLoadsTheDashboard(t *testing.T) {
	t.Parallel()
	compose := read(t, composeFile)
	provider := read(t, providerFile)
	path := strings.TrimSuffix(yamlValue(t, providerFile, provider, "path"), "/")

	// The grafana service mounts ./deploy/grafana/dashboards there, and the
	// provisioning directory at /etc/grafana/provisioning.
	mounts := map[string]string{} // container path → host path
	for _, m := range regexp.MustCompile(`(?m)^\s*-\s*"?(\./deploy/grafana/[^:\s"]*):([^:\s"]+)(?::ro)?"?\s*$`).FindAllStringSubmatch(compose, -1) {
		mounts[strings.TrimSuffix(m[2], "/")] = strings.TrimSuffix(m[1], "/")
	}
	if host := mounts[path]; host != "./deploy/grafana/dashboards" {
		t.Errorf("%s loads dashboards from %s, where %s mounts %q, not ./deploy/grafana/dashboards (mounts: %v)", providerFile, path, composeFile, host, mounts)
	}
	if host := mounts["/etc/grafana/provisioning"]; host != "./deploy/grafana/provisioning" {
		t.Errorf("%s mounts %q at /etc/grafana/provisioning, want ./deploy/grafana/provisioning", composeFile, host)
	}
	home := yamlValue(t, composeFile, compose, "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
	if want := path + "/" + filepath.Base(dashboardFile); home != want {
		t.Errorf("%s: the home dashboard is %s, want %s", composeFile, home, want)
	}

	// The dashboard's every query goes to the provisioned datasource.
	ds := read(t, datasourceFile)
	uid, typ := yamlValue(t, datasourceFile, ds, "uid"), yamlValue(t, datasourceFile, ds, "type")
	if typ != "prometheus" {
		t.Errorf("%s: datasource type %q, want prometheus", datasourceFile, typ)
	}
	if u := yamlValue(t, datasourceFile, ds, "url"); u != "http://prometheus:9090" {
		t.Errorf("%s: datasource url %q, want http://prometheus:9090 (the prometheus service)", datasourceFile, u)
	}
	d := parseDashboard(t, []byte(read(t, dashboardFile)))
	if d.UID == "" || d.Title == "" {
		t.Errorf("%s: uid %q, title %q: a provisioned dashboard needs both", dashboardFile, d.UID, d.Title)
	}
	check := func(where string, got *datasource) {
		if got == nil || got.UID != uid || got.Type != typ {
			t.Errorf("%s: %s: datasource %+v, want {Type:%s UID:%s} (%s)", dashboardFile, where, got, typ, uid, datasourceFile)
		}
	}
	d.eachPanel(func(p panel) {
		if p.Type == "row" {
			return
		}
		check("panel "+p.Title, p.Datasource)
		for i, tg := range p.Targets {
			check("panel "+p.Title+" target "+string(rune('A'+i)), tg.Datasource)
		}
	})
}

// Every image of docker-compose.yml is pinned to a release, NATS to the server the
// tests embed, and every published port is bound to 127.0.0.1.
func TestComposeImagesPinnedPortsLocal(t *testing.T) {
	t.Parallel()
	compose := read(t, composeFile)
	images := regexp.MustCompile(`(?m)^\s*image:\s*"?([^\s"#]+)`).FindAllStringSubmatch(compose, -1)
	if len(images) < 6 {
		t.Errorf("%s: %d images, want postgres, nats, mailpit, jaeger, prometheus and grafana", composeFile, len(images))
	}
	for _, m := range images {
		ref := m[1]
		i := strings.LastIndex(ref, ":")
		if i < 0 || strings.Contains(ref[i:], "/") {
			t.Errorf("%s: image %s has no tag", composeFile, ref)
			continue
		}
		tag := ref[i+1:]
		if tag == "latest" || !regexp.MustCompile(`\d+\.\d+`).MatchString(tag) {
			t.Errorf("%s: image %s is not pinned to a release (want major.minor at least)", composeFile, ref)
		}
	}
	// The NATS server in the tests is the one the test kit pins (and the
	// reference binary embeds).
	gomod := read(t, filepath.Join("..", "..", "internal", "testkit", "natsserver", "go.mod"))
	v := regexp.MustCompile(`github\.com/nats-io/nats-server/v2 v(\S+)`).FindStringSubmatch(gomod)
	if v == nil {
		t.Fatal("internal/testkit/natsserver/go.mod: no nats-server")
	}
	if want := "image: nats:" + v[1] + "-alpine"; !strings.Contains(compose, want) {
		t.Errorf("%s: want %q, the nats-server the tests embed", composeFile, want)
	}

	for _, m := range regexp.MustCompile(`(?m)^\s*ports:\s*\[([^\]]*)\]`).FindAllStringSubmatch(compose, -1) {
		for _, p := range strings.Split(m[1], ",") {
			p = strings.Trim(strings.TrimSpace(p), `"'`)
			if !strings.HasPrefix(p, "127.0.0.1:") {
				t.Errorf("%s: port %s is not bound to 127.0.0.1", composeFile, p)
			}
		}
	}
	if regexp.MustCompile(`(?m)^\s*ports:\s*$`).MatchString(compose) {
		t.Errorf("%s: write ports as a flow list, [\"127.0.0.1:H:C\"], which this test reads", composeFile)
	}
}
