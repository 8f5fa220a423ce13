#!/usr/bin/env bash
# Runs the ingress's SQL, statement by statement, under pgbench, against a fresh
# database migrated with idem's schema: Postgres's CPU per transaction and the rate,
# with no Go code in the path (BENCHMARKS.md, "The ingress's SQL alone").
#
#   cmd/bench/pgbench/run.sh [rounds] [scripts...]
#
# Postgres's CPU is read from /proc, so Postgres must run on this machine: the
# postmaster's reaped children plus its live ones, before and after each run.
# PGHOST, PGPORT and PGUSER select the server (default 127.0.0.1:5432, postgres).
set -euo pipefail
cd "$(dirname "$0")"

rounds=${1:-3}
shift || true
scripts=("$@")
[ ${#scripts[@]} -gt 0 ] || scripts=(floor claim outbox ingress ingress-unnest)
clients=16 per_client=1500

export PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}
db=idem_pgbench_$$
psql -qd postgres -c "CREATE DATABASE $db"
trap 'psql -qd postgres -c "DROP DATABASE IF EXISTS $db"' EXIT
(cd ../../.. && go run ./cmd/worker migrate --database-url "postgres://$PGUSER@$PGHOST:$PGPORT/$db?sslmode=disable") >/dev/null

# The postmaster's pid, from its data directory (readable as root or as postgres).
pm=$(head -1 "$(psql -Atd "$db" -c 'SHOW data_directory')/postmaster.pid")
tck=$(getconf CLK_TCK)
pg_cpu_ticks() { # the postmaster's own and reaped children's time, plus its live children's
  local t c
  t=$(awk '{print $14+$15+$16+$17}' "/proc/$pm/stat")
  for c in $(pgrep -P "$pm"); do t=$((t + $(awk '{print $14+$15}' "/proc/$c/stat" 2>/dev/null || echo 0))); done
  echo "$t"
}

printf '%-18s %5s %12s %10s\n' script round 'pg µs/tx' tps
for r in $(seq 1 "$rounds"); do
  for s in "${scripts[@]}"; do
    psql -qd "$db" -c 'TRUNCATE idem_outbox, idem_requests, payments' -c 'CHECKPOINT'
    before=$(pg_cpu_ticks)
    out=$(pgbench -n -M prepared -c $clients -j 2 -t $per_client -f "$s.sql" "$db" 2>&1)
    after=$(pg_cpu_ticks)
    tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out")
    [ -n "$tps" ] || { echo "$out" >&2; exit 1; }
    us=$(( (after - before) * 1000000 / tck / (clients * per_client) ))
    printf '%-18s %5d %12d %10.0f\n' "$s" "$r" "$us" "$tps"
  done
done
