package install

import (
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

func TestBothObservers(t *testing.T) {
	t.Parallel()
	if both(nil, nil) != nil {
		t.Fatal("both of nothing is not nil")
	}
	var got []string
	a := func(e idem.Event) { got = append(got, "a:"+string(e.Outcome)) }
	b := func(e idem.Event) { got = append(got, "b:"+string(e.Outcome)) }
	both(a, nil).Observe(idem.Event{Outcome: "1"})
	both(nil, b).Observe(idem.Event{Outcome: "2"})
	both(a, b).Observe(idem.Event{Outcome: "3"})
	idem.Observer(nil).Observe(idem.Event{}) // a nil observer is inert
	if s := strings.Join(got, ","); s != "a:1,b:2,a:3,b:3" {
		t.Fatalf("calls = %s", s)
	}
}
