// Package compose_test checks docker-compose.yml without Docker: against the
// compose-spec JSON schema, and through compose-go's loader (the library `docker
// compose` itself loads files with), which adds the consistency checks the schema
// cannot express — a depends_on naming a service that exists, a config or a named
// volume that is declared. It then reads the loaded project for what the stack
// promises: pinned images, ports on 127.0.0.1, healthchecks, Prometheus scraping
// the worker's metrics port, and Grafana mounting the provisioning and the
// dashboard where the provisioning looks.
//
// It is a module of its own, so that compose-go's dependencies stay out of idem's
// go.mod: run it with `cd test/deploy/compose && go test ./...`.
package compose_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/schema"
	"github.com/compose-spec/compose-go/v2/types"
	"gopkg.in/yaml.v3"
)

// root is the repository's top directory.
var root = func() string {
	r, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		panic(err)
	}
	return r
}()

var composeFile = filepath.Join(root, "docker-compose.yml")

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// validate checks a compose file's content against the compose-spec schema.
func validate(content []byte) error {
	var m map[string]any
	if err := yaml.Unmarshal(content, &m); err != nil {
		return err
	}
	return schema.Validate(m)
}

// load loads a compose file's content as `docker compose` would, with an empty
// environment, relative paths resolved against the repository's top directory.
func load(content []byte) (*types.Project, error) {
	return loader.LoadWithContext(context.Background(), types.ConfigDetails{
		WorkingDir:  root,
		ConfigFiles: []types.ConfigFile{{Filename: composeFile, Content: content}},
		Environment: types.Mapping{},
	}, func(o *loader.Options) { o.SetProjectName("idem", true) })
}

// The compose file validates against the schema and loads; a copy with a
// misspelt key, or with a dependency on a service that does not exist, does not
// (so the checks can fail).
func TestComposeFileIsValid(t *testing.T) {
	good := readFile(t, composeFile)
	misspelt := strings.Replace(string(good), "    healthcheck:\n", "    healthchek:\n", 1)
	dangling := strings.Replace(string(good), "      nats: {condition: service_healthy}\n", "      natz: {condition: service_healthy}\n", 1)
	undeclaredVolume := strings.Replace(string(good), "  promdata:\n", "", 1)
	if misspelt == string(good) || dangling == string(good) || undeclaredVolume == string(good) {
		t.Fatal("the compose file changed shape: update this test's broken copies")
	}
	for _, tc := range []struct {
		name    string
		content string
		schema  bool // the schema accepts it
		loads   bool // and the loader does
	}{
		{"docker-compose.yml", string(good), true, true},
		{"a misspelt key", misspelt, false, false},
		{"a dependency on no service", dangling, true, false},
		{"an undeclared volume", undeclaredVolume, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := validate([]byte(tc.content))
			if (err == nil) != tc.schema {
				t.Errorf("schema: %v, want valid=%v", err, tc.schema)
			}
			_, err = load([]byte(tc.content))
			if (err == nil) != tc.loads {
				t.Errorf("load: %v, want loaded=%v", err, tc.loads)
			}
		})
	}
}

func project(t *testing.T) *types.Project {
	t.Helper()
	p, err := load(readFile(t, composeFile))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func service(t *testing.T, p *types.Project, name string) types.ServiceConfig {
	t.Helper()
	s, err := p.GetService(name)
	if err != nil {
		t.Fatalf("%s: %v", composeFile, err)
	}
	return s
}

// The stack's services, each image pinned to a release (NATS to the server the
// tests embed), every published port on 127.0.0.1, a healthcheck wherever the
// image can run one, and the worker's image built with its Dockerfile.
func TestComposeServices(t *testing.T) {
	p := project(t)
	want := []string{"grafana", "jaeger", "mailsink", "nats", "postgres", "prometheus", "worker"}
	if got := p.ServiceNames(); !slices.Equal(sortedCopy(got), want) {
		t.Errorf("services %q, want %q", sortedCopy(got), want)
	}

	gomod := string(readFile(t, filepath.Join(root, "internal", "testkit", "natsserver", "go.mod")))
	natsVersion := regexp.MustCompile(`github\.com/nats-io/nats-server/v2 v(\S+)`).FindStringSubmatch(gomod)
	if natsVersion == nil {
		t.Fatal("internal/testkit/natsserver/go.mod: no nats-server")
	}
	release := regexp.MustCompile(`^v?\d+\.\d+(\.\d+)?([-.][\w.-]+)?$`)
	for _, s := range p.Services {
		switch {
		case s.Build != nil:
			if s.Name != "worker" {
				t.Errorf("%s: built, not pulled; only the worker is", s.Name)
			}
			if _, err := os.Stat(filepath.Join(s.Build.Context, "Dockerfile")); err != nil {
				t.Errorf("%s: build context %s: %v", s.Name, s.Build.Context, err)
			}
		case s.Image == "":
			t.Errorf("%s: no image", s.Name)
		default:
			i := strings.LastIndex(s.Image, ":")
			if i < 0 || strings.Contains(s.Image[i:], "/") || !release.MatchString(s.Image[i+1:]) {
				t.Errorf("%s: image %s is not pinned to a release", s.Name, s.Image)
			}
		}
		for _, port := range s.Ports {
			if port.HostIP != "127.0.0.1" {
				t.Errorf("%s: port %s:%d is published on %q, not 127.0.0.1", s.Name, port.Published, port.Target, port.HostIP)
			}
		}
		// Jaeger alone has none: nothing waits on it (the worker's exporter retries),
		// and its minimal image is not known to carry a client to check it with.
		if s.Name != "jaeger" && (s.HealthCheck == nil || len(s.HealthCheck.Test) == 0 || s.HealthCheck.Disable) {
			t.Errorf("%s: no healthcheck", s.Name)
		}
	}
	if img, want := service(t, p, "nats").Image, "nats:"+natsVersion[1]+"-alpine"; img != want {
		t.Errorf("nats: image %s, want %s (the nats-server of go.mod, which the tests embed)", img, want)
	}
	if img := service(t, p, "postgres").Image; !strings.HasPrefix(img, "postgres:15.") {
		t.Errorf("postgres: image %s, want a 15.x release", img)
	}
	// The worker's relay reads the log: the server must log for logical decoding.
	if cmd := service(t, p, "postgres").Command; !slices.Contains(cmd, "wal_level=logical") {
		t.Errorf("postgres: command %q does not set wal_level=logical, which the worker's log relay needs", cmd)
	}

	// Host ports are distinct: Prometheus's UI must not take the worker's 9090.
	published := map[string]string{}
	for _, s := range p.Services {
		for _, port := range s.Ports {
			if other, ok := published[port.Published]; ok {
				t.Errorf("host port %s is published by both %s and %s", port.Published, other, s.Name)
			}
			published[port.Published] = s.Name
		}
	}
}

func env(t *testing.T, s types.ServiceConfig, key string) string {
	t.Helper()
	v, ok := s.Environment[key]
	if !ok || v == nil {
		t.Fatalf("%s: no %s in its environment", s.Name, key)
	}
	return *v
}

// The worker exports spans to Jaeger and serves /metrics where Prometheus scrapes.
func TestWorkerTelemetryWiring(t *testing.T) {
	p := project(t)
	w := service(t, p, "worker")
	for k, want := range map[string]string{
		"IDEM_TRACE":                  "otlp",
		"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318",
		"OTEL_SERVICE_NAME":           "idem-worker",
	} {
		if got := env(t, w, k); got != want {
			t.Errorf("worker: %s=%q, want %q", k, got, want)
		}
	}
	if _, ok := w.DependsOn["jaeger"]; !ok {
		t.Error("worker: does not depend on jaeger")
	}

	addr := env(t, w, "IDEM_METRICS_ADDR")
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("worker: IDEM_METRICS_ADDR %q: %v", addr, err)
	}
	var prom struct {
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			MetricsPath   string `yaml:"metrics_path"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	promSvc := service(t, p, "prometheus")
	promFile := hostPath(t, promSvc, "/etc/prometheus/prometheus.yml")
	if err := yaml.Unmarshal(readFile(t, promFile), &prom); err != nil {
		t.Fatalf("%s: %v", promFile, err)
	}
	var targets []string
	for _, sc := range prom.ScrapeConfigs {
		if sc.MetricsPath != "" && sc.MetricsPath != "/metrics" {
			continue
		}
		for _, st := range sc.StaticConfigs {
			targets = append(targets, st.Targets...)
		}
	}
	if want := net.JoinHostPort("worker", port); !slices.Contains(targets, want) {
		t.Errorf("%s scrapes %q on /metrics; the worker's metrics listener (IDEM_METRICS_ADDR %s) is %s", promFile, targets, addr, want)
	}
	if !slices.Contains(promSvc.Command, "--config.file=/etc/prometheus/prometheus.yml") {
		t.Errorf("prometheus: command %q does not read the mounted /etc/prometheus/prometheus.yml", promSvc.Command)
	}
}

// hostPath is the file or directory of the repository that service s bind-mounts
// at target (or at a directory above it).
func hostPath(t *testing.T, s types.ServiceConfig, target string) string {
	t.Helper()
	for _, v := range s.Volumes {
		if v.Type != types.VolumeTypeBind {
			continue
		}
		if rel, err := filepath.Rel(v.Target, target); err == nil && !strings.HasPrefix(rel, "..") {
			src := filepath.Join(v.Source, rel)
			if _, err := os.Stat(src); err != nil {
				t.Fatalf("%s: mounts %s at %s: %v", s.Name, v.Source, v.Target, err)
			}
			if r, err := filepath.Rel(root, src); err != nil || strings.HasPrefix(r, "..") {
				t.Fatalf("%s: %s is outside the repository", s.Name, src)
			}
			return src
		}
	}
	t.Fatalf("%s: nothing mounted at %s", s.Name, target)
	return ""
}

// Grafana reads the repository's provisioning, whose dashboard provider looks
// where the dashboard's directory is mounted, and whose datasource is the
// prometheus service.
func TestGrafanaProvisioning(t *testing.T) {
	p := project(t)
	g := service(t, p, "grafana")
	prov := hostPath(t, g, "/etc/grafana/provisioning")

	var providers struct {
		Providers []struct {
			Type    string `yaml:"type"`
			Options struct {
				Path string `yaml:"path"`
			} `yaml:"options"`
		} `yaml:"providers"`
	}
	pf := filepath.Join(prov, "dashboards", "idem.yml")
	if err := yaml.Unmarshal(readFile(t, pf), &providers); err != nil {
		t.Fatalf("%s: %v", pf, err)
	}
	if len(providers.Providers) != 1 || providers.Providers[0].Type != "file" {
		t.Fatalf("%s: want one file provider, got %+v", pf, providers.Providers)
	}
	dash := filepath.Join(hostPath(t, g, providers.Providers[0].Options.Path), "idem.json")
	if want := filepath.Join(root, "deploy", "grafana", "dashboards", "idem.json"); dash != want {
		t.Errorf("grafana loads %s, want %s", dash, want)
	}
	if _, err := os.Stat(dash); err != nil {
		t.Error(err)
	}
	home := env(t, g, "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
	if hostPath(t, g, home) != dash {
		t.Errorf("grafana: home dashboard %s is not %s", home, dash)
	}

	var ds struct {
		Datasources []struct {
			Type string `yaml:"type"`
			URL  string `yaml:"url"`
		} `yaml:"datasources"`
	}
	df := filepath.Join(prov, "datasources", "prometheus.yml")
	if err := yaml.Unmarshal(readFile(t, df), &ds); err != nil {
		t.Fatalf("%s: %v", df, err)
	}
	if len(ds.Datasources) != 1 || ds.Datasources[0].Type != "prometheus" {
		t.Fatalf("%s: want one prometheus datasource, got %+v", df, ds.Datasources)
	}
	promPort := "9090" // Prometheus's own listen port, inside its container
	if want := "http://" + net.JoinHostPort("prometheus", promPort); ds.Datasources[0].URL != want {
		t.Errorf("%s: url %s, want %s", df, ds.Datasources[0].URL, want)
	}
	if _, ok := g.DependsOn["prometheus"]; !ok {
		t.Error("grafana: does not depend on prometheus")
	}
}

func sortedCopy(s []string) []string {
	c := slices.Clone(s)
	slices.Sort(c)
	return c
}

// The cluster profile: three NATS nodes routed to all three, and a worker given
// every node, on an R3 stream, in a database of its own (two workers draining one
// outbox would publish to two brokers).
func TestClusterProfile(t *testing.T) {
	p, err := loader.LoadWithContext(context.Background(), types.ConfigDetails{
		WorkingDir:  root,
		ConfigFiles: []types.ConfigFile{{Filename: composeFile, Content: readFile(t, composeFile)}},
		Environment: types.Mapping{},
	}, func(o *loader.Options) { o.SetProjectName("idem", true); o.Profiles = []string{"cluster"} })
	if err != nil {
		t.Fatal(err)
	}
	routes := "nats://nats-1:6222,nats://nats-2:6222,nats://nats-3:6222"
	for _, name := range []string{"nats-1", "nats-2", "nats-3"} {
		s := service(t, p, name)
		cmd := strings.Join(s.Command, " ")
		if !strings.Contains(cmd, "-js") || !strings.Contains(cmd, "--routes "+routes) || !strings.Contains(cmd, "-n "+name) || !strings.Contains(cmd, "--cluster_name idem") {
			t.Errorf("%s command %q: want JetStream, its own name, the cluster name and routes to all three", name, cmd)
		}
		if s.Image != "nats:2.15.2-alpine" {
			t.Errorf("%s image %q", name, s.Image)
		}
	}
	w := service(t, p, "worker-cluster")
	if got := env(t, w, "NATS_URL"); got != "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222" {
		t.Errorf("worker-cluster NATS_URL = %q, want every node", got)
	}
	if got := env(t, w, "IDEM_STREAM_REPLICAS"); got != "3" {
		t.Errorf("worker-cluster IDEM_STREAM_REPLICAS = %q, want 3", got)
	}
	if got := env(t, w, "DATABASE_URL"); !strings.Contains(got, "/idem_cluster?") {
		t.Errorf("worker-cluster DATABASE_URL = %q, want the idem_cluster database", got)
	}
	sql, err := os.ReadFile(root + "/deploy/postgres/cluster.sql")
	if err != nil || !strings.Contains(string(sql), "CREATE DATABASE idem_cluster") {
		t.Errorf("deploy/postgres/cluster.sql does not create idem_cluster (%v)", err)
	}
}
