-- The floor (plain-http's transaction): BEGIN; INSERT the business row; COMMIT.
-- Keys, fingerprints and payloads are stand-ins: only the statements' cost matters.
\set r random(1, 1000000000)
BEGIN;
INSERT INTO payments (scope, idempotency_key, account, amount_cents) VALUES ('acct', 'k' || :r, 'acct-1', 100) RETURNING id;
COMMIT;
