-- The floor plus the claim, pipelined with BEGIN, as producer.requestTx sends it.
-- Keys, fingerprints and payloads are stand-ins: only the statements' cost matters.
\set r random(1, 1000000000)
\startpipeline
BEGIN;
INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, expires_at) SELECT 'acct', 'k' || :r || '-' || :client_id, '\x0102'::bytea, 'POST', '/payments', 'running', now() + make_interval(secs => 86400::float8) FROM (SELECT set_config('lock_timeout', '5000ms', true)) AS w ON CONFLICT (scope, key) DO NOTHING RETURNING locked_at;
\endpipeline
INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ('acct', 'k' || :r, 'acct-1', 100) RETURNING id;
\startpipeline
COMMIT;
\endpipeline
