package natssubject_test

import (
	"errors"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/natssubject"
)

func TestValidateFilter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		s               string
		literal, filter bool
	}{
		{"orders.created", true, true},
		{"orders.>", false, true},
		{"orders.*.eu", false, true},
		{">", false, true},
		{"orders.>.x", false, false},
		{"", false, false},
		{"orders..created", false, false},
		{"orders created", false, false},
		{"orders.cre*ted", false, false},
		{"orders.\u00e9", false, false},
	} {
		if err := idem.ValidateSubject(tc.s); (err == nil) != tc.literal || (err != nil && !errors.Is(err, idem.ErrBadSubject)) {
			t.Errorf("Validate(%q) = %v, want ok=%v", tc.s, err, tc.literal)
		}
		if err := natssubject.ValidateFilter(tc.s); (err == nil) != tc.filter || (err != nil && !errors.Is(err, idem.ErrBadSubject)) {
			t.Errorf("ValidateFilter(%q) = %v, want ok=%v", tc.s, err, tc.filter)
		}
	}
}

func TestMatches(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		filter, subject string
		want            bool
	}{
		{"orders.>", "orders.created", true},
		{"orders.>", "orders.created.eu", true},
		{"orders.>", "orders", false},
		{"orders.*", "orders.created", true},
		{"orders.*", "orders.created.eu", false},
		{"orders.*.eu", "orders.created.eu", true},
		{"orders.created", "orders.created", true},
		{"orders.created", "orders.created.eu", false},
		{">", "anything.at.all", true},
		{"idem.>", "orders.created", false},
	} {
		if got := natssubject.Matches(tc.filter, tc.subject); got != tc.want {
			t.Errorf("Matches(%q, %q) = %v, want %v", tc.filter, tc.subject, got, tc.want)
		}
	}
	if !natssubject.Under([]string{"a.>", "orders.>"}, "orders.x") || natssubject.Under([]string{"a.>"}, "orders.x") {
		t.Error("Under")
	}
}
