package relay

import (
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// A key's want holds its streams' sets, not counts of their names; what it
// reports must still be what counting names gives: the union, and, on
// each change, the names no stream wanted before. Streams move between
// sets drawn from a few names (alike often, as a key's Envoys are), and
// the want is checked against the counts after every move.
func TestTypeWantIsTheUnionOfStreams(t *testing.T) {
	var sets xds.NameSets
	universe := []string{"a", "b", "c", "d", "e"}
	rng := rand.New(rand.NewPCG(1, 2))
	randomSet := func() xds.NameSet {
		var names []string
		for _, n := range universe {
			if rng.IntN(3) > 0 {
				names = append(names, n)
			}
		}
		return sets.Intern(xds.NewNameSet(names))
	}
	var w typeWant
	streams := make([]xds.NameSet, 6)
	counts := map[string]int{}
	for step := range 2000 {
		i := rng.IntN(len(streams))
		before, after := streams[i], randomSet()
		if rng.IntN(4) == 0 {
			after = streams[rng.IntN(len(streams))] // alike
		}
		var want []string
		for _, n := range after {
			if counts[n] == 0 && !before.Has(n) {
				want = append(want, n)
			}
		}
		for _, n := range after {
			counts[n]++
		}
		for _, n := range before {
			if counts[n]--; counts[n] == 0 {
				delete(counts, n)
			}
		}
		var fresh []string
		if !sameSet(before, after) {
			fresh = w.add(after)
			w.remove(before)
		}
		streams[i] = after
		if !slices.Equal(fresh, want) {
			t.Fatalf("step %d: %v → %v: fresh = %v, want %v", step, before, after, fresh, want)
		}
		if got, want := w.names(), slices.Sorted(maps.Keys(counts)); !slices.Equal(got, xds.NameSet(want)) {
			t.Fatalf("step %d: names() = %v, want %v", step, got, want)
		}
		distinct := 0
		for j, s := range streams {
			if len(s) > 0 && !slices.ContainsFunc(streams[:j], func(o xds.NameSet) bool { return sameSet(o, s) }) {
				distinct++
			}
		}
		if len(w.sets) != distinct || (distinct <= 1) != (w.counts == nil) {
			t.Fatalf("step %d: %d sets held (counts %v), want %d (the streams' distinct sets)", step, len(w.sets), w.counts != nil, distinct)
		}
	}
}
