-- idem schema, version 5: a delivery is named by its installation, its consumer,
-- its intent and its message.
--
-- The message tells apart the messages of one intent that one consumer reads: the
-- subject, or the subject and the name the producer gave it ("orders.line line-2")
-- when one intent sends several messages on one subject. The inbox, the attempts,
-- the dead letters and the proof name a delivery by (consumer, key, message).

-- Outbox: the name a producer gave a message (idem.Message.Name), if any. The
-- relay sends it as Idem-Message.
ALTER TABLE idem_outbox ADD COLUMN IF NOT EXISTS message_name text;

-- Inbox. A row written before this version has message '' and keeps the meaning it
-- had: its consumer settled every message of its key. A message in flight across
-- the upgrade is folded into it, not run again. No new row is written with ''.
ALTER TABLE idem_inbox ADD COLUMN IF NOT EXISTS message text NOT NULL DEFAULT '';
ALTER TABLE idem_inbox ALTER COLUMN message DROP DEFAULT;
-- Attempts are counted per message too; an old count ('') is simply not continued.
ALTER TABLE idem_attempts ADD COLUMN IF NOT EXISTS message text NOT NULL DEFAULT '';
ALTER TABLE idem_attempts ALTER COLUMN message DROP DEFAULT;

-- The primary keys gain the message. A partitioned inbox (package partition) keeps
-- its partition key, expires_at, last.
DO $$
DECLARE
  t   text;
  pk  text;
  has boolean;
  partitioned boolean;
BEGIN
  FOREACH t IN ARRAY ARRAY['idem_inbox', 'idem_attempts'] LOOP
    SELECT c.conname, 'message' = ANY (SELECT a.attname FROM pg_attribute a WHERE a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)),
           r.relkind = 'p'
      INTO pk, has, partitioned
      FROM pg_constraint c JOIN pg_class r ON r.oid = c.conrelid
     WHERE c.conrelid = to_regclass(t) AND c.contype = 'p';
    IF pk IS NULL OR has THEN
      CONTINUE;
    END IF;
    IF partitioned THEN
      EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I, ADD PRIMARY KEY (consumer, key, message, expires_at)', t, pk);
    ELSE
      EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I, ADD PRIMARY KEY (consumer, key, message)', t, pk);
    END IF;
  END LOOP;
END $$;

-- The rows written before this version, looked for by every claim: an index that
-- stays empty once they have expired.
CREATE INDEX IF NOT EXISTS idem_inbox_before_v5 ON idem_inbox (consumer, key) WHERE message = '';

-- Dead letters name their message; NULL is an unnamed message, the subject alone,
-- as every dead letter filed before this version was.
ALTER TABLE idem_dead_letters ADD COLUMN IF NOT EXISTS message text;

-- Consumers.
--   starts_at   where the consumer's responsibility starts: NULL for one that
--               backfills what the stream holds (the default), else when it
--               registered; the reconciler expects it to settle only intents
--               written since.
--   redelivery  its redelivery horizon, so that the lifetime invariant can be
--               checked for every consumer of the installation, not only one
--               process's.
ALTER TABLE idem_consumers ADD COLUMN IF NOT EXISTS starts_at  timestamptz;
ALTER TABLE idem_consumers ADD COLUMN IF NOT EXISTS redelivery interval NOT NULL DEFAULT '0';
