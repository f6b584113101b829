package ledger

import (
	"fmt"
	"testing"
)

func benchTree(n int) Tree[int] {
	b := Tree[int]{}.Edit()
	for i := range n {
		b.Set(fmt.Sprintf("outbound|80||svc-%d.ns-%d.svc.cluster.local", i, i%10), h(fmt.Sprint(i)), i)
	}
	return b.Tree()
}

// BenchmarkBuild30k measures building the view of 30,000 resources from
// nothing (a cold start's cost per type).
func BenchmarkBuild30k(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		benchTree(30_000)
	}
}

// BenchmarkUpdateOneOf30k measures a new version after one resource changed:
// the per-change cost the relay pays on every upstream update.
func BenchmarkUpdateOneOf30k(b *testing.B) {
	t := benchTree(30_000)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		e := t.Edit()
		e.Set(fmt.Sprintf("outbound|80||svc-%d.ns-%d.svc.cluster.local", i%30_000, i%30_000%10), h(fmt.Sprint("v", i)), i)
		t = e.Tree()
		i++
	}
}

// BenchmarkDiffOneOf30k measures what one Envoy stream pays to find the one
// resource that changed in a 30,000-resource view.
func BenchmarkDiffOneOf30k(b *testing.B) {
	t := benchTree(30_000)
	e := t.Edit()
	e.Set("outbound|80||svc-7.ns-7.svc.cluster.local", h("new"), 0)
	u := e.Tree()
	b.ReportAllocs()
	for b.Loop() {
		n := 0
		Diff(t, u, func(Change[int]) bool { n++; return true })
		if n != 1 {
			b.Fatalf("Diff found %d changes, want 1", n)
		}
	}
}

// BenchmarkDiffAllOf30k is a client's first sync: every entry of a
// 30,000-resource view is new to it.
func BenchmarkDiffAllOf30k(b *testing.B) {
	t := benchTree(30_000)
	b.ReportAllocs()
	for b.Loop() {
		n := 0
		Diff(Tree[int]{}, t, func(c Change[int]) bool {
			if c.New != nil {
				n++
			}
			return true
		})
		if n != 30_000 {
			b.Fatalf("Diff found %d changes, want 30000", n)
		}
	}
}
