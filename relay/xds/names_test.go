package xds

import (
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
)

// TestNameSetMergesAsSorting: With and Union, which merge sorted sets,
// give what sorting everything would (With keeps a name both added and
// removed), and Union hands back its receiver when the other set adds
// nothing.
func TestNameSetMergesAsSorting(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	draw := func() []string {
		out := make([]string, rng.IntN(12))
		for i := range out {
			out[i] = strconv.Itoa(rng.IntN(20))
		}
		return out
	}
	for range 5000 {
		s, added, removed := NewNameSet(draw()), draw(), draw()
		naive := slices.Clone(added) // a name added and removed stays
		for _, n := range s {
			if !slices.Contains(removed, n) {
				naive = append(naive, n)
			}
		}
		if got, want := s.With(added, removed), NewNameSet(naive); !slices.Equal(got, want) {
			t.Fatalf("%v.With(%q, %q) = %v, want %v", s, added, removed, got, want)
		}
		u := NewNameSet(added)
		got, want := s.Union(u), NewNameSet(append(slices.Clone([]string(s)), added...))
		if !slices.Equal(got, want) {
			t.Fatalf("%v.Union(%v) = %v, want %v", s, u, got, want)
		}
		if adds := len(want) > len(s); !adds && len(s) > 0 && &got[0] != &s[0] {
			t.Fatalf("%v.Union(%v) copied the receiver though nothing was added", s, u)
		}
	}
}

func TestSotWResourceNames(t *testing.T) {
	for _, tc := range []struct {
		wildcard, named bool
		names           []string
		want            []string
	}{
		{true, false, nil, nil},                          // the legacy wildcard
		{true, true, nil, []string{"*"}},                 // once named, "*" says it
		{true, false, []string{"a"}, []string{"*", "a"}}, // wildcard and names
		{false, true, []string{"a"}, []string{"a"}},
		{false, false, nil, nil}, // nothing asked
	} {
		if got := SotWResourceNames(tc.wildcard, tc.names, tc.named); !slices.Equal(got, tc.want) {
			t.Errorf("SotWResourceNames(%v, %q, %v) = %q, want %q", tc.wildcard, tc.names, tc.named, got, tc.want)
		}
	}
}
