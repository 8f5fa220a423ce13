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

# The statements, each once; the scripts below are built from them. Keys,
# fingerprints and payloads are stand-ins: only the statements' cost matters.
key="'k' || :r || '-' || :client_id"
claim="INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, expires_at) SELECT 'acct', $key, '\\x0102'::bytea, 'POST', '/payments', 'running', now() + make_interval(secs => 86400::float8) FROM (SELECT set_config('lock_timeout', '5000ms', true)) AS w ON CONFLICT (scope, key) DO NOTHING RETURNING locked_at"
payment="INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ('acct', 'k' || :r, 'acct-1', 100) RETURNING id"
outbox_one="INSERT INTO idem_outbox (key, subject, msg_id, headers, payload) VALUES ('acct ' || $key, 'idem.charge', 'm' || $key, '{\"a\":\"b\"}'::jsonb, '\\x7b7d'::bytea)"
outbox_unnest="INSERT INTO idem_outbox (key, subject, msg_id, headers, payload) SELECT k, s, m, h::jsonb, p FROM unnest(ARRAY['acct ' || $key]::text[], ARRAY['idem.charge']::text[], ARRAY['m' || $key]::text[], ARRAY['{\"a\":\"b\"}']::text[], ARRAY['\\x7b7d']::bytea[]) AS t(k, s, m, h, p)"
complete="UPDATE idem_requests SET status = 'done', response_code = 201, response_headers = '{\"Content-Type\":[\"application/json\"]}', response_body = '\\x7b7d' WHERE scope = 'acct' AND key = $key"
lookup="SELECT pg_advisory_xact_lock(hashtextextended('acct' || $key, 0)), (SELECT status FROM idem_requests WHERE scope = 'acct' AND key = $key)"
record="INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, response_code, response_headers, response_body, expires_at) VALUES ('acct', $key, '\\x0102'::bytea, 'POST', '/payments', 'done', 201, '{\"Content-Type\":[\"application/json\"]}', '\\x7b7d', now() + make_interval(secs => 86400::float8))"

# A request as the middleware sends it: BEGIN with its first statement in one
# pipeline, the handler's INSERT, then the last statements with COMMIT in another.
request() { # first statement, then the statements sent with COMMIT
  local first=$1; shift
  printf '\\set r random(1, 1000000000)\n\\startpipeline\nBEGIN;\n%s;\n\\endpipeline\n%s;\n\\startpipeline\n' "$first" "$payment"
  for st in "$@"; do printf '%s;\n' "$st"; done
  printf 'COMMIT;\n\\endpipeline\n'
}
script() {
  case $1 in
  floor) printf '\\set r random(1, 1000000000)\nBEGIN;\n%s;\nCOMMIT;\n' "$payment" ;;
  claim) request "$claim" ;;
  outbox) request "$claim" "$outbox_one" ;;
  ingress) request "$claim" "$outbox_one" "$complete" ;;
  ingress-unnest) request "$claim" "$outbox_unnest" "$complete" ;;
  ingress-cte) request "$claim" "WITH o AS ($outbox_one) $complete" ;;
  ingress-advisory) request "$lookup" "$outbox_one" "$record" ;;
  *) echo "unknown script $1 (floor, claim, outbox, ingress, ingress-unnest, ingress-cte, ingress-advisory)" >&2; return 1 ;;
  esac
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; psql -qd postgres -c "DROP DATABASE IF EXISTS $db"' EXIT
for s in "${scripts[@]}"; do script "$s" >"$tmp/$s.sql"; done

printf '%-18s %5s %12s %10s\n' script round 'pg µs/tx' tps
for r in $(seq 1 "$rounds"); do
  for s in "${scripts[@]}"; do
    psql -qd "$db" -c 'TRUNCATE idem_outbox, idem_requests, payments' -c 'CHECKPOINT'
    before=$(pg_cpu_ticks)
    out=$(pgbench -n -M prepared -c $clients -j 2 -t $per_client -f "$tmp/$s.sql" "$db" 2>&1)
    after=$(pg_cpu_ticks)
    tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out")
    [ -n "$tps" ] || { echo "$out" >&2; exit 1; }
    us=$(( (after - before) * 1000000 / tck / (clients * per_client) ))
    printf '%-18s %5d %12d %10.0f\n' "$s" "$r" "$us" "$tps"
  done
done
