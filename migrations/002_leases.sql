-- idem schema, version 2: leases for external effects (dedupe.Lease).
--
-- An effect that cannot join a Postgres transaction (SMTP, a payment provider) is
-- claimed in two phases: a lease row committed before the effect, completed after
-- it. lease_until and step/step_state are in version 1; these columns make the
-- lease safe to take over and to finish:
--
--   lease_owner     a random token minted by each acquisition. Extending, recording
--                   a step, completing and releasing all require it, so a worker
--                   whose lease expired and was taken over cannot complete (or
--                   overwrite the recovery point of) the new holder's attempt.
--   lease_attempts  how many times the lease was acquired: 1 for the first attempt,
--                   more when a worker died (or failed) mid-effect and another took
--                   over. A handler sees it and knows an earlier attempt may already
--                   have reached the downstream.
ALTER TABLE idem_inbox ADD COLUMN IF NOT EXISTS lease_owner text;
ALTER TABLE idem_inbox ADD COLUMN IF NOT EXISTS lease_attempts int NOT NULL DEFAULT 0;
