// Package stop carries a component's work context beside its run context: the
// run context ends at the soft stop (take no more work), the work context at the
// hard stop (abandon the work in flight). The worker sets both; a component run
// on its own has no hard stop, and its work outlives its run context.
package stop

import "context"

type workKey struct{}

// WithWork returns ctx carrying work as the work context of what runs on it.
func WithWork(ctx, work context.Context) context.Context {
	return context.WithValue(ctx, workKey{}, work)
}

// Work is the context to finish work in flight on, for a component whose run
// context is ctx: the one WithWork set, else ctx without its cancellation.
func Work(ctx context.Context) context.Context {
	if w, ok := ctx.Value(workKey{}).(context.Context); ok {
		return w
	}
	return context.WithoutCancel(ctx)
}
