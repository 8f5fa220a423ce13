package pgschema_test

import (
	"testing"

	"github.com/idemkit/idem/internal/pgschema"
)

func TestQualify(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ schema, in, want string }{
		{"", "SELECT * FROM idem_outbox", "SELECT * FROM idem_outbox"},
		{"public", "SELECT * FROM idem_outbox", "SELECT * FROM idem_outbox"},
		{"orders", "SELECT * FROM idem_outbox WHERE x", `SELECT * FROM "orders".idem_outbox WHERE x`},
		{"orders", "INSERT INTO idem_inbox AS i (consumer) SELECT 1 FROM idem_inbox", `INSERT INTO "orders".idem_inbox AS i (consumer) SELECT 1 FROM "orders".idem_inbox`},
		{"orders", "idem_requests", `"orders".idem_requests`},
		{"orders", "(SELECT ctid FROM idem_dead_letters)", `(SELECT ctid FROM "orders".idem_dead_letters)`},
		// Not tables: an index name, a column, an already qualified name, a channel.
		{"orders", "CREATE INDEX idem_outbox_unpublished ON x", "CREATE INDEX idem_outbox_unpublished ON x"},
		{"orders", "SELECT my_idem_outbox FROM t", "SELECT my_idem_outbox FROM t"},
		{"orders", `SELECT 1 FROM "x".idem_outbox`, `SELECT 1 FROM "x".idem_outbox`},
		{"orders", "SELECT 1 FROM x.idem_outbox", "SELECT 1 FROM x.idem_outbox"},
		{"orders", "WHERE oid = 'idem_inbox'::regclass", `WHERE oid = '"orders".idem_inbox'::regclass`},
	} {
		if got := pgschema.Qualify(tc.schema, tc.in); got != tc.want {
			t.Errorf("Qualify(%q, %q) = %q, want %q", tc.schema, tc.in, got, tc.want)
		}
	}
}

func TestValidate(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"", "public", "orders_idem", "_x1"} {
		if err := pgschema.Validate(ok); err != nil {
			t.Errorf("Validate(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"Orders", "1x", "a-b", `x"y`, "a b", "x.y"} {
		if err := pgschema.Validate(bad); err == nil {
			t.Errorf("Validate(%q) accepted it", bad)
		}
	}
}

func TestChannel(t *testing.T) {
	t.Parallel()
	if got := pgschema.Channel("", "idem_outbox"); got != "idem_outbox" {
		t.Errorf("default channel = %q", got)
	}
	if got := pgschema.Channel("orders", "idem_outbox"); got != "idem_outbox_orders" {
		t.Errorf("orders channel = %q", got)
	}
}
