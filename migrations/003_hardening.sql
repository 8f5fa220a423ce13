-- idem schema, version 3: nothing blocks, nothing is retried forever, nothing is
-- dropped without a trace.

-- Outbox: a row whose publish fails steps aside until next_attempt_at, so a row the
-- broker refuses never holds up the rows behind it; after RelayConfig.MaxAttempts
-- failures it is dead-lettered (a row in idem_dead_letters with the broker's reason)
-- and dead_lettered_at is set. The relay's queue is "neither published nor
-- dead-lettered".
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS next_attempt_at  timestamptz;
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS dead_lettered_at timestamptz;
DROP INDEX IF EXISTS idem_outbox_unpublished;
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL;

-- Attempts at a key by a consumer, counted in Postgres: a handler's failures and
-- the redelivered starts of an in-transaction consumer (a worker that died mid-batch).
-- MaxDeliver is compared with this count, never with JetStream's delivery count,
-- which also counts deliveries lost to a database outage or a batch-mate's crash.
CREATE TABLE IF NOT EXISTS idem_attempts (
    consumer   text        NOT NULL,
    key        text        NOT NULL,
    attempts   int         NOT NULL DEFAULT 0,
    last_error text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (consumer, key)
);
CREATE INDEX IF NOT EXISTS idem_attempts_expires_at ON idem_attempts (expires_at);

-- Dead letters.
--   fingerprint       SHA-256 of the payload: with consumer, stream_seq and key it
--                     identifies the message, so a stream recreated from sequence 1
--                     cannot make a new poison message collide with an old row.
--   inbox_expires_at  when the consumer's inbox may forget what it knew of the key;
--                     a replay after it could run an effect twice, and is refused.
--   expires_at        retention of the dead letter itself.
ALTER TABLE idem_dead_letters ADD COLUMN IF NOT EXISTS fingerprint      bytea;
ALTER TABLE idem_dead_letters ADD COLUMN IF NOT EXISTS inbox_expires_at timestamptz;
ALTER TABLE idem_dead_letters ADD COLUMN IF NOT EXISTS expires_at       timestamptz;
DROP INDEX IF EXISTS idem_dead_letters_seq;
CREATE UNIQUE INDEX IF NOT EXISTS idem_dead_letters_message
    ON idem_dead_letters (consumer, stream_seq, key, fingerprint) WHERE stream_seq IS NOT NULL;
CREATE INDEX IF NOT EXISTS idem_dead_letters_created_at ON idem_dead_letters (created_at);
CREATE INDEX IF NOT EXISTS idem_dead_letters_expires_at ON idem_dead_letters (expires_at) WHERE expires_at IS NOT NULL;
