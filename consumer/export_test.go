package consumer

import "time"

// SetLinger makes c's batches wait up to d for more messages after their first
// one arrived (d < 0: not at all), so that a test can gather a batch.
func SetLinger(c *Config, d time.Duration) { c.linger = d }

// The defaults the external tests check Config's zero fields against.
const (
	DefaultBatchSize           = defaultBatchSize
	DefaultConcurrency         = defaultConcurrency
	DefaultExternalConcurrency = defaultExternalConcurrency
	DefaultAckWait             = defaultAckWait
	DefaultLeaseFor            = defaultLeaseFor
)
