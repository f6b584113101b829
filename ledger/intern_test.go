package ledger

import (
	"fmt"
	"runtime"
	"testing"
	"time"
)

func buildTree(n int, change string) Tree[int] {
	b := Tree[int]{}.Edit()
	for i := range n {
		name := fmt.Sprint("r", i)
		b.Set(name, h(name+change), i)
	}
	return b.Tree()
}

// Trees of equal content built apart are held once; a tree of other
// content is not confused with them; and what nobody holds any more is
// let go.
func TestInterner(t *testing.T) {
	var in Interner[int]
	a, b, c := buildTree(100, ""), buildTree(100, ""), buildTree(100, "x")
	if a.Shares(b) {
		t.Fatal("two trees built apart share a root before interning")
	}
	ia, ib, ic := in.Intern(a), in.Intern(b), in.Intern(c)
	if !ia.Shares(a) || !ib.Shares(a) || ib.Len() != 100 {
		t.Fatalf("Intern(b) does not return a (shares %v, len %d)", ib.Shares(a), ib.Len())
	}
	if ic.Shares(a) || !ic.Shares(c) {
		t.Fatal("a tree of other content was interned as a")
	}
	if got := in.Intern(Tree[int]{}); got.Len() != 0 || got.root != nil {
		t.Fatal("the empty tree is not itself")
	}
	if n := in.Len(); n != 2 {
		t.Fatalf("Len = %d, want 2", n)
	}
	runtime.KeepAlive(ia)
	runtime.KeepAlive(ic)
	a, b, c, ia, ib, ic = Tree[int]{}, Tree[int]{}, Tree[int]{}, Tree[int]{}, Tree[int]{}, Tree[int]{}
	for deadline := time.Now().Add(10 * time.Second); in.Len() > 0; {
		if time.Now().After(deadline) {
			t.Fatalf("Len = %d after every tree was dropped, want 0", in.Len())
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	// Content seen before, built again, is held anew.
	d := buildTree(100, "")
	if got := in.Intern(d); !got.Shares(d) {
		t.Fatal("a tree whose earlier copy was collected is not interned as itself")
	}
}
