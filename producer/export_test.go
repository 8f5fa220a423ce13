package producer

// NewestGroupJoined reports how many requests have joined the group m started
// last (0 before the first), so a test can wait until a group has formed instead
// of sleeping.
func NewestGroupJoined(m *Middleware) int {
	m.groups.mu.Lock()
	defer m.groups.mu.Unlock()
	if m.groups.newest == nil {
		return 0
	}
	return m.groups.newest.joined
}
