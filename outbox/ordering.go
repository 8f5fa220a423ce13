package outbox

// Ordering by key, opt-in (RelayConfig.OrderedSubjects): the relay publishes the
// rows of an ordered subject one after another, in id order, and never two relays
// one subject at once. docs/ORDERING.md has the whole picture.

import (
	"context"
	"fmt"
	"hash/fnv"
	"regexp"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Partition returns the partition subject of orderingKey among partitions
// partitions of subject: subject + "." + p, where p is the FNV-1a (32-bit) hash of
// the key modulo partitions. Messages that share an ordering key (an order id)
// share a partition subject, and so, with RelayConfig.OrderedSubjects covering
// it and an ordered consumer per partition (consumer.Partitioned), are processed
// in the order they were enqueued.
//
// It is the hash nats-server's subject mapping uses for {{partition(n,1)}} over a
// one-token key, computed here rather than by the server so that the outbox row
// already holds the subject the message will be stored under: the relay orders
// rows by that subject, and the reconciler matches it against the consumers'
// filters. The ordering key may be any string (it is hashed, not put in the
// subject). Changing partitions moves keys between partitions: drain first.
//
// Partition panics if partitions is not positive: a programming error.
func Partition(subject, orderingKey string, partitions int) string {
	if partitions <= 0 {
		panic(fmt.Sprintf("outbox: Partition: %d partitions", partitions))
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(orderingKey))
	return subject + "." + strconv.FormatUint(uint64(h.Sum32()%uint32(partitions)), 10)
}

// PartitionSubjects returns the partition subjects of subject, subject.0 to
// subject.<partitions-1>: the subjects Partition can return.
func PartitionSubjects(subject string, partitions int) []string {
	out := make([]string, max(partitions, 0))
	for p := range out {
		out[p] = subject + "." + strconv.Itoa(p)
	}
	return out
}

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
		return nil, false, fmt.Errorf("outbox: ordered: lock partitions: %w", err)
	}
	subjects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, false, fmt.Errorf("outbox: ordered: lock partitions: %w", err)
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
