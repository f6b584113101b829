package ledger

// Change is one difference found by Diff: Old is nil for an entry only in the
// new Tree, New is nil for an entry only in the old one.
type Change[V any] struct {
	Name string
	Old  *Entry[V]
	New  *Entry[V]
}

// Diff calls fn for every name whose hash differs between from and to (added,
// removed or changed), in trie order, until fn returns false. Subtrees with
// equal digests are skipped, so the cost follows the size of the difference;
// two trees built separately from the same content compare in O(1).
//
// Entries whose hash is equal but whose value differs are not reported: the
// hash is the content.
func Diff[V any](from, to Tree[V], fn func(Change[V]) bool) {
	diffNodes(from.root, to.root, 0, fn)
}

func diffNodes[V any](a, b *node[V], depth int, fn func(Change[V]) bool) bool {
	switch {
	case a == b:
		return true
	case a == nil:
		return walk(b, func(e Entry[V]) bool { return fn(Change[V]{Name: e.Name, New: &e}) })
	case b == nil:
		return walk(a, func(e Entry[V]) bool { return fn(Change[V]{Name: e.Name, Old: &e}) })
	case a.digest == b.digest:
		return true
	case a.isLeaf() && b.isLeaf():
		ea := Entry[V]{Name: a.name, Hash: a.hash, Value: a.value}
		eb := Entry[V]{Name: b.name, Hash: b.hash, Value: b.value}
		if a.name == b.name {
			return fn(Change[V]{Name: a.name, Old: &ea, New: &eb})
		}
		return fn(Change[V]{Name: a.name, Old: &ea}) && fn(Change[V]{Name: b.name, New: &eb})
	}
	// At least one side is a branch: compare child by child, seeing a leaf
	// as a branch with that leaf as its only child.
	at := children(a, depth)
	bt := children(b, depth)
	for i := range 16 {
		if !diffNodes(at(i), bt(i), depth+1, fn) {
			return false
		}
	}
	return true
}

// children returns a function giving n's child at each nibble, where a leaf
// at depth counts as a branch holding only itself.
func children[V any](n *node[V], depth int) func(int) *node[V] {
	if !n.isLeaf() {
		return n.child
	}
	p := pathOf(n.name)
	at := nibble(&p, depth)
	return func(i int) *node[V] {
		if i == at {
			return n
		}
		return nil
	}
}
