-- idem schema, version 1. Every statement is idempotent so a crashed migration can
-- simply run again; the migrator also records the version in idem_schema_migrations.

-- HTTP idempotency records: scope + key -> the first response.
CREATE TABLE IF NOT EXISTS idem_requests (
    scope            text        NOT NULL DEFAULT '',
    key              text        NOT NULL,
    fingerprint      bytea       NOT NULL,
    method           text        NOT NULL,
    path             text        NOT NULL,
    status           text        NOT NULL DEFAULT 'done',
    response_code    int,
    response_headers jsonb       NOT NULL DEFAULT '{}',
    response_body    bytea,
    locked_at        timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS idem_requests_expires_at ON idem_requests (expires_at);

-- Transactional outbox: written in the producer's transaction, drained by the relay.
CREATE TABLE IF NOT EXISTS idem_outbox (
    id           bigserial   PRIMARY KEY,
    key          text        NOT NULL,
    subject      text        NOT NULL,
    msg_id       text        NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}',
    payload      bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    attempts     int         NOT NULL DEFAULT 0,
    last_error   text,
    expires_at   timestamptz
);
-- The relay's work queue: only unpublished rows, in id order.
CREATE INDEX IF NOT EXISTS idem_outbox_unpublished ON idem_outbox (id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_key ON idem_outbox (key);
CREATE INDEX IF NOT EXISTS idem_outbox_expires_at ON idem_outbox (expires_at) WHERE expires_at IS NOT NULL;

-- Consumer inbox: (consumer, key) -> the first result.
CREATE TABLE IF NOT EXISTS idem_inbox (
    consumer     text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    status       text        NOT NULL,          -- 'done', or 'leased' for an external effect under way
    result       bytea,
    lease_until  timestamptz,
    step         text,                          -- last recovery point of a multi-step handler
    step_state   bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (consumer, key)
);
CREATE INDEX IF NOT EXISTS idem_inbox_expires_at ON idem_inbox (expires_at);

-- Messages that can never succeed, with the reason. Nothing is dropped silently.
CREATE TABLE IF NOT EXISTS idem_dead_letters (
    id          bigserial   PRIMARY KEY,
    consumer    text        NOT NULL,
    key         text        NOT NULL DEFAULT '',
    subject     text        NOT NULL,
    headers     jsonb       NOT NULL DEFAULT '{}',
    payload     bytea       NOT NULL,
    reason      text        NOT NULL,
    deliveries  int         NOT NULL DEFAULT 0,
    stream_seq  bigint,
    created_at  timestamptz NOT NULL DEFAULT now(),
    replayed_at timestamptz
);
CREATE INDEX IF NOT EXISTS idem_dead_letters_key ON idem_dead_letters (key);
-- One dead letter per stream message and consumer, so a redelivered poison message
-- (the terminate was lost) does not file twice.
CREATE UNIQUE INDEX IF NOT EXISTS idem_dead_letters_seq ON idem_dead_letters (consumer, stream_seq) WHERE stream_seq IS NOT NULL;
