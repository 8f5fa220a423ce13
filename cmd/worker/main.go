// Command worker runs idem's reference application (package refapp): the HTTP
// ingress of its charge and email API, the outbox relay and the consumers, over
// package worker; plus operator subcommands.
//
//	worker [flags]                              run the service
//	worker migrate [--print] [flags]            apply the schema (or print its SQL) and exit
//	worker partition [--convert] [flags]        partition idem_inbox and idem_outbox by day; maintain them
//	worker dead-letters list [filters]          list dead letters
//	worker dead-letters replay ID|filters|--all [--dry-run]
//	                                            put dead letters back on their way
//	worker inspect [--scope S] [flags] KEY      one key's whole life
//	worker stats [--json] [flags]               counts and lags
//	worker healthcheck [--json] [flags]         exit 0 if the worker at --http-addr is ready
//	worker consumers rename OLD NEW [--force]   rename a consumer, keeping its inbox
//	worker consumers forget NAME                remove a retired consumer from the registry
//	worker installation show                    this database's installation token and epoch
//	worker installation adopt TOKEN [--epoch N] take over another installation's durables
//	worker help [SUBCOMMAND]                    the help of the worker, or of a subcommand
//
// Each subcommand takes only the flags it uses (worker SUBCOMMAND -h lists them)
// and refuses any other; its flags may come before or after it. Every flag has
// an environment fallback, named in -h; worker -h also lists the exit codes (0
// ok, 1 error, 2 usage error). With NATS_URL empty the worker starts an embedded
// JetStream server whose store lives under --data-dir; with no database named at
// all and none answering at the default URL, it starts a private Postgres from
// the machine's binaries there too. The data dir is absolute by default (per
// user, see runenv.DefaultDataDir), so the operator subcommands find a running
// worker's private Postgres and JetStream server from any working directory.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/idemkit/idem/internal/buildinfo"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the command line args and returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	return runEnv(args, os.Getenv, stdout, stderr)
}

// runEnv is run with the environment read through getenv.
func runEnv(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if wantsVersion(args) {
		fmt.Fprintln(stdout, buildinfo.Read())
		return exitOK
	}
	err := rootCommand().main(args, getenv, stdout, stderr)
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(stderr, "worker:", err)
	}
	return exitCode(err)
}

// rootCommand is the worker's command tree: the service, and the subcommands.
func rootCommand() group {
	return group{
		dflt: newCommand("", usage, runService),
		subs: []runner{
			newCommand("migrate", migrateUsage, runMigrate),
			newCommand("partition", partitionUsage, runPartition),
			group{name: "dead-letters", usage: deadLettersUsage, subs: []runner{
				newCommand("dead-letters list", deadLettersUsage+"\nflags:\n", runDeadLettersList),
				newCommand("dead-letters replay", deadLettersUsage+"\nflags:\n", runDeadLettersReplay),
			}},
			newCommand("inspect", inspectUsage, runInspect),
			newCommand("stats", statsUsage, runStats),
			newCommand("healthcheck", healthcheckUsage, runHealthcheck),
			group{name: "consumers", usage: consumersUsage, subs: []runner{
				newCommand("consumers rename", consumersUsage+"\nflags:\n", runConsumersRename),
				newCommand("consumers forget", consumersUsage+"\nflags:\n", runConsumersForget),
			}},
			group{name: "installation", usage: installationUsage, subs: []runner{
				newCommand("installation show", installationUsage+"\nflags:\n", runInstallationShow),
				newCommand("installation adopt", installationUsage+"\nflags:\n", runInstallationAdopt),
			}},
			newCommand("help", helpUsage, runHelp),
		},
	}
}

const usage = `usage:
  worker [flags]                       run the service (ingress, relay, consumers)
  worker migrate [--print] [--json] [flags]
                                       apply the schema and exit (--print: write its SQL instead)
  worker partition [--convert] [--json]
                                       list and maintain the day partitions of idem_inbox and
                                       idem_outbox (--convert: partition the plain tables first)
  worker inspect [--scope S] [--json] KEY
                                       print everything known about one key
  worker stats [--json]                counts and lags (outbox backlog, inbox, dead letters)
  worker healthcheck [--json] [flags]  exit 0 if the worker at --http-addr is ready
  worker consumers rename OLD NEW [--force]
                                       rename a stopped consumer, keeping its inbox, attempts and
                                       dead letters; deletes OLD's durable consumer
  worker consumers forget NAME         remove a retired consumer from the registry
  worker dead-letters list [--consumer C] [--reason PREFIX] [--since T] [--until T] [--json]
                                       list dead letters (newest first)
  worker dead-letters replay (ID | --consumer C --reason PREFIX --since T --until T | --all) [--dry-run] [--force] [--json]
                                       put dead letters back on their way with their keys, through
                                       the outbox, to the consumer that filed each one; filters select
                                       in bulk, --dry-run writes nothing (see worker dead-letters -h)
  worker installation show [--json]    this database's installation: its token and epoch
  worker installation adopt TOKEN [--epoch N]
                                       give this database another installation's token, to bind
                                       its durables (a move; see worker installation -h)
  worker help [SUBCOMMAND]             this help, or a subcommand's

Each subcommand takes only the flags it uses, listed by worker SUBCOMMAND -h (the
database's, --data-dir and --schema for those that read it; the NATS connection's
for stats and consumers rename; --http-addr for healthcheck), and refuses any
other as a usage error. Flags may come before or after the subcommand (worker
--database-url URL stats, or worker stats --database-url URL). --json prints
JSON: one document for stats, inspect, healthcheck and migrate, JSON lines for
dead-letters list and replay.

Environment: every flag below that names an environment variable falls back to it
when not given, and so does the same flag of every subcommand. Also read:
XDG_STATE_HOME and HOME (the default --data-dir), the OTEL_* variables of --trace
otlp.

Exit status:
  0  success (healthcheck: the worker is ready)
  1  error (inspect: nothing is known about the key; dead-letters replay: a dead
     letter was refused; healthcheck: not ready or unreachable)
  2  usage error: unknown subcommand or flag, a flag the subcommand does not take,
     a bad flag value, wrong arguments

flags of the service:
`

const helpUsage = `usage: worker help [SUBCOMMAND]

Prints the worker's help and the service's flags, or a subcommand's help and
flags (the same as worker SUBCOMMAND -h).

flags:
`

// helpOptions: help takes no flags, and a subcommand as its arguments.
type helpOptions struct {
	topic  []string
	getenv func(string) string
}

func (o *helpOptions) flags(fs *flagSet) { o.getenv = fs.getenv }

func (o *helpOptions) validate(args []string) error {
	o.topic = args
	return nil
}

func runHelp(o *helpOptions, stdout, stderr io.Writer) error {
	err := rootCommand().main(append(o.topic, "-h"), o.getenv, stdout, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	return err
}
