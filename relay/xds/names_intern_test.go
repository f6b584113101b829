package xds

import (
	"fmt"
	"runtime"
	"slices"
	"testing"
	"time"
	"unsafe"
)

func set(names ...string) NameSet { return NewNameSet(names) }

// Equal sets made apart are held once; a set of other names, even one
// that hashes alike, is never taken for it; what nobody holds is let go.
func TestNameSetsIntern(t *testing.T) {
	var ns NameSets
	a := ns.Intern(set("c0", "c1", "c2"))
	b := ns.Intern(set("c2", "c1", "c0"))
	if unsafe.SliceData(a) != unsafe.SliceData(b) {
		t.Fatal("two equal sets are held twice")
	}
	c := ns.Intern(set("c0", "c1"))
	if unsafe.SliceData(c) == unsafe.SliceData(a) || !slices.Equal(c, set("c0", "c1")) {
		t.Fatalf("another set interned as the first: %v", c)
	}
	if got := ns.Intern(nil); got != nil {
		t.Fatalf("Intern(nil) = %v", got)
	}
	// Sets under one digest are told apart by their names.
	d := setDigest(a)
	ns.mu.Lock()
	ns.m[d] = append(ns.m[d], ns.m[setDigest(c)]...) // c's entry filed under a's digest too
	ns.mu.Unlock()
	if e := ns.Intern(set("c0", "c1", "c2")); unsafe.SliceData(e) != unsafe.SliceData(a) {
		t.Fatal("a digest shared with another set returned the wrong set")
	}
	runtime.KeepAlive(a)
	runtime.KeepAlive(b)
	runtime.KeepAlive(c)
	a, b, c = nil, nil, nil
	for deadline := time.Now().Add(10 * time.Second); ns.Len() > 0; {
		if time.Now().After(deadline) {
			t.Fatalf("Len = %d after every set was dropped, want 0", ns.Len())
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
}

func BenchmarkNameSetsIntern(b *testing.B) {
	var ns NameSets
	names := make([]string, 1000)
	for i := range names {
		names[i] = fmt.Sprint("outbound|80||svc-", i, ".ns.svc.cluster.local")
	}
	held := ns.Intern(NewNameSet(names))
	b.ReportAllocs()
	for b.Loop() {
		ns.Intern(NewNameSet(names))
	}
	runtime.KeepAlive(held)
}
