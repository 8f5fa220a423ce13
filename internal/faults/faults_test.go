package faults

import (
	"context"
	"errors"
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
	for _, p := range []Point{ConsumerAfterCommit, RelayAfterPublish, SkipInboxClaim} {
		if !s.Armed(p) {
			t.Errorf("%s not armed", p)
		}
	}
	if s.Armed(EffectBeforeCommit) {
		t.Error("unnamed point armed")
	}
	if !s.On(SkipInboxClaim) || s.On(ConsumerAfterCommit) {
		t.Error("On reports the wrong switches")
	}
	var none *Set
	if err := none.Hit(context.Background(), ConsumerAfterCommit, nil); err != nil || none.On(SkipInboxClaim) {
		t.Error("the nil set is not inert")
	}
	for _, bad := range []string{
		"x", "=kill", "p=kill", // unknown point
		"consumer.after-commit=explode", "consumer.after-commit=kill@0", "consumer.after-commit=kill@x",
		"consumer.after-commit=on", "consumer.skip-inbox-claim=kill",
	} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) accepted", bad)
		}
	}
	if _, err := Parse("consumer.aftercommit=kill"); err == nil || !strings.Contains(err.Error(), "unknown point") {
		t.Errorf("a misspelt point: err = %v, want it named unknown", err)
	}
}

func TestContextCarriesTheSet(t *testing.T) {
	ctx := context.Background()
	if From(ctx) != nil || From(With(ctx, nil)) != nil {
		t.Fatal("a plain context carries a set")
	}
	boom := errors.New("died here")
	var got []string
	s := New().Func(RelayAfterPublish, func(_ context.Context, keys []string) error { got = keys; return boom })
	if err := From(With(ctx, s)).Hit(ctx, RelayAfterPublish, []string{"k1"}); !errors.Is(err, boom) || len(got) != 1 {
		t.Fatalf("Hit = %v, keys %v", err, got)
	}
	if err := s.Hit(ctx, ConsumerAfterCommit, nil); err != nil {
		t.Fatalf("an unarmed point returned %v", err)
	}
}

// A kill point really kills the process, on the n-th hit and not before.
func TestHitKillsOnTheNthHit(t *testing.T) {
	if os.Getenv("FAULTS_CHILD") == "1" {
		s, _ := FromEnv()
		ctx := context.Background()
		_ = s.Hit(ctx, ConsumerAfterCommit, nil)
		os.Stdout.WriteString("survived first hit\n")
		_ = s.Hit(ctx, ConsumerAfterCommit, nil)
		os.Stdout.WriteString("survived second hit\n")
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run=TestHitKillsOnTheNthHit")
	cmd.Env = append(os.Environ(), "FAULTS_CHILD=1", EnvVar+"="+string(ConsumerAfterCommit)+"=kill@2")
	out, err := cmd.Output()
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("child was not killed: err=%v out=%q", err, out)
	}
	if !strings.Contains(string(out), "survived first hit") || strings.Contains(string(out), "survived second hit") {
		t.Fatalf("child output %q: want death exactly at the second hit", out)
	}
}

func TestMarkedMessages(t *testing.T) {
	var none *Set
	none.Marked("panic") // inert without the switch
	New().Marked("panic")
	s := New().Switch(MarkedMessages)
	s.Marked("")      // unmarked messages pass
	s.Marked("other") // unknown marks pass
	defer func() {
		if v := recover(); v == nil {
			t.Fatal("a message marked panic did not panic")
		}
	}()
	s.Marked("panic")
}
