package ledger

// Change is one difference found by Diff: Old is nil for an entry only in the
// new Tree, New is nil for an entry only in the old one. Old and New point to
// entries Diff reuses for the next Change: valid during fn's call only, so
// copy what is kept (a full sync of a 3,000-cluster view allocated 3,000
// entries per stream when each Change had its own).
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
	s := new([2]Entry[V]) // what every Change's Old and New point to
	diffNodes(from.root, to.root, 0, s, fn)
}

// diffNodes diffs a and b at depth; s holds the entries of the Change fn is
// called with (old, new).
func diffNodes[V any](a, b *node[V], depth int, s *[2]Entry[V], fn func(Change[V]) bool) bool {
	switch {
	case a == b:
		return true
	case a == nil:
		return walk(b, func(e Entry[V]) bool { s[1] = e; return fn(Change[V]{Name: e.Name, New: &s[1]}) })
	case b == nil:
		return walk(a, func(e Entry[V]) bool { s[0] = e; return fn(Change[V]{Name: e.Name, Old: &s[0]}) })
	case a.digest == b.digest:
		return true
	case a.isLeaf() && b.isLeaf():
		s[0] = Entry[V]{Name: a.name, Hash: a.hash, Value: a.value}
		s[1] = Entry[V]{Name: b.name, Hash: b.hash, Value: b.value}
		if a.name == b.name {
			return fn(Change[V]{Name: a.name, Old: &s[0], New: &s[1]})
		}
		return fn(Change[V]{Name: a.name, Old: &s[0]}) && fn(Change[V]{Name: b.name, New: &s[1]})
	}
	// At least one side is a branch: compare child by child, seeing a leaf
	// as a branch with that leaf as its only child.
	an, bn := leafNibble(a, depth), leafNibble(b, depth)
	for i := range 16 {
		if !diffNodes(childAt(a, an, i), childAt(b, bn, i), depth+1, s, fn) {
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
