package partition_test

import (
	"context"
	"fmt"
	"log"

	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// An installation partitions its inbox and outbox once, and from then on every
// maintenance round (the worker's collector runs one a minute) makes the days
// ahead ready and drops the days whose rows have all expired.
func ExampleConvert() {
	ctx := context.Background()
	env, err := testenv.Open(ctx, nil) // a throwaway migrated database
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()

	cfg := partition.Config{} // public schema, 2 days ahead, 72h key lifetime
	converted, err := partition.Convert(ctx, env.Pool, cfg)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("converted:", converted.Converted)

	round, err := partition.Maintain(ctx, env.Pool, cfg)
	if err != nil {
		log.Fatal(err)
	}
	days := map[partition.Table]int{}
	for _, p := range round.Created {
		days[p.Table]++
	}
	// The inbox: today to the day of now + 72h + 48h. The outbox: today to now + 48h.
	fmt.Println("inbox days ready:", days[partition.Inbox], "outbox days ready:", days[partition.Outbox])
	// Output:
	// converted: [idem_inbox idem_outbox]
	// inbox days ready: 6 outbox days ready: 3
}
