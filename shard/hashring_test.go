package shard

import (
	"fmt"
	"math"
	"testing"
)

func members(names ...string) []Member {
	out := make([]Member, len(names))
	for i, n := range names {
		out[i] = Member{Name: n, XDSAddr: n + ":15010"}
	}
	return out
}

func relayNames(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("meshrelay-%d-%08x", i, uint32(i)*2654435761)
	}
	return out
}

func testKeys(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("istio/%016x", uint64(i)*0x9e3779b97f4a7c15)
	}
	return out
}

// moved returns the fraction of keys whose owner differs between a and b,
// and how many of the movers did not involve the member added or removed.
func moved(t *testing.T, a, b *hashRing, keys []string, changed string) (frac float64, bystanders int) {
	t.Helper()
	n := 0
	for _, k := range keys {
		x, y := a.locate(k).Name, b.locate(k).Name
		if x != y {
			n++
			if x != changed && y != changed {
				bystanders++
			}
		}
	}
	return float64(n) / float64(len(keys)), bystanders
}

func mustRing(t *testing.T, ms []Member, partitions int, load float64) *hashRing {
	t.Helper()
	h, err := newHashRing(ms, partitions, load)
	if err != nil {
		t.Fatalf("newHashRing: %v", err)
	}
	return h
}

// TestAddRemoveMovesFewKeys is the bound: adding one relay to 4
// moves at most ~2× the ideal 1/5 of keys; removing one moves its keys plus
// a bounded extra.
func TestAddRemoveMovesFewKeys(t *testing.T) {
	keys := testKeys(1000)
	names := relayNames(5)
	def := DefaultConfig()
	four := mustRing(t, members(names[:4]...), def.Partitions, def.Load)
	five := mustRing(t, members(names...), def.Partitions, def.Load)

	added, _ := moved(t, four, five, keys, names[4])
	if ideal := 1.0 / 5; added > 2*ideal {
		t.Errorf("adding a 5th relay moved %.3f of keys, want at most 2 × %.3f", added, ideal)
	}
	owned := 0
	for _, k := range keys {
		if five.locate(k).Name == names[4] {
			owned++
		}
	}
	// Removing it again: its keys move, plus what bounded load reshuffles.
	frac, bystanders := moved(t, five, four, keys, names[4])
	if got, own := frac*float64(len(keys)), float64(owned); got < own || got > 2*own {
		t.Errorf("removing a relay that owned %d keys moved %.0f, want %d to %d", owned, got, owned, 2*owned)
	}
	t.Logf("add 5th: moved %.3f (ideal 0.200); remove it: moved %.3f, %d keys of them between bystanders", added, frac, bystanders)
}

// TestMovedFraction measures, for tiers of 3 to 50 relays, the fraction of
// keys that move when one relay is added, against the ideal 1/(n+1). It is
// the measurement behind DefaultConfig's Partitions and Load; run with -v to
// see the table.
func TestMovedFraction(t *testing.T) {
	keys := testKeys(1000)
	def := DefaultConfig()
	for _, p := range []int{271, def.Partitions, 4099} {
		worst := 0.0
		for n := 3; n <= 50; n++ {
			names := relayNames(n + 1)
			a := mustRing(t, members(names[:n]...), p, def.Load)
			b := mustRing(t, members(names...), p, def.Load)
			frac, _ := moved(t, a, b, keys, names[n])
			worst = math.Max(worst, frac*float64(n+1))
		}
		t.Logf("partitions %5d, load %.2f: worst moved/ideal over 3..50 relays = %.2f", p, def.Load, worst)
		if p == def.Partitions && worst > 2 {
			t.Errorf("default partitions: worst moved/ideal = %.2f, want ≤ 2", worst)
		}
	}
}

func TestLocateIsDeterministic(t *testing.T) {
	names := relayNames(7)
	a := mustRing(t, members(names...), 271, 1.25)
	rev := members(names...)
	for i, j := 0, len(rev)-1; i < j; i, j = i+1, j-1 {
		rev[i], rev[j] = rev[j], rev[i]
	}
	b := mustRing(t, rev, 271, 1.25)
	for _, k := range testKeys(500) {
		if x, y := a.locate(k).Name, b.locate(k).Name; x != y {
			t.Fatalf("locate(%q) = %q in one order, %q in another", k, x, y)
		}
	}
}

// TestBoundedLoad: no relay owns more than its bounded share of partitions.
func TestBoundedLoad(t *testing.T) {
	for _, n := range []int{1, 3, 10, 50} {
		h := mustRing(t, members(relayNames(n)...), 271, 1.25)
		limit := math.Ceil(271.0 / float64(n) * 1.25)
		for name, load := range h.c.LoadDistribution() {
			if load > limit {
				t.Errorf("%d relays: %s owns %v partitions, bound %v", n, name, load, limit)
			}
		}
	}
}

// TestRingInputsNeverPanic: what consistent would panic on is an error here.
func TestRingInputsNeverPanic(t *testing.T) {
	for _, tc := range []struct {
		name       string
		members    []Member
		partitions int
		load       float64
	}{
		{"load below 1", members(relayNames(3)...), 271, 0.5},
		{"load NaN", members(relayNames(3)...), 271, math.NaN()},
		{"load infinite", members(relayNames(3)...), 271, math.Inf(1)},
		{"no partitions", members(relayNames(3)...), 0, 1.25},
		{"negative partitions", members(relayNames(3)...), -5, 1.25},
		{"no members", nil, 271, 1.25},
		{"empty name", []Member{{Name: ""}}, 271, 1.25},
		{"duplicate name", members("a", "a"), 271, 1.25},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if h, err := newHashRing(tc.members, tc.partitions, tc.load); err == nil {
				t.Fatalf("newHashRing = %v, nil; want an error", h)
			}
		})
	}
	// The smallest legal settings place every partition.
	h := mustRing(t, members(relayNames(50)...), 1, 1)
	if m := h.locate("k"); m.Name == "" {
		t.Fatal("locate on a 1-partition ring returned no member")
	}
}

func BenchmarkLocate(b *testing.B) {
	h, _ := newHashRing(members(relayNames(10)...), 271, 1.25)
	keys := testKeys(1024)
	b.ResetTimer()
	for i := range b.N {
		h.locate(keys[i&1023])
	}
}

func BenchmarkBuild(b *testing.B) {
	ms := members(relayNames(50)...)
	for range b.N {
		if _, err := newHashRing(ms, 271, 1.25); err != nil {
			b.Fatal(err)
		}
	}
}
