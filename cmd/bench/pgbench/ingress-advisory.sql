-- The ingress without a claim row: an advisory lock on the key plus a lookup, then
-- one INSERT of the finished record. Measured, not built: it gained nothing.
-- Keys, fingerprints and payloads are stand-ins: only the statements' cost matters.
\set r random(1, 1000000000)
\startpipeline
BEGIN;
SELECT pg_advisory_xact_lock(hashtextextended('acct' || 'k' || :r || '-' || :client_id, 0)), (SELECT status FROM idem_requests WHERE scope = 'acct' AND key = 'k' || :r || '-' || :client_id);
\endpipeline
INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ('acct', 'k' || :r, 'acct-1', 100) RETURNING id;
\startpipeline
INSERT INTO idem_outbox (key, subject, msg_id, headers, payload) VALUES ('acct k' || :r || '-' || :client_id, 'idem.charge', 'm' || :r || '-' || :client_id, '{"a":"b"}'::jsonb, '\x7b7d'::bytea);
INSERT INTO idem_requests (scope, key, fingerprint, method, path, status, response_code, response_headers, response_body, expires_at) VALUES ('acct', 'k' || :r || '-' || :client_id, '\x0102'::bytea, 'POST', '/payments', 'done', 201, '{"Content-Type":["application/json"]}', '\x7b7d', now() + make_interval(secs => 86400::float8));
COMMIT;
\endpipeline
