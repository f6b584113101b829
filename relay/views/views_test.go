package views_test

import (
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/xds"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

// TestMarkPendingCopiesOnWrite: marking names pending in a Set being
// built leaves the published Set (which shares its Types and Pending
// maps) as it was, marks only what the view lacks and what is not pending
// yet (keeping when it was first asked), and stores nothing when no name
// is new.
func TestMarkPendingCopiesOnWrite(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)
	b := ledger.Tree[*xds.Resource]{}.Edit()
	b.Set("held", ledger.HashBytes([]byte("held")), nil)
	published := &views.Set{Types: map[string]*views.Type{eds: {View: b.Tree(), Ready: true, Pending: map[string]time.Time{"old": t0}}}}

	next := &views.Set{Types: map[string]*views.Type{eds: published.Types[eds]}}
	next.MarkPending(eds, []string{"held", "old", "new"}, t0.Add(time.Second))
	got := next.Types[eds]
	if got == published.Types[eds] {
		t.Fatal("MarkPending changed the published Type in place")
	}
	if len(published.Types[eds].Pending) != 1 {
		t.Fatalf("the published Pending = %v, want only old: it is shared", published.Types[eds].Pending)
	}
	if at := got.Pending["old"]; !at.Equal(t0) {
		t.Errorf("old pending since %v, want %v: it was asked first then", at, t0)
	}
	if at, ok := got.Pending["new"]; !ok || !at.Equal(t0.Add(time.Second)) {
		t.Errorf("new pending = %v, %v; want since %v", at, ok, t0.Add(time.Second))
	}
	if _, ok := got.Pending["held"]; ok {
		t.Error("held is marked pending: the view holds it")
	}
	if !got.Ready || got.View.Root() != published.Types[eds].View.Root() {
		t.Error("MarkPending lost the rest of the Type")
	}

	again := &views.Set{Types: map[string]*views.Type{eds: got}}
	again.MarkPending(eds, []string{"held", "new"}, t0.Add(2*time.Second))
	if again.Types[eds] != got {
		t.Error("MarkPending stored a copy though no name was new")
	}
}

// TestIsPending: a name is pending for wait after it was asked, not after.
func TestIsPending(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)
	tv := &views.Type{Pending: map[string]time.Time{"a": t0}}
	for _, tc := range []struct {
		name string
		now  time.Time
		want bool
	}{
		{"a", t0.Add(14 * time.Second), true},
		{"a", t0.Add(15 * time.Second), false},
		{"b", t0, false},
	} {
		if got := tv.IsPending(tc.name, tc.now, 15*time.Second); got != tc.want {
			t.Errorf("IsPending(%q, +%v) = %v, want %v", tc.name, tc.now.Sub(t0), got, tc.want)
		}
	}
}

// TestTypeOf: a copy, to modify; an empty Type for a type not held.
func TestTypeOf(t *testing.T) {
	s := &views.Set{Types: map[string]*views.Type{eds: {Ready: true}}}
	c := s.TypeOf(eds)
	c.Full = true
	if s.Types[eds].Full {
		t.Error("TypeOf returned the published Type, not a copy")
	}
	if !c.Ready {
		t.Error("TypeOf's copy lost Ready")
	}
	if e := s.TypeOf("other"); e == nil || e.Ready || e.View.Len() != 0 {
		t.Errorf("TypeOf(other) = %+v, want an empty Type", e)
	}
}
