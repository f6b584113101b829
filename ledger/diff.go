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
	an, bn := leafNibble(a, depth), leafNibble(b, depth)
	for i := range 16 {
		if !diffNodes(childAt(a, an, i), childAt(b, bn, i), depth+1, fn) {
			return false
		}
	}
	return true
}

// leafNibble is, for a leaf, the nibble of its path at depth (where it sits
// when seen as a branch holding only itself); -1 for a branch.
func leafNibble[V any](n *node[V], depth int) int {
	if !n.isLeaf() {
		return -1
	}
	p := pathOf(n.name)
	return nibble(&p, depth)
}

// childAt returns n's child at nibble i, a leaf (leafNibble at, not -1)
// counting as a branch holding only itself.
func childAt[V any](n *node[V], at, i int) *node[V] {
	switch {
	case at < 0:
		return n.child(i)
	case i == at:
		return n
	}
	return nil
}
