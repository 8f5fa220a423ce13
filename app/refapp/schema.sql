-- The reference application's own tables. idem's tables (idem_*) are created by
-- package migrations; these belong to the application, as a user's business tables
-- would. Every statement is idempotent.
CREATE TABLE IF NOT EXISTS payments (
    id              bigserial   PRIMARY KEY,
    scope           text        NOT NULL DEFAULT '',
    idempotency_key text        NOT NULL,
    account         text        NOT NULL,
    amount_cents    bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS emails (
    id              bigserial   PRIMARY KEY,
    scope           text        NOT NULL DEFAULT '',
    idempotency_key text        NOT NULL,
    recipient       text        NOT NULL,
    subject         text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
-- Deliberately no unique constraint on idempotency_key: a double effect must show up
-- as a second row, not be hidden by the database.
CREATE TABLE IF NOT EXISTS ledger_entries (
    id              bigserial   PRIMARY KEY,
    idempotency_key text        NOT NULL,
    account         text        NOT NULL,
    amount_cents    bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS ledger_entries_key ON ledger_entries (idempotency_key);
