package divergence

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// every is the relay's default interval between a key's checks
// (relay.Config.Keys.DivergenceInterval).
const every = 10 * time.Minute

func draw(d time.Duration) time.Duration { return rand.N(d) }

// TestSplitRecheckedSoonThenLessOften: a key of a node of its own since a
// split is checked again within splitRecheck, not at a random point of the
// whole interval (a split made during a fault is merged back soon after
// it ends), and then less and less often while the split is proven
// again, up to the interval; a re-check without an answer keeps the pace.
func TestSplitRecheckedSoonThenLessOften(t *testing.T) {
	var s Schedule[string]
	m := "envoy-0"
	members := []string{m}
	local := func(string) bool { return true }
	start := time.Now()
	if _, ok := s.RecheckDue(start, every, members, local, draw); !ok { // the first tick after the split draws the first re-check's time
		if _, ok := s.RecheckDue(start.Add(splitRecheck+time.Nanosecond), every, members, local, draw); !ok {
			t.Fatalf("first re-check not due %v after the split", splitRecheck)
		}
	}
	for _, step := range []struct {
		proven bool
		wait   time.Duration
	}{
		{true, splitRecheck}, {true, 2 * splitRecheck}, {false, 4 * splitRecheck}, {false, 4 * splitRecheck},
		{true, 4 * splitRecheck}, {true, 8 * splitRecheck}, {true, 16 * splitRecheck}, {true, every}, {true, every},
	} {
		at := time.Now()
		s.RecheckDone(m, step.proven, every, at)
		if _, ok := s.RecheckDue(at.Add(step.wait-time.Second), every, members, local, draw); ok {
			t.Fatalf("re-check due before %v", step.wait)
		}
		if _, ok := s.RecheckDue(at.Add(step.wait+time.Second), every, members, local, draw); !ok {
			t.Fatalf("re-check not due after %v", step.wait)
		}
	}
}

// TestDue walks a key's schedule: the member that made the key aggregated
// is checked at once; then, each turn, the members in join order that may
// be checked, round after round; one check at a time; a check that could
// not run keeps its member first; and members that come to subscribe to
// more make the key due at once, from its first member again.
func TestDue(t *testing.T) {
	var s Schedule[string]
	start := time.Now()
	members := []string{"a", "b", "c", "relay"}
	clusters := map[string]bool{xds.TypeCluster: true}
	due := dueOf(&s, members, func(m string) bool { return m != "relay" }, true)
	s.Soon("b")
	if m := due(start, clusters); m != "b" {
		t.Fatalf("Due at the second member's join = %q, want b", m)
	}
	if m := due(start, clusters); m != "" {
		t.Fatalf("Due while a check runs = %q, want none", m)
	}
	s.Done("b", start.Add(every), clusters)
	if m := due(start.Add(every/2), clusters); m != "" {
		t.Fatalf("Due before the key's turn = %q, want none", m)
	}
	turn := start.Add(every)
	for _, want := range []string{"a", "c", "a", "b"} { // b was checked this round already
		if m := due(turn, clusters); m != want {
			t.Fatalf("Due at %v = %q, want %q", turn.Sub(start), m, want)
		}
		turn = turn.Add(every)
		s.Done(want, turn, clusters)
	}
	if m := due(turn, clusters); m != "c" {
		t.Fatalf("Due = %q, want c", m)
	}
	s.Later("c") // no check slot
	if m := due(turn, clusters); m != "c" {
		t.Fatalf("Due after Later = %q, want c again", m)
	}
	turn = turn.Add(every)
	s.Done("c", turn, clusters)
	grown := map[string]bool{xds.TypeCluster: true, xds.TypeListener: false}
	if m := due(turn.Add(-every/2), grown); m != "a" {
		t.Fatalf("Due once the members want listeners = %q, want a, the first", m)
	}
	s.Done("a", turn.Add(every), grown)
	s.Soon("b")
	s.Forget("b") // b leaves before its check
	if m := due(turn, grown); m != "" {
		t.Fatalf("Due after b left = %q, want none", m)
	}
}

// TestDueInTurnOnly: a relay fed by the key's owner (Due without atOnce)
// checks its members in turn only: neither the member that made the key
// aggregated nor members subscribing to more bring the turn forward, and
// the latter start the round over.
func TestDueInTurnOnly(t *testing.T) {
	var s Schedule[string]
	start := time.Now()
	clusters := map[string]bool{xds.TypeCluster: true}
	grown := map[string]bool{xds.TypeCluster: true, xds.TypeListener: false}
	due := dueOf(&s, []string{"a", "b", "c"}, func(string) bool { return true }, false)
	s.Soon("b")
	if m := due(start, clusters); m != "" {
		t.Fatalf("Due at the second member's join = %q, want none before the key's turn", m)
	}
	turn := start.Add(every/2 + time.Nanosecond) // half's draw
	if m := due(turn, clusters); m != "a" {
		t.Fatalf("Due at the key's turn = %q, want a, the first", m)
	}
	s.Done("a", turn.Add(every), clusters)
	if m := due(turn.Add(every/2), grown); m != "" {
		t.Fatalf("Due once the members want listeners = %q, want none before the key's turn", m)
	}
	if m := due(turn.Add(every), grown); m != "a" {
		t.Fatalf("Due at the next turn = %q, want a: the round starts over", m)
	}
}

// dueOf returns s.Due over members for a time and what they want: the
// member to check, or "" for none. The key's first turn is drawn at half
// the interval.
func dueOf(s *Schedule[string], members []string, candidate func(string) bool, atOnce bool) func(time.Time, map[string]bool) string {
	half := func(d time.Duration) time.Duration { return d / 2 }
	return func(now time.Time, wanted map[string]bool) string {
		m, _ := s.Due(now, every, members, wanted, candidate, atOnce, half)
		return m
	}
}
