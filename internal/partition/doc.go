// Package partition partitions idem_inbox and idem_outbox by day, so that
// retention drops whole days instead of deleting rows one by one.
//
// Row-by-row retention (the worker's collector) is correct at any size, but every
// deleted row is written to the WAL and the table keeps its size. At 10M expired
// keys it wrote 2.3 GiB of WAL here and left a 2.3 GiB table after VACUUM, where
// dropping the ten day partitions took under a second and wrote 0.6 MiB (see
// docs/SCALING.md and cmd/partbench).
//
// # Layout
//
// Convert turns each plain table into a partitioned one of the same name, in place:
//
//   - idem_inbox is ranged by expires_at. A day whose upper bound has passed holds
//     only expired keys, so it is dropped whole: exactly what the collector would
//     have deleted.
//   - idem_outbox is ranged by created_at. A past day is dropped once none of its
//     rows is pending, published but not yet proven (the reconciler), or within its
//     retention.
//   - The old table becomes the DEFAULT partition: no row is copied, and rows that
//     find no day (maintenance stalled) land there. The collector keeps deleting
//     expired rows there, row by row.
//
// Maintain creates days ahead (the inbox out to the longest key lifetime plus
// Config.Ahead) and drops the expired ones. The worker's collector calls it every
// round; `worker partition` runs it by hand.
//
// # Uniqueness
//
// A partitioned table's unique indexes must contain its partition key, so the
// inbox can no longer enforce one row per delivery with its primary key:
// two claims with different lifetimes would land in different days. Package
// dedupe detects the layout and, on a partitioned inbox, takes a per-key advisory
// lock before it inserts the keys no partition has. That claim needs READ
// COMMITTED, and refuses other isolation levels.
//
// # Locks
//
// A day is created as a plain table and then attached (SHARE UPDATE EXCLUSIVE on
// the parent: inserts and queries do not wait). A drop locks the parent ACCESS
// EXCLUSIVE for two index probes and the DROP. Both give up after
// Config.LockTimeout and try again next round.
package partition
