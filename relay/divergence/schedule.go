// Package divergence is the divergence check (DESIGN.md, "The data path"
// 2): whether a key's members really get the same config from the
// upstream. A key is a promise that the upstream gives its members the
// same config. The relay that holds a key's upstream stream tests the
// promise now and then: it opens a second upstream stream presenting
// another member's node, asks it what the key's stream asks, and compares
// the two by content. A difference that outlasts the upstream's churn
// means the key's profile is too coarse for this mesh: the relay splits
// the key (aggkey.Split), and the diverging member and its look-alikes
// move to keys of their own, while the rest stay aggregated.
//
// This package owns the check's parts that need nothing of the relay's:
// the schedule per key (Schedule: which member is due, and when), and one
// check's run (Prober.Check: the second stream, opened with
// relay/adsclient, compared with the key's views until the answers agree
// or differ the same way for long enough). It imports nothing of package
// relay: the relay offers a key as a Key and lends its upstream as a
// Prober, and keeps what needs its internals: the loop over its keys, the
// check slots, asking a key's owner, and the splits a check finds.
//
// The cost is bounded: one check per key at a time (Schedule marks it
// running), as many per relay as it has check slots, each opened at the
// upstream's pace (Prober.Pace) and ended after CheckFor at most.
package divergence

import (
	"slices"
	"time"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// splitRecheck is the first wait before a split is checked again. A split
// made during a fault (a frozen or slow peer, an upstream stream behind)
// may not hold once the fault ends: rechecked soon, and then less and less
// often while it is proven again, it is merged back within about a minute
// of the fault's end rather than at the next interval, and a split that
// holds costs a few checks more (issue 28: one a seed of fifty kept a key
// at two upstream streams to the run's end).
const splitRecheck = 30 * time.Second

// Schedule is a key's divergence check state: when the key is checked
// next, which of its members, and whether a check runs. M is the key's
// member as its owner knows it.
//
// A Schedule is not safe for concurrent use: its key holds it under the
// lock that guards the key's members, and calls it with that lock held,
// so that what it is told of the members is what they are. Its zero
// value is ready to use. Time is passed in (now), never read: the caller
// reads the clock, and a test passes the times it means.
type Schedule[M comparable] struct {
	// next is when the key is checked next; zero until it first has two
	// members.
	next time.Time
	// soon is a member to check at once: the second to join.
	soon M
	// running is set while a check of the key runs.
	running bool
	// checked holds the members checked since the key last went round.
	checked map[M]bool
	// compared is what the members subscribed to (by type, whether whole)
	// when the last check began: a check answers for those types only.
	// When the members come to subscribe to more (an Envoy asks for
	// listeners once it holds clusters), the key is due again, and its
	// members are checked again from the first.
	compared map[string]bool
	// recheck is, for a key of a node of its own since a split, the wait
	// before its next re-check (RecheckDue): splitRecheck at first,
	// doubled each time the split is proven again, up to the interval.
	recheck time.Duration
}

// Due reports whether the key's check is due at now, every being the
// interval between a member's checks, and the member to check: with
// atOnce, the one Soon named, if still among members and a candidate;
// else once the key's turn has come the first candidate not yet checked
// this round. members are the key's members in join order, wanted what
// they subscribe to (by type, whether whole), and candidate says whether
// a member may be checked. The caller has found the key comparable (two
// members, a presented node, Comparable views). draw returns a random
// wait in [0, d): the key's first turn is drawn at random in the
// interval. Due marks the check running; Done or Later ends it.
//
// Without atOnce, neither Soon nor members subscribing to more bring the
// key's turn forward: a relay fed by the key's owner leaves that to the
// owner, whose checks cost the upstream as much as one more Envoy each.
func (s *Schedule[M]) Due(now time.Time, every time.Duration, members []M, wanted map[string]bool,
	candidate func(M) bool, atOnce bool, draw func(d time.Duration) time.Duration) (M, bool) {
	var none M
	if s.running {
		return none, false
	}
	if s.next.IsZero() {
		s.next = now.Add(draw(every) + time.Nanosecond)
	}
	if s.compared != nil && wantGrew(wanted, s.compared) {
		s.compared = nil
		clear(s.checked)
		if atOnce {
			s.next = now
		}
	}
	pick, found := none, false
	if atOnce && s.soon != none && slices.Contains(members, s.soon) && candidate(s.soon) {
		pick, found = s.soon, true
	} else if !now.Before(s.next) {
		for round := 0; round < 2 && !found; round++ {
			for _, m := range members {
				if !s.checked[m] && candidate(m) {
					pick, found = m, true
					break
				}
			}
			if !found {
				clear(s.checked) // every member was checked: go round again
			}
		}
	}
	s.soon = none
	if !found {
		return none, false
	}
	s.running = true
	return pick, true
}

// RecheckDue reports whether it is time to check again that a member of
// a key of a node of its own since a split is given other config than
// the key it left, and which: the first of members that local accepts
// (an Envoy of this relay's; another relay checks its own). The re-check
// comes soon after the split, at a random point of splitRecheck (or of
// every if shorter: draw as for Due), then after each RecheckDone's
// wait. It marks the check running; RecheckDone ends it.
func (s *Schedule[M]) RecheckDue(now time.Time, every time.Duration, members []M,
	local func(M) bool, draw func(d time.Duration) time.Duration) (M, bool) {
	var none M
	if s.running {
		return none, false
	}
	i := slices.IndexFunc(members, local)
	if i < 0 {
		return none, false // its Envoy is at another relay, which checks it
	}
	if s.recheck == 0 {
		s.recheck = min(every, splitRecheck)
	}
	if s.next.IsZero() {
		s.next = now.Add(draw(s.recheck) + time.Nanosecond)
	}
	if now.Before(s.next) {
		return none, false
	}
	s.running = true
	return members[i], true
}

// RecheckDone ends the re-check of m that RecheckDue began, at now: the
// next comes a wait later, the same wait if the re-check had no answer,
// and twice as long next time (up to every) if the split was proven
// again. (Merged back, the key is left and its Schedule goes with it.)
func (s *Schedule[M]) RecheckDone(m M, proven bool, every time.Duration, now time.Time) {
	wait := s.recheck
	if proven {
		s.recheck = min(2*s.recheck, every)
	}
	s.Done(m, now.Add(wait), nil)
}

// Soon makes m the member checked at the next Due, whatever the key's
// turn: the member that made the key aggregated is checked at once.
func (s *Schedule[M]) Soon(m M) { s.soon = m }

// Later ends the running check of m, which could not run (no check slot,
// or the owner busy): m is checked first at the next Due, as the member
// that just joined is, instead of losing its turn until the next round.
func (s *Schedule[M]) Later(m M) {
	var none M
	s.running = false
	if s.soon == none {
		s.soon = m
	}
}

// Start marks a check of the key running unless one runs, and reports
// whether it did: for a check another relay asked for, ended by End.
func (s *Schedule[M]) Start() bool {
	if s.running {
		return false
	}
	s.running = true
	return true
}

// End ends a running check that was of no member of the key (Start's).
func (s *Schedule[M]) End() { s.running = false }

// Done ends the running check of m, a member: m counts as checked this
// round, the key's next turn is at next, and compared is what the
// members subscribed to when the check began (the types it answers for;
// nil: none).
func (s *Schedule[M]) Done(m M, next time.Time, compared map[string]bool) {
	s.running = false
	if s.checked == nil {
		s.checked = make(map[M]bool)
	}
	s.checked[m] = true
	s.next = next
	s.compared = compared
}

// Forget drops m as it leaves the key.
func (s *Schedule[M]) Forget(m M) {
	delete(s.checked, m)
	if s.soon == m {
		var none M
		s.soon = none
	}
}

// wantGrew reports whether now holds a cached type before lacked, or one
// before wanted by name that now is wanted whole.
func wantGrew(now, before map[string]bool) bool {
	for typeURL, wildcard := range now {
		if was, ok := before[typeURL]; xds.Cached(typeURL) && (!ok || wildcard && !was) {
			return true
		}
	}
	return false
}
