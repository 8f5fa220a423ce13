package consumer

import (
	"fmt"
	"strconv"
	"strings"
)

// Partitioned returns one ordered consumer per partition of cfg.Subject: for p in
// 0..partitions-1, cfg with Name cfg.Name+"-"+p, Subject cfg.Subject+"."+p (the
// subjects outbox.Partition maps ordering keys to) and Ordered set. Give them all
// to the worker (worker.Config.Consumers) or run each with New. Each is its own
// durable consumer and its own inbox name, so partitions proceed independently: a
// message that blocks one (it fails until it is dead-lettered) holds up only the
// keys that hash to that partition.
//
// Every process may run all of them: a partition's durable consumer hands out one
// message at a time (MaxAckPending 1), whichever worker pulls it, so order holds
// with several workers too; they share a partition's work, they do not multiply it.
//
// cfg.Subject must be the literal subject given to outbox.Partition, and
// partitions the same number. Changing the number moves keys between partitions,
// and so between inbox names: drain the outbox and the consumers first.
func Partitioned(cfg Config, partitions int) ([]Config, error) {
	switch {
	case partitions <= 0:
		return nil, fmt.Errorf("consumer %s: Partitioned: %d partitions", cfg.Name, partitions)
	case strings.ContainsAny(cfg.Subject, "*>"):
		return nil, fmt.Errorf("consumer %s: Partitioned: Subject %q must be the literal subject the partitions extend", cfg.Name, cfg.Subject)
	case cfg.BatchSize > 1 || cfg.Concurrency > 1:
		return nil, fmt.Errorf("consumer %s: Partitioned: a partition's consumer takes one message at a time; leave BatchSize and Concurrency zero", cfg.Name)
	}
	out := make([]Config, partitions)
	for p := range out {
		c := cfg
		c.Name = cfg.Name + "-" + strconv.Itoa(p)
		c.Subject = cfg.Subject + "." + strconv.Itoa(p)
		c.Ordered = true
		if err := c.validate(); err != nil {
			return nil, err
		}
		out[p] = c
	}
	return out, nil
}
