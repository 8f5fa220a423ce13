-- idem schema, version 6: a relay that reads the log.
--
-- The log relay reads committed outbox rows from a logical replication slot
-- (pgoutput, a publication of idem_outbox's INSERTs) and never updates them: what
-- it published, and where the stream put it, is written once per window of rows,
-- in idem_outbox_published. The polling relay of earlier versions stays, for rows
-- that are its own: those written while no log relay was set up, rows the log
-- relay handed over (a publish it could not complete), and the reconciler's
-- re-drives.

-- Which relay publishes a row, decided when it is written: 'log' for the log
-- relay, NULL for the polling relay. The log relay sets the column's default to
-- 'log' when it takes over the outbox and back to NULL when the polling relay
-- does, so every row belongs to exactly one of them from its INSERT on.
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS relay text;

-- The polling relay's queue holds its own rows only: the log relay's never enter
-- it, so it stays as small as the polling relay's backlog.
DROP INDEX IF EXISTS idem_outbox_pending;
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (id)
    WHERE published_at IS NULL AND dead_lettered_at IS NULL AND relay IS NULL;

-- What the log relay published: one row per window of outbox rows whose PubAcks
-- all came, written before the slot is told it may forget them. ids[i] landed at
-- stream sequence seqs[i]. A window re-published after a crash appears twice;
-- both say the same.
CREATE TABLE IF NOT EXISTS idem_outbox_published (
    id           bigserial   PRIMARY KEY,
    stream       text        NOT NULL,
    ids          bigint[]    NOT NULL,
    seqs         bigint[]    NOT NULL,
    id_range     int8range   NOT NULL,  -- [min(ids), max(ids)]: finds a row's window
    lsn          pg_lsn      NOT NULL,  -- the WAL position confirmed after the window
    published_at timestamptz NOT NULL DEFAULT now(),
    proven_at    timestamptz            -- every row of it proven complete (or given up on)
);
-- The reconciler's queue of windows.
CREATE INDEX IF NOT EXISTS idem_outbox_published_unproven ON idem_outbox_published (id) WHERE proven_at IS NULL;
-- Which window holds a row (inspect, the hand-over after a lost slot).
CREATE INDEX IF NOT EXISTS idem_outbox_published_range ON idem_outbox_published USING gist (id_range);
-- The collector's order.
CREATE INDEX IF NOT EXISTS idem_outbox_published_proven ON idem_outbox_published (proven_at) WHERE proven_at IS NOT NULL;
