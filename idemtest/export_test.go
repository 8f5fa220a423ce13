package idemtest

// SkipInboxClaim arms the kit's negative control on e: its checks run the consumer
// with faults.SkipInboxClaim, so every delivery runs the handler without claiming
// its key. Every scenario that rests on the inbox's fold must then fail, which is
// how the kit's own tests show that those scenarios can fail at all.
func SkipInboxClaim(e *Env) { e.skipClaim = true }
