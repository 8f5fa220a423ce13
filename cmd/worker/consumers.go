package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/embeddednats"
)

const consumersUsage = `usage: worker consumers rename OLD NEW [--force] [flags]
       worker consumers forget NAME [flags]

forget removes a retired consumer from the installation's registry: until then
every intent it reads waits for it, is re-driven to it, and is finally alerted
as a dead letter. A consumer that still runs registers itself again when it
restarts.

rename
renames a registered consumer and keeps everything it knows: its inbox, its
attempt counts, its dead letters and its registry entry move to the new name, so
the renamed consumer folds every intent the old name settled. Then the old
name's durable JetStream consumer is deleted.

Stop every worker that runs OLD first (a consumer seen in the last five minutes
is refused unless --force), then deploy NEW: its durable consumer is created
when it starts, reads what the stream holds, and its inbox folds the history.
A new name deployed without this command, while OLD (same stream and filter,
with settlements) is registered, is refused at start (consumer.ErrLikelyRenamed)
instead of running every intent the stream still holds a second time.
`

// consumersRenameOptions are the flags and arguments of worker consumers rename.
type consumersRenameOptions struct {
	db       dbOptions
	nats     natsOptions
	force    bool
	from, to string
}

func (o *consumersRenameOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	o.nats.flags(fs)
	fs.BoolVar(&o.force, "force", false, "rename a consumer seen in the last five minutes (it must not be running)")
}

func (o *consumersRenameOptions) validate(args []string) error {
	if len(args) != 2 {
		return fmt.Errorf("consumers rename: want OLD and NEW, got %q", args)
	}
	o.from, o.to = args[0], args[1]
	return nil
}

func (o *consumersRenameOptions) secrets() []*secret { return o.nats.secrets() }

func runConsumersRename(o *consumersRenameOptions, stdout, _ io.Writer) error {
	from, to := o.from, o.to
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, &o.db)
	if err != nil {
		return err
	}
	defer pool.Close()
	inst, err := install.New(pool, nil, refapp.Config{Schema: o.db.schema}.InstallConfig())
	if err != nil {
		return fmt.Errorf("consumers rename: %w", err)
	}
	if err := consumer.Rename(ctx, inst, from, to, o.force); err != nil {
		return fmt.Errorf("consumers rename: %w", err)
	}
	fmt.Fprintf(stdout, "renamed consumer %s to %s: its inbox, attempts, dead letters and registry entry\n", from, to)

	url, _, auth := o.nats.target(o.db.dataDir)
	if url == "" {
		return fmt.Errorf("consumers rename: renamed, but no --nats-url and no %s under --data-dir %s: delete the durable consumer %s on stream %s yourself (nats consumer rm %s %s)",
			runenv.NATSURLFile, o.db.dataDir, from, refapp.StreamName, refapp.StreamName, from)
	}
	deleted, err := deleteDurable(ctx, url, auth, refapp.StreamName, from)
	if err != nil {
		return fmt.Errorf("consumers rename: renamed, but the durable consumer %s could not be deleted (delete it yourself: nats consumer rm %s %s): %w",
			from, refapp.StreamName, from, err)
	}
	if deleted {
		fmt.Fprintf(stdout, "deleted the durable consumer %s of stream %s\n", from, refapp.StreamName)
	} else {
		fmt.Fprintf(stdout, "stream %s had no durable consumer %s\n", refapp.StreamName, from)
	}
	return nil
}

// consumersForgetOptions are the flags and argument of worker consumers forget.
type consumersForgetOptions struct {
	db   dbOptions
	name string
}

func (o *consumersForgetOptions) flags(fs *flagSet) { o.db.flags(fs) }

func (o *consumersForgetOptions) validate(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("consumers forget: want NAME, got %q", args)
	}
	o.name = args[0]
	return nil
}

func (o *consumersForgetOptions) secrets() []*secret { return nil }

func runConsumersForget(o *consumersForgetOptions, stdout, _ io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, &o.db)
	if err != nil {
		return err
	}
	defer pool.Close()
	inst, err := install.New(pool, nil, refapp.Config{Schema: o.db.schema}.InstallConfig())
	if err != nil {
		return fmt.Errorf("consumers forget: %w", err)
	}
	forgot, err := consumer.Forget(ctx, inst, o.name)
	if err != nil {
		return fmt.Errorf("consumers forget: %w", err)
	}
	if !forgot {
		return fmt.Errorf("consumers forget: no consumer %s is registered (worker stats lists them)", o.name)
	}
	fmt.Fprintf(stdout, "forgot consumer %s: intents no longer wait for it\n", o.name)
	return nil
}

// deleteDurable deletes the durable consumer name of stream; false when there was
// none.
func deleteDurable(ctx context.Context, url string, auth runenv.NATSAuth, stream, name string) (bool, error) {
	opts, err := auth.Options()
	if err != nil {
		return false, err
	}
	nc, err := nats.Connect(url, append([]nats.Option{nats.Name("idem-worker-consumers"), nats.Timeout(3 * time.Second)}, opts...)...)
	if err != nil {
		return false, fmt.Errorf("connect to NATS at %s: %w", embeddednats.Redact(url), err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return false, err
	}
	err = js.DeleteConsumer(ctx, stream, name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return false, nil
	}
	return err == nil, err
}
