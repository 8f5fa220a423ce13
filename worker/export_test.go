package worker

// DefaultDeadLetterRetention is the external tests' view of the collector's
// default for RetentionConfig.DeadLetters.
const DefaultDeadLetterRetention = defaultDeadLetterRetention
