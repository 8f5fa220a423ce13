package main

// The command line's machinery. Each subcommand is a command with an options
// type of its own, which registers only the flags the subcommand uses, each with
// its environment fallback, and validates them without I/O; a flag the command
// does not use is a usage error naming the command and its flags. Also: where a
// subcommand may stand among the flags, and the exit codes.

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
)

// Exit codes, part of the CLI's contract (see usage).
const (
	exitOK    = 0 // done; for healthcheck: the worker is ready
	exitError = 1 // an error; inspect: the key is unknown; replay: a dead letter was refused; healthcheck: not ready
	exitUsage = 2 // the command line is wrong: unknown subcommand or flag, a bad flag value, wrong arguments
)

// usageError is an error in the command line: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// exitCode is the exit status of run's error.
func exitCode(err error) int {
	var u usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.As(err, &u):
		return exitUsage
	}
	return exitError
}

// options are one command's flags and positional arguments.
type options interface {
	// flags registers the flags the command uses, and only those.
	flags(fs *flagSet)
	// validate takes the positional arguments and checks the options without
	// I/O; its error is a usage error.
	validate(args []string) error
}

// secretHolder is options holding credentials that may be given as files (the
// -file flags); they are read after validate.
type secretHolder interface{ secrets() []*secret }

// runner is a command, or a group of subcommands, with its options' type hidden.
type runner interface {
	// word is what selects it among its siblings ("list" of dead-letters).
	word() string
	// main parses args and runs.
	main(args []string, getenv func(string) string, stdout, stderr io.Writer) error
	// commands are the commands it holds, each with its flags, unparsed.
	commands(getenv func(string) string) []commandFlags
}

// commandFlags is a command's flags, for help, for finding a subcommand among
// flags, and for naming the commands that take a flag.
type commandFlags struct {
	path string // as typed after worker; empty for the service
	fs   *flagSet
}

// command is a subcommand: its options (type T, used through *T), its help, and
// what it does with them once they are valid.
type command[T any, O interface {
	*T
	options
}] struct {
	name  string // as typed after worker ("stats", "dead-letters list"); empty for the service
	usage string // the help above the list of flags
	run   func(o O, stdout, stderr io.Writer) error
}

// newCommand makes the command name: run's parameter is its options' type.
func newCommand[T any, O interface {
	*T
	options
}](name, usage string, run func(O, io.Writer, io.Writer) error) command[T, O] {
	return command[T, O]{name: name, usage: usage, run: run}
}

func (c command[T, O]) word() string {
	if i := strings.LastIndexByte(c.name, ' '); i >= 0 {
		return c.name[i+1:]
	}
	return c.name
}

func (c command[T, O]) flagSet(getenv func(string) string) (O, *flagSet) {
	o := O(new(T))
	fs := newFlagSet(commandName(c.name), getenv)
	o.flags(fs)
	return o, fs
}

func (c command[T, O]) commands(getenv func(string) string) []commandFlags {
	_, fs := c.flagSet(getenv)
	return []commandFlags{{c.name, fs}}
}

func (c command[T, O]) main(args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	o, err := c.parse(args, getenv, stderr)
	if err != nil {
		return err
	}
	return c.run(o, stdout, stderr)
}

// parse turns args into the command's options: flags, environment fallbacks,
// positional arguments, validated, with the secrets' files read. -h prints the
// help to stderr (and is flag.ErrHelp).
func (c command[T, O]) parse(args []string, getenv func(string) string, stderr io.Writer) (O, error) {
	o, fs := c.flagSet(getenv)
	rest, err := fs.parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprint(stderr, c.usage)
		fs.printDefaults(stderr)
		return nil, err
	case err != nil:
		return nil, usageError{flagError(c.name, fs, err, getenv)}
	}
	if err := fs.envErrors(); err != nil {
		return nil, usageError{err}
	}
	if err := o.validate(rest); err != nil {
		return nil, usageError{err}
	}
	if s, ok := any(o).(secretHolder); ok {
		if err := readSecretFiles(s.secrets()); err != nil {
			return nil, err
		}
	}
	return o, nil
}

// group is a command made of subcommands (dead-letters list|replay), or the
// worker itself, whose default is the service.
type group struct {
	name  string // as typed after worker; empty for the worker itself
	usage string // for -h, above each subcommand's flags; unused with a default
	subs  []runner
	dflt  runner // run when no subcommand is named; nil: one must be
}

func (g group) word() string { return g.name }

func (g group) commands(getenv func(string) string) []commandFlags {
	var all []commandFlags
	if g.dflt != nil {
		all = g.dflt.commands(getenv)
	}
	for _, s := range g.subs {
		all = append(all, s.commands(getenv)...)
	}
	return all
}

func (g group) words() []string {
	w := make([]string, len(g.subs))
	for i, s := range g.subs {
		w[i] = s.word()
	}
	return w
}

// want lists the subcommands for a message: "list or replay".
func (g group) want() string {
	w := g.words()
	if len(w) < 2 {
		return strings.Join(w, "")
	}
	return strings.Join(w[:len(w)-1], ", ") + " or " + w[len(w)-1]
}

func (g group) main(args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	name, rest := splitCommand(args, unionFlags(g.commands(getenv)), g.words())
	if name == "" {
		if g.dflt != nil {
			return g.dflt.main(rest, getenv, stdout, stderr)
		}
		if wantsHelp(args) {
			g.help(getenv, stderr)
			return flag.ErrHelp
		}
		return usagef("%s: want %s (see worker %s -h)", g.name, g.want(), g.name)
	}
	for _, s := range g.subs {
		if s.word() == name {
			return s.main(rest, getenv, stdout, stderr)
		}
	}
	if g.name == "" {
		return usagef("unknown subcommand %q (want one of %s; see worker -h)", name, strings.Join(g.words(), ", "))
	}
	return usagef("%s: unknown subcommand %q (want %s)", g.name, name, g.want())
}

// help prints the group's help, then each subcommand's flags.
func (g group) help(getenv func(string) string, w io.Writer) {
	fmt.Fprint(w, g.usage)
	for _, c := range g.commands(getenv) {
		fmt.Fprintf(w, "\nflags of %s:\n", commandName(c.path))
		c.fs.printDefaults(w)
	}
}

// commandName is a command as the user types it: "worker stats".
func commandName(path string) string {
	if path == "" {
		return "worker"
	}
	return "worker " + path
}

// wantsHelp reports whether args ask for help (before any "--").
func wantsHelp(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "-h", "-help", "--help":
			return true
		}
	}
	return false
}

// flagError rewrites the flag package's error for command path: a flag the
// command does not take is named with the commands that do take it, and the
// command's own flags are listed.
func flagError(path string, fs *flagSet, err error, getenv func(string) string) error {
	prefix := ""
	if path != "" {
		prefix = path + ": "
	}
	name, unknown := strings.CutPrefix(err.Error(), "flag provided but not defined: -")
	if !unknown {
		return fmt.Errorf("%s%w", prefix, err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s%v", prefix, err)
	var whose []string
	for _, c := range rootCommand().commands(getenv) {
		if c.fs.Lookup(name) == nil {
			continue
		}
		if c.path == "" {
			whose = append(whose, "worker (the service)")
		} else {
			whose = append(whose, commandName(c.path))
		}
	}
	if len(whose) > 0 {
		fmt.Fprintf(&b, "\n  --%s is a flag of: %s", name, strings.Join(whose, ", "))
	}
	var own []string
	fs.VisitAll(func(f *flag.Flag) { own = append(own, "--"+f.Name) })
	fmt.Fprintf(&b, "\n  %s takes: %s (see %s -h)", commandName(path), strings.Join(own, " "), commandName(path))
	return errors.New(b.String())
}

// unionFlags is every flag of cmds, to tell which flags take a value wherever
// they stand. A flag means the same in every command that takes it
// (TestFlagsAgreeAcrossCommands).
func unionFlags(cmds []commandFlags) *flag.FlagSet {
	u := flag.NewFlagSet("worker", flag.ContinueOnError)
	for _, c := range cmds {
		c.fs.VisitAll(func(f *flag.Flag) {
			if u.Lookup(f.Name) == nil {
				u.Var(f.Value, f.Name, f.Usage)
			}
		})
	}
	return u
}

// splitCommand finds the subcommand among args, which flags may precede and
// follow: `worker --database-url X stats` is `worker stats --database-url X`. fs
// says which flags take a value (`--schema stats` is a flag and its value, not
// the subcommand); a flag fs does not know is taken to have none. The first word
// that is not a flag or a flag's value is the subcommand, unless it is no known
// one and an unknown flag came before it: then there is none, and the flag
// parser reports that flag. "--" ends the search. The subcommand then parses
// every flag, before and after it, and refuses those it does not take.
func splitCommand(args []string, fs *flag.FlagSet, known []string) (cmd string, rest []string) {
	sawUnknown := false
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		if len(a) > 1 && a[0] == '-' {
			name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
			switch f := fs.Lookup(name); {
			case f == nil:
				sawUnknown = true
			case !hasValue && !isBoolFlag(f):
				i++ // its value
			}
			continue
		}
		if slices.Contains(known, a) || !sawUnknown {
			return a, append(slices.Clone(args[:i]), args[i+1:]...)
		}
		break
	}
	return "", args
}

func isBoolFlag(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// wantsVersion reports whether args ask for the version (before any "--").
func wantsVersion(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "--version", "-version", "--version=true", "-version=true":
			return true
		}
	}
	return false
}

// source is where a flag's value came from.
type source uint8

const (
	fromDefault source = iota
	fromEnv
	fromCommandLine
)

// sources says where each flag of a command got its value.
type sources map[string]source

// given reports whether the user gave flag name a value: on the command line or
// in its environment variable.
func (s sources) given(name string) bool { return s[name] != fromDefault }

// onCommandLine reports whether flag name was given on the command line.
func (s sources) onCommandLine(name string) bool { return s[name] == fromCommandLine }

// flagSet is one command's flags. Each flag but --version falls back to an
// environment variable, read here and nowhere else: when the variable is set it
// is the flag's default, shown as such by -h.
type flagSet struct {
	*flag.FlagSet
	getenv func(string) string
	envOf  map[string]string // each flag's environment variable
	src    sources
	envErr map[string]error // variables whose value does not parse, by flag
}

func newFlagSet(name string, getenv func(string) string) *flagSet {
	fs := &flagSet{FlagSet: flag.NewFlagSet(name, flag.ContinueOnError), getenv: getenv,
		envOf: map[string]string{}, src: sources{}, envErr: map[string]error{}}
	// The errors and the help are the command's to print (command.main).
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	// Handled before any parsing (wantsVersion), by every command.
	fs.Bool("version", false, "print the version and exit")
	return fs
}

// fallback reads flag name's environment variable: when set (not empty), set
// gives the flag its default from it. A value set refuses is an error unless the
// flag is given on the command line (envErrors).
func (fs *flagSet) fallback(name, envVar string, set func(string) error) {
	fs.envOf[name] = envVar
	v := fs.getenv(envVar)
	if v == "" {
		return
	}
	fs.src[name] = fromEnv
	if err := set(v); err != nil {
		fs.envErr[name] = fmt.Errorf("%s: %w", envVar, err)
	}
}

// stringVar registers a string flag falling back to envVar, then def.
// The flag is registered before the variable is read, so that -h shows the
// default and never the variable's value (a token, a password).
func (fs *flagSet) stringVar(p *string, name, envVar, def, usage string) {
	fs.StringVar(p, name, def, usage)
	fs.fallback(name, envVar, func(v string) error { *p = v; return nil })
}

// boolVar registers a switch falling back to envVar: on says which of the
// variable's values turn it on.
func (fs *flagSet) boolVar(p *bool, name, envVar string, on func(string) bool, usage string) {
	fs.BoolVar(p, name, false, usage)
	fs.fallback(name, envVar, func(v string) error { *p = on(v); return nil })
}

// valueVar registers a flag of its own type falling back to envVar, which is
// parsed as the flag is.
func (fs *flagSet) valueVar(v flag.Value, name, envVar, usage string) {
	fs.Var(v, name, usage)
	fs.fallback(name, envVar, v.Set)
}

// Two readings of a switch's environment variable (when set): each variable
// keeps the reading its users rely on.

// notOff: 0 and false are off, any other value on.
func notOff(v string) bool { return v != "0" && v != "false" }

// anyValue: any value is on.
func anyValue(string) bool { return true }

// parse parses args, in which flags may follow positional arguments
// (`worker inspect KEY --scope acme`), and returns the positional ones. "--" ends
// the flags, for a key that starts with "-".
func (fs *flagSet) parse(args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			positional = append(positional, rest...)
			break
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
	fs.Visit(func(f *flag.Flag) { fs.src[f.Name] = fromCommandLine })
	return positional, nil
}

// envErrors are the environment variables that do not parse, of the flags not
// given on the command line (those override them).
func (fs *flagSet) envErrors() error {
	var errs []error
	for name, err := range fs.envErr {
		if !fs.src.onCommandLine(name) {
			errs = append(errs, err)
		}
	}
	sort.Slice(errs, func(i, j int) bool { return errs[i].Error() < errs[j].Error() })
	return errors.Join(errs...)
}

func (fs *flagSet) printDefaults(w io.Writer) {
	fs.SetOutput(w)
	defer fs.SetOutput(io.Discard)
	fs.PrintDefaults()
}
