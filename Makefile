# The README's two commands are `go run ./cmd/worker` (also `make run`) and `make test`.

GO ?= go
# Packages whose tests run long multi-process scenarios get their own timeout.
TEST_FLAGS ?= -race -count=1 -timeout 20m

.PHONY: run test test-poll test-partitioned test-browser-client vet fuzz bench bench-go partbench chaos-soak chaos-cluster rss

## run: the worker with an embedded JetStream server (Postgres from DATABASE_URL)
run:
	$(GO) run ./cmd/worker

# Every module of the workspace (go.work), derived from it: the library (.) and the
# modules that keep their dependencies out of its graph. `./...` alone stops at a
# module's edge. A module without packages (the test kit's nats-server, a tool
# pin) is left out: vet refuses a pattern that matches nothing.
MODULES ?= $(shell $(GO) list -m -f '{{.Dir}}' | while read d; do \
	[ -n "$$($(GO) list "$$d/..." 2>/dev/null)" ] && echo "$$d/..."; done | sed 's|^$(CURDIR)|.|')

## test: vet, the browser client's build and tests, the whole suite under the race detector, and short fuzz runs
test: vet test-browser-client
	$(GO) test $(TEST_FLAGS) $(MODULES)
	$(MAKE) test-partitioned
	$(MAKE) fuzz FUZZ_JOURNAL=50000x FUZZ_KEY=300000x

# The packages whose SQL touches idem_inbox or idem_outbox, again on day-partitioned
# tables (package partition): every test database is converted after migrating.
# The same pass runs them on the polling relay (IDEM_TEST_RELAY=poll: test
# databases owned by a role that may not replicate), so both relays are tested
# where the outbox is read; the first pass runs everything on the log relay.
PARTITIONED_PKGS ?= ./dedupe/ ./outbox/ ./internal/relay/ ./internal/reconcile/ ./consumer/ ./worker/ ./idemtest/ ./internal/ops/
test-partitioned:
	IDEM_TEST_PARTITIONED=1 IDEM_TEST_RELAY=poll $(GO) test -count=1 -timeout 10m $(PARTITIONED_PKGS)

## test-poll: the whole suite, chaos included, on the polling relay (about as long as `make test`)
test-poll:
	IDEM_TEST_RELAY=poll $(GO) test $(TEST_FLAGS) $(MODULES)

vet:
	$(GO) vet $(MODULES)

## test-browser-client: the browser client's npm ci, type-check and Node tests
# clients/browser, installed from its lockfile: its sources type-checked, types/
# checked against them, its pure logic tested under Node. Its journal and retry loop
# run in Chromium in test/browserclient, part of the Go suite.
NPM ?= npm
test-browser-client:
	cd clients/browser && $(NPM) ci --no-audit --no-fund && $(NPM) test

# Fuzz budgets are counts of executions, not durations: with a duration, Go 1.26's
# fuzz coordinator can fail a clean run with "context deadline exceeded" at the end
# of the window on a loaded machine (golang/go#75804, fixed in Go 1.27). A count
# stops without that deadline. `make fuzz` explores longer than `make test` does.
FUZZ_JOURNAL ?= 200000x
FUZZ_KEY ?= 1000000x
fuzz:
	$(GO) test -run='^$$' -fuzz=FuzzJournalDecode -fuzztime=$(FUZZ_JOURNAL) ./client/
	$(GO) test -run='^$$' -fuzz=FuzzScopedKey -fuzztime=$(FUZZ_KEY) .

## chaos-soak: a long fault-injection run (see test/chaos/README.md)
chaos-soak:
	IDEM_CHAOS_INTENTS=20000 IDEM_CHAOS_DURATION=10m $(GO) test -count=1 -timeout 40m -v -run 'TestChaos$$' ./test/chaos/

## chaos-cluster: rounds of cluster faults for 10 minutes on three nats-server nodes (see test/chaos/README.md)
chaos-cluster:
	IDEM_CHAOS_INTENTS=3000 IDEM_CHAOS_DURATION=10m $(GO) test -count=1 -timeout 40m -v -run 'TestChaosCluster$$' ./test/chaos/

## rss: the worker's peak memory with 1 MiB request bodies (see BENCHMARKS.md)
rss:
	IDEM_RSS=1 $(GO) test -count=1 -timeout 30m -v -run TestPeakRSS ./test/rss/

## partbench: row deletes against partition drops at 10M inbox rows (see docs/SCALING.md)
partbench:
	$(GO) run ./cmd/partbench

## bench-go: the testing.B benchmarks of the hot paths (inbox claim, outbox enqueue, relay batch, ingress)
BENCH_TIME ?= 2s
bench-go:
	$(GO) test -run='^$$' -bench=. -benchtime=$(BENCH_TIME) ./dedupe/ ./outbox/ ./internal/relay/ ./producer/

## bench: the benchmark program with its baselines (see BENCHMARKS.md)
bench:
	$(GO) run ./cmd/bench
