-- idem schema, version 8: an installation is named by a token of its own.
--
-- The token is random, made here once: a physical copy of the database (a restored
-- base backup, a snapshot, PITR) carries it, and so do a rename, pg_upgrade and a
-- dump and restore, so it names the data, not the cluster. The epoch tells a copy
-- from the original: every binding of a durable consumer bumps it, here and in the
-- durable's metadata (idem.token, idem.epoch). A database whose epoch is behind its
-- durable's is a copy of an older state of the installation, and its consumers
-- refuse to bind (consumer.ErrForkedDatabase).
--
-- One row. `worker installation show` prints it; `worker installation adopt TOKEN`
-- gives this database the token of the installation it replaces.
CREATE TABLE IF NOT EXISTS idem_installation (
    one        boolean     PRIMARY KEY DEFAULT true CHECK (one),
    token      uuid        NOT NULL,
    epoch      bigint      NOT NULL DEFAULT 0,
    bound_by   uuid,                   -- names the last binding (idem.binding): a copy and its original binding at once reach one epoch, not one binding
    created_at timestamptz NOT NULL DEFAULT now(),
    adopted_at timestamptz             -- when the token was last set by adopt
);
INSERT INTO idem_installation (token) VALUES (gen_random_uuid()) ON CONFLICT DO NOTHING;
