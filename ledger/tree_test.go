package ledger

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func h(s string) Hash { return HashBytes([]byte(s)) }

// build makes a Tree from scratch, inserting in sorted name order.
func build(m map[string]Hash) Tree[int] {
	b := Tree[int]{}.Edit()
	for _, name := range slices.Sorted(maps.Keys(m)) {
		b.Set(name, m[name], 0)
	}
	return b.Tree()
}

func contents(t Tree[int]) map[string]Hash {
	out := map[string]Hash{}
	for e := range t.All() {
		out[e.Name] = e.Hash
	}
	return out
}

func TestEmpty(t *testing.T) {
	var z Tree[int]
	if got := z.Root(); got != EmptyRoot() {
		t.Fatalf("zero Tree Root() = %v, want EmptyRoot", got)
	}
	b := z.Edit()
	b.Set("a", h("1"), 0)
	b.Delete("a")
	if got := b.Tree().Root(); got != EmptyRoot() {
		t.Fatalf("Root() after set+delete = %v, want EmptyRoot", got)
	}
	if z.Len() != 0 {
		t.Fatalf("Len() = %d, want 0", z.Len())
	}
}

func TestRootIsContent(t *testing.T) {
	tests := []struct {
		name string
		a, b map[string]Hash
		same bool
	}{
		{"same pairs", map[string]Hash{"x": h("1"), "y": h("2")}, map[string]Hash{"y": h("2"), "x": h("1")}, true},
		{"different hash", map[string]Hash{"x": h("1")}, map[string]Hash{"x": h("2")}, false},
		{"different name", map[string]Hash{"x": h("1")}, map[string]Hash{"z": h("1")}, false},
		{"extra entry", map[string]Hash{"x": h("1")}, map[string]Hash{"x": h("1"), "y": h("1")}, false},
		{"swapped hashes", map[string]Hash{"x": h("1"), "y": h("2")}, map[string]Hash{"x": h("2"), "y": h("1")}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ra, rb := build(tt.a).Root(), build(tt.b).Root()
			if (ra == rb) != tt.same {
				t.Fatalf("Root(%v) == Root(%v) is %v, want %v", tt.a, tt.b, ra == rb, tt.same)
			}
		})
	}
}

// TestIncrementalEqualsRebuild is the property the relay depends on: any
// sequence of edits gives the Root a from-scratch build of the final content
// gives, Diff reports exactly the map difference, and earlier Trees are never
// changed by later edits.
func TestIncrementalEqualsRebuild(t *testing.T) {
	for seed := range uint64(40) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 7))
			universe := 1 + r.IntN(300)
			model := map[string]Hash{}
			tree := Tree[int]{}
			type version struct {
				tree  Tree[int]
				model map[string]Hash
			}
			var history []version
			for step := range 60 {
				b := tree.Edit()
				for range 1 + r.IntN(40) {
					name := fmt.Sprintf("outbound|80||svc-%d.ns.svc.cluster.local", r.IntN(universe))
					if r.IntN(3) == 0 {
						wasThere := b.Delete(name)
						if _, ok := model[name]; ok != wasThere {
							t.Fatalf("step %d: Delete(%q) = %v, model has it: %v", step, name, wasThere, ok)
						}
						delete(model, name)
					} else {
						hv := h(fmt.Sprint(r.IntN(5)))
						b.Set(name, hv, step)
						model[name] = hv
					}
				}
				next := b.Tree()
				if next.Len() != len(model) {
					t.Fatalf("step %d: Len() = %d, want %d", step, next.Len(), len(model))
				}
				if got, want := next.Root(), build(model).Root(); got != want {
					t.Fatalf("step %d: incremental Root() = %v, rebuild = %v", step, got, want)
				}
				if got := contents(next); !maps.Equal(got, model) {
					t.Fatalf("step %d: contents = %v, want %v", step, got, model)
				}
				checkDiff(t, tree, next, contents(tree), model)
				history = append(history, version{next, maps.Clone(model)})
				tree = next
			}
			for i, v := range history {
				if got := contents(v.tree); !maps.Equal(got, v.model) {
					t.Fatalf("version %d changed after later edits: %v, want %v", i, got, v.model)
				}
				if got, want := v.tree.Root(), build(v.model).Root(); got != want {
					t.Fatalf("version %d Root() = %v, want %v", i, got, want)
				}
			}
			// Diff between distant versions, both ways.
			if len(history) > 10 {
				a, b := history[3], history[len(history)-1]
				checkDiff(t, a.tree, b.tree, a.model, b.model)
				checkDiff(t, b.tree, a.tree, b.model, a.model)
			}
		})
	}
}

func checkDiff(t *testing.T, from, to Tree[int], fromM, toM map[string]Hash) {
	t.Helper()
	want := map[string][2]Hash{}
	for n, hv := range fromM {
		if toM[n] != hv {
			want[n] = [2]Hash{hv, toM[n]}
		}
	}
	for n, hv := range toM {
		if _, ok := fromM[n]; !ok {
			want[n] = [2]Hash{{}, hv}
		}
	}
	got := map[string][2]Hash{}
	Diff(from, to, func(c Change[int]) bool {
		if _, dup := got[c.Name]; dup {
			t.Fatalf("Diff reported %q twice", c.Name)
		}
		var pair [2]Hash
		if c.Old != nil {
			pair[0] = c.Old.Hash
		}
		if c.New != nil {
			pair[1] = c.New.Hash
		}
		got[c.Name] = pair
		return true
	})
	if !maps.Equal(got, want) {
		t.Fatalf("Diff = %d changes %v, want %d changes %v", len(got), got, len(want), want)
	}
}

func TestDiffOfSeparatelyBuiltEqualTreesIsEmpty(t *testing.T) {
	m := map[string]Hash{}
	for i := range 1000 {
		m[fmt.Sprint("c", i)] = h(fmt.Sprint(i))
	}
	a := build(m)
	b := Tree[int]{}.Edit()
	for i := 999; i >= 0; i-- {
		b.Set(fmt.Sprint("c", i), h(fmt.Sprint(i)), 1)
	}
	n := 0
	Diff(a, b.Tree(), func(Change[int]) bool { n++; return true })
	if n != 0 {
		t.Fatalf("Diff of equal content reported %d changes, want 0", n)
	}
}

// TestDiffAllocations: a Change's entries are Diff's own, reused, not one
// allocation per name (a client's first sync diffs the whole view).
func TestDiffAllocations(t *testing.T) {
	m := map[string]Hash{}
	for i := range 1000 {
		m[fmt.Sprint("c", i)] = h(fmt.Sprint(i))
	}
	a := build(m)
	n := 0
	allocs := testing.AllocsPerRun(10, func() {
		Diff(Tree[int]{}, a, func(c Change[int]) bool { n += len(c.New.Name); return true })
		Diff(a, Tree[int]{}, func(c Change[int]) bool { n += len(c.Old.Name); return true })
	})
	if allocs > 8 {
		t.Fatalf("two Diffs of 1000 names allocate %v times, want at most 8", allocs)
	}
}

func TestDiffStops(t *testing.T) {
	a := build(map[string]Hash{"a": h("1"), "b": h("1"), "c": h("1")})
	n := 0
	Diff(Tree[int]{}, a, func(Change[int]) bool { n++; return false })
	if n != 1 {
		t.Fatalf("Diff called fn %d times after it returned false, want 1", n)
	}
}

func TestGet(t *testing.T) {
	b := Tree[string]{}.Edit()
	b.Set("a", h("1"), "one")
	b.Set("b", h("2"), "two")
	tr := b.Tree()
	tests := []struct {
		name      string
		wantValue string
		wantOK    bool
	}{{"a", "one", true}, {"b", "two", true}, {"c", "", false}}
	for _, tt := range tests {
		e, ok := tr.Get(tt.name)
		if ok != tt.wantOK || e.Value != tt.wantValue {
			t.Errorf("Get(%q) = %q, %v; want %q, %v", tt.name, e.Value, ok, tt.wantValue, tt.wantOK)
		}
	}
}

func TestParseHash(t *testing.T) {
	hv := h("x")
	tests := []struct {
		in      string
		want    Hash
		wantErr bool
	}{
		{hv.String(), hv, false},
		{"", Hash{}, true},
		{"1", Hash{}, true},
		{hv.String()[:63] + "g", Hash{}, true},
		{"2026-11-30T10:00:00Z/42", Hash{}, true},
	}
	for _, tt := range tests {
		got, err := ParseHash(tt.in)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("ParseHash(%q) = %v, %v; want %v, err %v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func FuzzParseHash(f *testing.F) {
	f.Add(h("x").String())
	f.Add("")
	f.Add("zz")
	f.Fuzz(func(t *testing.T, s string) {
		hv, err := ParseHash(s)
		if err == nil && hv.String() != s && hv.String() != toLower(s) {
			t.Fatalf("ParseHash(%q) = %v, which prints differently", s, hv)
		}
	})
}

func toLower(s string) string {
	b := []byte(s)
	for i, c := range b {
		if 'A' <= c && c <= 'F' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

// FuzzTree applies an arbitrary edit script and checks the incremental Root
// against a rebuild.
func FuzzTree(f *testing.F) {
	f.Add([]byte{1, 2, 3, 0x81, 4, 5})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, script []byte) {
		model := map[string]Hash{}
		tree := Tree[int]{}
		b := tree.Edit()
		for i, op := range script {
			name := fmt.Sprint("r", op&0x3f)
			switch {
			case op&0x80 != 0:
				b.Delete(name)
				delete(model, name)
			default:
				hv := h(fmt.Sprint(op & 0x40))
				b.Set(name, hv, i)
				model[name] = hv
			}
			if i%5 == 4 {
				tree = b.Tree()
				b = tree.Edit()
			}
		}
		tree = b.Tree()
		if got, want := tree.Root(), build(model).Root(); got != want {
			t.Fatalf("Root() = %v, want %v for %v", got, want, model)
		}
	})
}
