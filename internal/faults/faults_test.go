package faults

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	s, err := Parse("consumer.after-commit=kill@3, relay.after-publish=exit,consumer.skip-inbox-claim=on")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{ConsumerAfterCommit, RelayAfterPublish, SkipInboxClaim} {
		if !s.Armed(p) {
			t.Errorf("%s not armed", p)
		}
	}
	if s.Armed(EffectBeforeCommit) {
		t.Error("unnamed point armed")
	}
	var none *Set
	none.Hit(ConsumerAfterCommit) // the nil set is inert
	for _, bad := range []string{"x", "=kill", "p=explode", "p=kill@0", "p=kill@x"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) accepted", bad)
		}
	}
}

// A kill point really kills the process, on the n-th hit and not before.
func TestHitKillsOnTheNthHit(t *testing.T) {
	if os.Getenv("FAULTS_CHILD") == "1" {
		s, _ := FromEnv()
		s.Hit(ConsumerAfterCommit)
		os.Stdout.WriteString("survived first hit\n")
		s.Hit(ConsumerAfterCommit)
		os.Stdout.WriteString("survived second hit\n")
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run=TestHitKillsOnTheNthHit")
	cmd.Env = append(os.Environ(), "FAULTS_CHILD=1", EnvVar+"="+ConsumerAfterCommit+"=kill@2")
	out, err := cmd.Output()
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("child was not killed: err=%v out=%q", err, out)
	}
	if !strings.Contains(string(out), "survived first hit") || strings.Contains(string(out), "survived second hit") {
		t.Fatalf("child output %q: want death exactly at the second hit", out)
	}
}
