-- ingress.sql with the outbox row and the stored response in one statement (a CTE).
-- Measured, not built: it gained nothing.
-- Keys, fingerprints and payloads are stand-ins: only the statements' cost matters.
\set r random(1, 1000000000)
\startpipeline
BEGIN;
INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, expires_at) SELECT 'acct', 'k' || :r || '-' || :client_id, '\x0102'::bytea, 'POST', '/payments', 'running', now() + make_interval(secs => 86400::float8) FROM (SELECT set_config('lock_timeout', '5000ms', true)) AS w ON CONFLICT (scope, key) DO NOTHING RETURNING locked_at;
\endpipeline
INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ('acct', 'k' || :r, 'acct-1', 100) RETURNING id;
\startpipeline
WITH o AS (INSERT INTO idem_outbox (key, subject, msg_id, headers, payload) VALUES ('acct k' || :r || '-' || :client_id, 'idem.charge', 'm' || :r || '-' || :client_id, '{"a":"b"}'::jsonb, '\x7b7d'::bytea)) UPDATE idem_requests SET status = 'done', response_code = 201, response_headers = '{"Content-Type":["application/json"]}', response_body = '\x7b7d' WHERE scope = 'acct' AND key = 'k' || :r || '-' || :client_id;
COMMIT;
\endpipeline
