-- idem schema, version 4: delivery is proven, not assumed.
--
-- The relay records where each message landed (the PubAck's stream and sequence).
-- Consumers register themselves. A reconciler proves each published intent complete
-- — every registered consumer whose filter matches its subject has an inbox row or a
-- dead letter for its key — and re-publishes what the stream lost, under a new
-- Msg-Id generation. A published row is kept until it is complete (or past the alert
-- horizon), never deleted by age alone.
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS stream       text;
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS stream_seq   bigint;
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS generation   int NOT NULL DEFAULT 0;
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS completed_at timestamptz;
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS alerted_at   timestamptz;
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS reconciled   text;  -- the last verdict: lag, unrouted, redriven, alert
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS checked_at   timestamptz;  -- when the reconciler last looked in the stream
-- Rows published before this version carry no PubAck: they are trusted, as they were.
UPDATE idem_outbox SET completed_at = published_at WHERE published_at IS NOT NULL AND stream_seq IS NULL AND completed_at IS NULL;
-- The reconciler's queue: published, not yet proven complete, not given up on.
CREATE INDEX IF NOT EXISTS idem_outbox_unproven ON idem_outbox (id)
    WHERE published_at IS NOT NULL AND completed_at IS NULL AND alerted_at IS NULL;
-- What operators count: rows re-driven, rows given up on.
CREATE INDEX IF NOT EXISTS idem_outbox_redriven ON idem_outbox (id) WHERE generation > 0;
CREATE INDEX IF NOT EXISTS idem_outbox_alerted ON idem_outbox (id) WHERE alerted_at IS NOT NULL;

-- Consumers, as they register at start: which messages each must see.
CREATE TABLE IF NOT EXISTS idem_consumers (
    name           text        PRIMARY KEY,
    stream         text        NOT NULL,
    filter_subject text        NOT NULL,
    key_lifetime   interval    NOT NULL,
    registered_at  timestamptz NOT NULL DEFAULT now(),
    last_seen_at   timestamptz NOT NULL DEFAULT now()
);
