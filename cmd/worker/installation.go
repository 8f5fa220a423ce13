package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"strconv"

	"github.com/idemkit/idem/internal/installation"
)

const installationUsage = `usage: worker installation show [--json] [flags]
       worker installation adopt TOKEN [--epoch N] [flags]

show prints this database's installation: its token, which names it in every
durable JetStream consumer it binds, and its epoch, which each binding bumps.

adopt gives this database the token TOKEN, and an epoch of at least N: its
consumers then bind the durables of the installation it replaces. Use it for a
move that made a new token (a fresh database filled by hand, a logical
replication cut-over to a new database), or to keep a copy of the database and
retire its original. A consumer that refuses a durable says what to run. Stop the
workers of the installation being replaced first: two databases bound to one
durable split its messages and run their effects in both.

A rename, pg_upgrade, or a dump and restore keep the token (it is a row of
idem_installation) and need nothing.
`

// installationShowOptions are the flags of worker installation show.
type installationShowOptions struct {
	db     dbOptions
	asJSON bool
}

func (o *installationShowOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	fs.BoolVar(&o.asJSON, "json", false, "print the installation as JSON")
}

func (o *installationShowOptions) validate(args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("installation show: unexpected arguments %q", args)
	}
	return nil
}

func runInstallationShow(o *installationShowOptions, stdout, _ io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, &o.db)
	if err != nil {
		return err
	}
	defer pool.Close()
	st, err := installation.Load(ctx, pool, o.db.schema)
	if err != nil {
		return fmt.Errorf("installation show: %w", err)
	}
	return printInstallation(stdout, st, o.asJSON)
}

func printInstallation(w io.Writer, st installation.State, asJSON bool) error {
	if asJSON {
		return json.NewEncoder(w).Encode(struct {
			Token   string `json:"token"`
			Epoch   int64  `json:"epoch"`
			Binding string `json:"binding,omitempty"`
		}{st.Token, st.Epoch, st.Binding})
	}
	_, err := fmt.Fprintf(w, "token %s\nepoch %d\nbinding %s\n", st.Token, st.Epoch, orNone(st.Binding))
	return err
}

// installationAdoptOptions are the flags and argument of worker installation
// adopt.
type installationAdoptOptions struct {
	db    dbOptions
	epoch int64
	token string
}

func (o *installationAdoptOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	fs.Int64Var(&o.epoch, "epoch", 0, "the least epoch to take: the durable's, as the refusal names it")
}

var uuidPattern = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)

func (o *installationAdoptOptions) validate(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("installation adopt: want TOKEN (the durable's idem.token, as a refusal names it), got %q", args)
	}
	if !uuidPattern.MatchString(args[0]) {
		return fmt.Errorf("installation adopt: TOKEN %q: want a UUID, as worker installation show prints it", args[0])
	}
	if o.epoch < 0 {
		return fmt.Errorf("installation adopt: --epoch %s: want 0 or more", strconv.FormatInt(o.epoch, 10))
	}
	o.token = args[0]
	return nil
}

func runInstallationAdopt(o *installationAdoptOptions, stdout, _ io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, &o.db)
	if err != nil {
		return err
	}
	defer pool.Close()
	st, err := installation.Adopt(ctx, pool, o.db.schema, o.token, o.epoch)
	if err != nil {
		return fmt.Errorf("installation adopt: %w", err)
	}
	fmt.Fprintln(stdout, "adopted; this database's installation is now:")
	return printInstallation(stdout, st, false)
}

// orNone prints an unnamed binding (none yet, or adopted since).
func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}
