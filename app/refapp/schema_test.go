package refapp_test

import (
	"context"
	"sync"
	"testing"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// Workers starting together on a fresh database all migrate it: one creates the
// tables, the others find them.
func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = refapp.Migrate(context.Background(), db.Pool)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}
}
