package dedupe

// The lease SQL, in one place. Every statement is a single autocommit statement:
// a lease is only useful to other workers once it is committed, and no transaction
// may stay open across the external effect it guards.
//
// Times are the database's (now()), never a worker's clock: two workers whose
// clocks disagree still agree on whether a lease has expired.
const (
	// The acquisition of a delivery no row settles yet: it is inserted as leased.
	// Nothing comes back when a row exists (this delivery's, or one written before
	// v5 for every message of the key); the caller then inspects it.
	sqlLeaseInsert = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, lease_until, lease_owner, lease_attempts, expires_at)
SELECT $1, $2, $3, $4, 'leased', now() + $5::interval, $6, 1, now() + $7::interval
WHERE NOT EXISTS (SELECT 1 FROM idem_inbox WHERE consumer = $1 AND key = $2 AND message = '')
ON CONFLICT (consumer, key, message) DO NOTHING
RETURNING message, lease_attempts, step, step_state, lease_until`

	// The same on a partitioned inbox, sent as one pipeline after sqlClaimLock (the
	// key's advisory lock) in one implicit transaction.
	sqlLeaseInsertPartitioned = `
INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, lease_until, lease_owner, lease_attempts, expires_at)
SELECT $1, $2, $3, $4, 'leased', now() + $5::interval, $6, 1, now() + $7::interval
WHERE NOT EXISTS (SELECT 1 FROM idem_inbox WHERE consumer = $1 AND key = $2 AND message IN ($3, ''))
RETURNING message, lease_attempts, step, step_state, lease_until`

	// What stood in the way of an acquisition, judged by the database's clock: the
	// delivery's own row, else one written before v5 for every message of the key.
	sqlLeaseInspect = `
SELECT message, status, fingerprint, result, lease_until, now()
FROM idem_inbox WHERE consumer = $1 AND key = $2 AND message IN ($3, '')
ORDER BY message DESC LIMIT 1`

	// Taking an expired lease over. Under READ COMMITTED an UPDATE re-evaluates
	// its WHERE on the row's latest version once it holds the row's lock, so of
	// two workers racing for one expired lease the second sees the first's fresh
	// lease_until and takes nothing. The recovery point (step, step_state) is left
	// as the previous holder left it.
	sqlLeaseTakeOver = `
UPDATE idem_inbox AS i
SET lease_until = now() + $5::interval, lease_owner = $6, lease_attempts = i.lease_attempts + 1
WHERE consumer = $1 AND key = $2 AND message = $3 AND status = 'leased'
  AND (lease_until IS NULL OR lease_until <= now())
  AND fingerprint = $4
RETURNING message, lease_attempts, step, step_state, lease_until`

	// The holder-only statements: each matches the row only while lease_owner is
	// still this acquisition's token and the effect is not yet done.
	sqlLeaseExtend = `
UPDATE idem_inbox SET lease_until = now() + $5::interval
WHERE consumer = $1 AND key = $2 AND message = $3 AND lease_owner = $4 AND status = 'leased'
RETURNING lease_until`

	sqlLeaseStep = `
UPDATE idem_inbox SET step = $5, step_state = $6
WHERE consumer = $1 AND key = $2 AND message = $3 AND lease_owner = $4 AND status = 'leased'`

	// Completion does not look at lease_until: an effect that was performed is
	// recorded whenever the token still holds, even when the lease ran out while
	// the database stalled, as long as nobody took it over.
	sqlLeaseComplete = `
UPDATE idem_inbox
SET status = 'done', result = $5, completed_at = now(), lease_until = NULL, lease_owner = NULL
WHERE consumer = $1 AND key = $2 AND message = $3 AND lease_owner = $4 AND status = 'leased'`

	// Release ends the lease now (the take-over's "<= now()" then holds at once)
	// and keeps the recovery point, so the retry resumes where this attempt stopped.
	sqlLeaseRelease = `
UPDATE idem_inbox SET lease_until = now(), lease_owner = NULL
WHERE consumer = $1 AND key = $2 AND message = $3 AND lease_owner = $4 AND status = 'leased'`
)
