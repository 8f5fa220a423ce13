package ops

// lagOf is set once by package worker's init and read-only afterwards: the lag
// history a *worker.Worker keeps, read without an exported door on the worker.
var lagOf func(any) *LagHistory

// RegisterLagOf is called by package worker's init.
func RegisterLagOf(f func(any) *LagHistory) { lagOf = f }

// LagOf returns the lag history of w, a *worker.Worker.
func LagOf(w any) *LagHistory { return lagOf(w) }
