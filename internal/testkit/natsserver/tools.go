//go:build tools

// Package natsserver pins the nats-server that internal/testkit/natstest builds.
package natsserver

import _ "github.com/nats-io/nats-server/v2"
