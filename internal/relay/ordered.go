package relay

// Ordering by key (Config.OrderedSubjects); docs/ORDERING.md has the whole picture.

import (
	"context"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
)

// filterRegexps turns NATS subject filters into anchored POSIX regular expressions
// that Postgres matches (subject ~ ANY(...)): '*' is one token, '>' one or more.
func filterRegexps(filters []string) []string {
	out := make([]string, len(filters))
	for i, f := range filters {
		toks := strings.Split(f, ".")
		for j, t := range toks {
			switch t {
			case "*":
				toks[j] = `[^.]+`
			case ">":
				toks[j] = `.+`
			default:
				toks[j] = regexp.QuoteMeta(t)
			}
		}
		out[i] = "^" + strings.Join(toks, `\.`) + "$"
	}
	return out
}

// claimOrdered claims rows of ordered subjects, in two statements. The first takes
// a transaction-scoped advisory lock on each subject whose oldest pending row is
// due, skipping subjects another relay holds: so no two relays ever publish one
// subject at once. The second, run after the locks are held (and so seeing every
// row the previous holder committed), loads each locked subject's oldest pending
// rows, in id order, stopping at a row still in its backoff: a row must not be
// published while an earlier row of its subject is neither published nor
// dead-lettered.
func (r *Relay) claimOrdered(ctx context.Context, tx pgx.Tx) (batch []outboxRow, full bool, err error) {
	rows, err := tx.Query(ctx, r.st.Outbox.LockOrdered, r.orderedRe, r.cfg.BatchSize, orderedLockClass, r.lockSalt)
	if err != nil {
		return nil, false, fmt.Errorf("relay: ordered: lock partitions: %w", err)
	}
	subjects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, false, fmt.Errorf("relay: ordered: lock partitions: %w", err)
	}
	if len(subjects) == 0 {
		return nil, false, nil
	}
	return r.claimWith(ctx, tx, r.st.Outbox.ClaimOrdered, subjects, r.cfg.BatchSize)
}

// orderedLockClass is the first key of the relay's per-subject advisory locks
// (pg_try_advisory_xact_lock(int, int)); the second is a hash of the schema and
// the subject. Two subjects whose hashes collide merely share a lock.
const orderedLockClass = 0x1de0_0001

// publishOrdered publishes an ordered batch in waves: the first row of every
// subject, then, once their PubAcks are in, the second, and so on. A row is sent
// only after the row before it in its subject was acknowledged, so a failure (a
// refusal, a lost PubAck) can never leave a later row of the subject in the stream
// ahead of it; the rest of that subject's rows are left as they are (neither
// published nor charged) for the next batch, after the failed row. Different
// subjects share each wave, so a batch costs one round trip per row of its longest
// subject, not per row.
func (r *Relay) publishOrdered(ctx context.Context, batch []outboxRow) (ok acked, failed map[int64]error) {
	failed = map[int64]error{}
	var order []string
	bySubject := map[string][]outboxRow{}
	for _, o := range batch { // batch is in id order
		if _, seen := bySubject[o.subject]; !seen {
			order = append(order, o.subject)
		}
		bySubject[o.subject] = append(bySubject[o.subject], o)
	}
	for wave := 0; ; wave++ {
		var rows []outboxRow
		for _, s := range order {
			if rs := bySubject[s]; wave < len(rs) {
				rows = append(rows, rs[wave])
			}
		}
		if len(rows) == 0 {
			return ok, failed
		}
		wok, wfailed := r.publish(ctx, rows)
		ok.ids, ok.streams, ok.seqs = append(ok.ids, wok.ids...), append(ok.streams, wok.streams...), append(ok.seqs, wok.seqs...)
		for _, o := range rows {
			if err, bad := wfailed[o.id]; bad {
				failed[o.id] = err
				bySubject[o.subject] = nil // the rest of the subject waits behind it
			}
		}
	}
}
