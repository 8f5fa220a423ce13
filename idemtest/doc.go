// Package idemtest checks that YOUR consumer handler makes its effect exactly
// once, against a real Postgres and a real JetStream, under every kind of
// repeat the system can produce: a crash before the commit, a crash after it, the
// broker delivering the same message again, the relay or a producer re-sending it,
// and a producer bug sending the same key with another payload. It puts "once" in
// the user's own CI, next to the handler it is about.
//
// A test starts an Env (a fresh database with idem's tables and the user's, on a
// JetStream server of the test's own), describes the consumer and one message in
// a Case, and asserts:
//
//	func TestShippingIsOnce(t *testing.T) {
//		t.Parallel()
//		srv, err := embeddednats.Start(embeddednats.Config{StoreDir: t.TempDir()})
//		if err != nil {
//			t.Fatal(err)
//		}
//		t.Cleanup(srv.Stop)
//		env := idemtest.New(t, idemtest.Config{
//			NATSURL: srv.URL(),
//			Migrate: func(ctx context.Context, pool *pgxpool.Pool) error {
//				_, err := pool.Exec(ctx, `CREATE TABLE shipments (key text NOT NULL, payload bytea NOT NULL)`)
//				return err
//			},
//		})
//		env.AssertOnce(t, idemtest.Case{
//			Consumer: consumer.Config{Name: "shipping", Subject: "orders.paid", Handler: shipping.Handler{}},
//			Message:  idem.Message{Subject: "orders.paid", Payload: []byte(`{"order":42}`)},
//			Effects: func(ctx context.Context, pool *pgxpool.Pool, key string) (n int, err error) {
//				err = pool.QueryRow(ctx, `SELECT count(*) FROM shipments WHERE key = $1`, key).Scan(&n)
//				return n, err
//			},
//		})
//	}
//
// Effects is the heart of a Case: it counts the handler's effects for one key
// (rows of the user's table; for an External handler, the executions a fake
// downstream counted under the key the handler presented, which KeyFor derives
// from the scoped key as Effect.KeyFor does), and every scenario asserts that
// count is exactly 1. Check
// does the same without a testing.T and returns a Report (for TestMain, Example
// functions, or a test that expects a failure).
//
// # Scenarios
//
// A check runs, in order, with the consumer the user configured, in an
// installation (package install) of the Env's schema on the Case's stream (where
// left zero, the kit shortens AckWait, Backoff and LeaseFor so a check takes
// seconds):
//
//  1. FirstDelivery: the message is published as the relay publishes it (the
//     scoped key in Idempotency-Key, Nats-Msg-Id = idem.MsgID(subject, key)).
//     Every later scenario rests on it; if it fails the check stops.
//  2. CrashBeforeCommit (in-transaction handlers): the handler ran, then the
//     worker "dies" before the commit; the transaction rolls back, JetStream
//     redelivers and the handler runs again. Exactly once holds here only if the
//     handler wrote ONLY through the pgx.Tx it was given: this scenario catches
//     handlers that write through the pool, another connection or another system.
//     For an External handler (nothing to roll back) it is replaced by
//     LostResponse: the effect reached the downstream, then the handler failed as
//     on a lost response; the retry performs it again with the same key, so it
//     holds only if the downstream honours the key.
//  3. CrashAfterCommit (in-transaction): the effect and the inbox claim
//     committed, the ack never went out; the redelivery must fold. For an External
//     handler, CrashAfterPerform: the worker "dies" after the effect reached the
//     downstream, before its outcome was recorded; once the lease expires another
//     attempt takes the key over and performs the effect again with the same key,
//     so again it holds only if the downstream honours the key.
//  4. Redelivery: the durable consumer is deleted and created again, so JetStream
//     delivers the same stream messages (every one so far) to the same consumer
//     name; every key must keep its count.
//  5. Resent: the same key and payload published under a new Nats-Msg-Id, as the
//     relay re-publishes after the broker's duplicate window or a producer
//     retries; the inbox must fold it by key.
//  6. ChangedPayload: the same key with another payload (Case.Changed), a
//     producer bug; it must be dead-lettered in idem_dead_letters with a
//     "fingerprint mismatch" reason, and the count stays 1.
//
// The crash scenarios each use a fresh key (in the Case key's scope) with the same
// payload (or Case.PayloadFor's): an effect that already happened cannot be
// interrupted, so crashing on the first key would only show a fold. The other
// scenarios repeat the Case's key. The crashes are the library's internal fault
// points, aimed at those keys only; a user cannot arm them outside this kit, which
// is why it is a package of the library's module, as rivertest is of River's.
//
// Between scenarios the kit waits on conditions, never on sleeps: the consumer's
// outcome events (processed, duplicate, dead-lettered) and the durable consumer
// drained (nothing pending, nothing unacknowledged). Every wait is bounded by
// Case.Timeout; one that runs out fails its scenario and stops the check, naming
// what it waited for.
//
// # Isolation
//
// Each Env has its own database (idemtest_<random>, dropped by Close WITH
// (FORCE)) and uses the JetStream server of Config.NATSURL, so parallel tests each
// take an Env and a server. A check creates its stream (Case.Stream, by default
// "IDEMTEST" on the consumer's subject) and deletes it when it ends, so checks
// run one after another on one Env do not see each other's messages; on one Env
// they run one at a time.
//
// The kit starts no server, so the library's module graph holds no nats-server.
// The module github.com/idemkit/idem/embeddednats runs the server's own code in
// the test process (its module brings nats-server into the graph of the module
// whose tests require it); Config.NATSURL may also name a server run apart, one
// per Env that checks at the same time.
//
// # Examples of package consumer
//
// Package consumer's examples that need a database and a broker are here, on an Env
// from Start, so that each imports public packages only and can be copied as it
// stands: Example (InTransactionConsumer) runs an in-transaction consumer by hand,
// Example (CheckpointedExternal) a three-step charge with recovery points.
package idemtest
