package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/idemkit/idem/internal/partition"
)

// `worker partition` reports plain tables until --convert partitions them, and
// then lists the days it made ready; --convert again is a no-op.
func TestPartitionCommand(t *testing.T) {
	t.Parallel()
	for _, schema := range []string{"", "ops_part"} {
		t.Run("schema="+schema, func(t *testing.T) {
			t.Parallel()
			db := opsDB(t, schema)
			base := []string{"partition", "--database-url", db.URL}
			if schema != "" {
				base = append(base, "--schema", schema)
			}
			out, errOut, code := worker(t, base...)
			if code != 0 {
				t.Fatalf("partition: exit %d: %s", code, errOut)
			}
			mustContain(t, "partition before --convert", out, "idem_inbox is a plain table", "idem_outbox is a plain table")

			out, errOut, code = worker(t, append(base, "--convert")...)
			if code != 0 {
				t.Fatalf("partition --convert: exit %d: %s", code, errOut)
			}
			mustContain(t, "partition --convert", out, "converted idem_inbox", "converted idem_outbox", "created idem_inbox_p", "idem_inbox_default (default)")

			out, errOut, code = worker(t, append(base, "--convert", "--json")...)
			if code != 0 {
				t.Fatalf("partition --convert --json: exit %d: %s", code, errOut)
			}
			var doc struct {
				Converted  partition.ConvertReport          `json:"converted"`
				Partitions map[string][]partition.Partition `json:"partitions"`
			}
			if err := json.Unmarshal([]byte(out), &doc); err != nil {
				t.Fatalf("--json output: %v\n%s", err, out)
			}
			if len(doc.Converted.Converted) != 0 || len(doc.Converted.Already) != 2 {
				t.Errorf("second --convert = %+v, want both already partitioned", doc.Converted)
			}
			if n := len(doc.Partitions["idem_inbox"]); n < 7 {
				t.Errorf("idem_inbox has %d partitions, want the default and 6 days", n)
			}
		})
	}
}

func TestPartitionCommandUsage(t *testing.T) {
	t.Parallel()
	if _, _, code := worker(t, "partition", "extra"); code != exitUsage {
		t.Errorf("partition extra: exit %d, want %d", code, exitUsage)
	}
}

// Converting an inbox in use leaves its live keys in the default partition: the
// days they cover get no partition of their own. The command says so in a line of
// its own, naming until when and from which day on.
func TestPartitionCommandWarnsOfDaysWaitingForTheDefaultPartition(t *testing.T) {
	t.Parallel()
	db := opsDB(t, "")
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, expires_at)
	      VALUES ('charges', 'live', 'test.x', '\x00', 'done', now() + interval '72 hours')`); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := worker(t, "partition", "--database-url", db.URL, "--convert")
	if code != 0 {
		t.Fatalf("partition --convert: exit %d: %s", code, errOut)
	}
	mustContain(t, "partition --convert of an inbox in use", out,
		"warning: idem_inbox: the default partition holds rows up to", "converted while in use",
		"their rows stay in the default partition", "day partitions can be attached from")
}
