package dedupe

// The lease SQL, in one place. Every statement is a single autocommit statement:
// a lease is only useful to other workers once it is committed, and no transaction
// may stay open across the external effect it guards.
//
// Times are the database's (now()), never a worker's clock: two workers whose
// clocks disagree still agree on whether a lease has expired.
const (
	// The acquisition. A new key is inserted as leased. An existing row is taken
	// over only if it is leased, its lease has ended and it was claimed with the
	// same payload. ON CONFLICT DO UPDATE locks the row and re-evaluates the WHERE
	// on its latest version, so of two workers racing for one expired lease the
	// second sees the first's fresh lease_until and takes nothing: no RETURNING
	// row. The recovery point (step, step_state) is left as the dead holder left it.
	sqlLeaseAcquire = `
INSERT INTO idem_inbox AS i (consumer, key, fingerprint, status, lease_until, lease_owner, lease_attempts, expires_at)
VALUES ($1, $2, $3, 'leased', now() + $4::interval, $5, 1, now() + $6::interval)
ON CONFLICT (consumer, key) DO UPDATE
SET lease_until = EXCLUDED.lease_until,
    lease_owner = EXCLUDED.lease_owner,
    lease_attempts = i.lease_attempts + 1
WHERE i.status = 'leased'
  AND (i.lease_until IS NULL OR i.lease_until <= now())
  AND i.fingerprint = EXCLUDED.fingerprint
RETURNING lease_attempts, step, step_state, lease_until`

	// The acquisition on a partitioned inbox, sent as one pipeline after
	// sqlClaimLock (the key's advisory lock) in one implicit transaction: insert the
	// key as leased if no partition has it, else take an expired lease over. The
	// take-over cannot match the row the insert just made: its lease_until is
	// ahead of now(), and its owner is this acquisition.
	sqlLeaseInsert = `
INSERT INTO idem_inbox (consumer, key, fingerprint, status, lease_until, lease_owner, lease_attempts, expires_at)
SELECT $1, $2, $3, 'leased', now() + $4::interval, $5, 1, now() + $6::interval
WHERE NOT EXISTS (SELECT 1 FROM idem_inbox WHERE consumer = $1 AND key = $2)
RETURNING lease_attempts, step, step_state, lease_until`

	sqlLeaseTakeOver = `
UPDATE idem_inbox AS i
SET lease_until = now() + $4::interval, lease_owner = $5, lease_attempts = i.lease_attempts + 1
WHERE consumer = $1 AND key = $2 AND status = 'leased'
  AND (lease_until IS NULL OR lease_until <= now())
  AND fingerprint = $3 AND lease_owner IS DISTINCT FROM $5
RETURNING lease_attempts, step, step_state, lease_until`

	// What stood in the way of an acquisition, judged by the database's clock.
	sqlLeaseInspect = `
SELECT status, fingerprint, result, lease_until, now()
FROM idem_inbox WHERE consumer = $1 AND key = $2`

	// The holder-only statements: each matches the row only while lease_owner is
	// still this acquisition's token and the effect is not yet done.
	sqlLeaseExtend = `
UPDATE idem_inbox SET lease_until = now() + $4::interval
WHERE consumer = $1 AND key = $2 AND lease_owner = $3 AND status = 'leased'
RETURNING lease_until`

	sqlLeaseStep = `
UPDATE idem_inbox SET step = $4, step_state = $5
WHERE consumer = $1 AND key = $2 AND lease_owner = $3 AND status = 'leased'`

	sqlLeaseComplete = `
UPDATE idem_inbox
SET status = 'done', result = $4, completed_at = now(), lease_until = NULL, lease_owner = NULL
WHERE consumer = $1 AND key = $2 AND lease_owner = $3 AND status = 'leased'`

	// Release ends the lease now (the acquisition's "<= now()" then holds at once)
	// and keeps the recovery point, so the retry resumes where this attempt stopped.
	sqlLeaseRelease = `
UPDATE idem_inbox SET lease_until = now(), lease_owner = NULL
WHERE consumer = $1 AND key = $2 AND lease_owner = $3 AND status = 'leased'`
)
