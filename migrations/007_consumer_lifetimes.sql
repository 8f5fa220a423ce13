-- idem schema, version 7: the key lifetimes a consumer's settlements were written under.
--
-- A consumer's inbox row expires by the KeyLifetime its process had when it
-- settled the row. A redeploy that raises the lifetime re-registers the consumer
-- with the new one, but the rows already settled keep their old expiry; the
-- reconciler must judge them by it, or it re-drives to the consumer a copy of an
-- intent it settled and has since forgotten.

-- The shortest key lifetime a process of this consumer settled with, up to
-- key_lifetime_since: a row written before then may have been settled under it.
-- NULL while every process has used key_lifetime.
ALTER TABLE idem_consumers ADD COLUMN IF NOT EXISTS prior_key_lifetime interval;
-- When a process last registered or was seen with a key lifetime other than the
-- registered one.
ALTER TABLE idem_consumers ADD COLUMN IF NOT EXISTS key_lifetime_since timestamptz;
