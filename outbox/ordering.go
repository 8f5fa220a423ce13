package outbox

// Ordering by key, opt-in (worker.RelayConfig.OrderedSubjects): the relay
// publishes the rows of an ordered subject one after another, in id order, and
// never two relays one subject at once. docs/ORDERING.md has the whole picture.

import (
	"fmt"
	"hash/fnv"
	"strconv"
)

// Partition returns the partition subject of orderingKey among partitions
// partitions of subject: subject + "." + p, where p is the FNV-1a (32-bit) hash of
// the key modulo partitions. Messages that share an ordering key (an order id)
// share a partition subject, and so, with worker.RelayConfig.OrderedSubjects covering
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
