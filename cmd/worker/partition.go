package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/pgschema"
)

const partitionUsage = `usage: worker partition [--convert] [--json] [flags]

Lists the partitions of idem_inbox and idem_outbox and runs one maintenance round:
partitions are created ahead and the ones whose rows have all expired are dropped
(the worker's collector does the same every retention interval).

With --convert it first turns the two plain tables into partitioned ones, in place
and idempotently: each becomes the DEFAULT partition of a partitioned table of the
same name. The conversion holds an exclusive lock on each table while Postgres
builds the new primary key's index over the existing rows: seconds per million
rows. Run it on an empty installation, or in a quiet moment. See docs/SCALING.md.
A table converted while in use keeps its live rows in the default partition, and
the days they cover get no partition of their own (for the inbox, about one key
lifetime): a line starting "warning:" says until when, and from which day on
partitions are attached.

Exit status: 0 ok, 1 error, 2 usage error.

flags:
`

// partitionTimeout bounds the whole command; a conversion of a large table takes
// longer than the other operator commands' opsTimeout.
const partitionTimeout = 30 * time.Minute

// partitionOptions are the flags of worker partition.
type partitionOptions struct {
	db              dbOptions
	convert, asJSON bool
}

func (o *partitionOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	fs.BoolVar(&o.convert, "convert", false, "convert the plain tables to partitioned ones first")
	fs.BoolVar(&o.asJSON, "json", false, "print the result as one JSON document")
}

func (o *partitionOptions) validate(args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("partition: unexpected arguments %q", args)
	}
	if err := pgschema.Validate(o.db.schema); err != nil {
		return fmt.Errorf("partition: --schema: %w", err)
	}
	return nil
}

func runPartition(o *partitionOptions, stdout, _ io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), partitionTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, &o.db)
	if err != nil {
		return err
	}
	defer pool.Close()
	cfg := partition.Config{Schema: o.db.schema}
	var out struct {
		Converted  *partition.ConvertReport         `json:"converted,omitempty"`
		Round      partition.Report                 `json:"round"`
		Partitions map[string][]partition.Partition `json:"partitions"`
	}
	if o.convert {
		r, err := partition.Convert(ctx, pool, cfg)
		if err != nil {
			return err
		}
		out.Converted = &r
	}
	if out.Round, err = partition.Maintain(ctx, pool, cfg); err != nil {
		return err
	}
	out.Partitions = map[string][]partition.Partition{}
	for _, t := range partition.Tables() {
		parts, err := partition.List(ctx, pool, cfg, t)
		if err != nil {
			return err
		}
		out.Partitions[string(t)] = parts
	}
	if o.asJSON {
		return json.NewEncoder(stdout).Encode(out)
	}
	if out.Converted != nil {
		for _, t := range out.Converted.Converted {
			fmt.Fprintf(stdout, "converted %s\n", t)
		}
		for _, t := range out.Converted.Already {
			fmt.Fprintf(stdout, "%s was partitioned already\n", t)
		}
	}
	for _, t := range out.Round.NotPartitioned {
		fmt.Fprintf(stdout, "%s is a plain table (convert it with --convert)\n", t)
	}
	for _, p := range out.Round.Created {
		fmt.Fprintf(stdout, "created %s\n", p)
	}
	for _, p := range out.Round.Dropped {
		fmt.Fprintf(stdout, "dropped %s\n", p)
	}
	for _, p := range out.Round.Kept {
		fmt.Fprintf(stdout, "kept %s: it still holds a live row\n", p)
	}
	for _, d := range out.Round.Deferred {
		fmt.Fprintf(stdout, "deferred: %s\n", d)
	}
	for _, wt := range out.Round.Waiting {
		fmt.Fprintf(stdout, "warning: %s\n", wt)
	}
	for _, t := range partition.Tables() {
		for _, p := range out.Partitions[string(t)] {
			fmt.Fprintf(stdout, "%s\t~%d rows\n", p, max(p.Rows, 0))
		}
	}
	return nil
}
