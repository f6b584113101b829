package ledger

import (
	"crypto/sha256"
	"encoding/binary"
	"iter"
	"math/bits"
	"unsafe"
)

// Tree is an immutable map from resource name to content hash (and a value of
// the caller's choosing), arranged as a Merkle hash trie:
//
//   - the trie is 16-ary, indexed by the nibbles of SHA-256(name);
//   - a leaf sits at the shallowest depth where its subtree holds nothing
//     else, so the shape depends only on the set of names: the same content
//     always gives the same Root, whatever the order of the edits that built
//     it;
//   - a leaf's digest covers (name, hash) and a branch's digest covers its
//     children's digests, so Root commits to every pair.
//
// Trees are persistent: an edit (Edit, then Builder.Tree) copies only the
// paths it touches and shares the rest, so a new version costs memory and time
// in proportion to the change, not the size, and old versions stay valid for
// whoever still holds them. Diff skips every subtree whose digest is the same
// on both sides.
//
// The zero Tree is empty and ready to use. A Tree is safe for concurrent use
// by any number of readers.
type Tree[V any] struct {
	root *node[V]
	n    int
}

// Entry is one (name, hash, value) of a Tree.
type Entry[V any] struct {
	Name  string
	Hash  Hash
	Value V
}

// node is a leaf (name set) or a branch (bitmap non-zero). Nodes reachable
// from a Tree are frozen (tok == nil, digest valid). Nodes created or copied
// by a Builder carry its token and may be changed in place until the Builder
// publishes them.
type node[V any] struct {
	tok    *editToken
	digest Hash

	// leaf
	name  string
	hash  Hash
	value V

	// branch: kids holds one child per set bit of bitmap, in nibble order.
	bitmap uint16
	kids   []*node[V]
}

// editToken marks the nodes a Builder owns. It has a field so that every
// token is a distinct allocation.
type editToken struct{ _ int }

const maxDepth = 2 * sha256.Size // nibbles in a path

var emptyRoot = sha256.Sum256([]byte("meshrelay.ledger.v1/empty"))

// EmptyRoot is the Root of a Tree with no entries.
func EmptyRoot() Hash { return emptyRoot }

func (n *node[V]) isLeaf() bool { return n.bitmap == 0 }

// Len returns the number of entries.
func (t Tree[V]) Len() int { return t.n }

// Root returns the Merkle root: the content version of the whole map.
func (t Tree[V]) Root() Hash {
	if t.root == nil {
		return emptyRoot
	}
	return t.root.digest
}

// Shares reports whether t and u are the same version: the same nodes, not
// only the same content (tests of sharing use it).
func (t Tree[V]) Shares(u Tree[V]) bool { return t.root == u.root }

// Get returns the entry for name.
func (t Tree[V]) Get(name string) (Entry[V], bool) {
	return lookup(t.root, name)
}

// All yields every entry, in trie order (stable for a given content).
func (t Tree[V]) All() iter.Seq[Entry[V]] {
	return func(yield func(Entry[V]) bool) { walk(t.root, yield) }
}

// Edit returns a Builder that starts from t. t itself is never changed.
func (t Tree[V]) Edit() *Builder[V] {
	return &Builder[V]{root: t.root, n: t.n, tok: new(editToken)}
}

// Builder accumulates edits to a Tree. It is not safe for concurrent use.
type Builder[V any] struct {
	root *node[V]
	n    int
	tok  *editToken
}

// Len returns the number of entries the Builder holds now.
func (b *Builder[V]) Len() int { return b.n }

// Get returns the entry for name as the Builder holds it now.
func (b *Builder[V]) Get(name string) (Entry[V], bool) { return lookup(b.root, name) }

// Set maps name to (hash, value), replacing any earlier entry.
func (b *Builder[V]) Set(name string, hash Hash, value V) {
	p := pathOf(name)
	var added bool
	b.root, added = b.insert(b.root, 0, name, &p, hash, value)
	if added {
		b.n++
	}
}

// Delete removes name and reports whether it was present.
func (b *Builder[V]) Delete(name string) bool {
	p := pathOf(name)
	var removed bool
	b.root, removed = b.remove(b.root, 0, name, &p)
	if removed {
		b.n--
	}
	return removed
}

// Tree publishes the Builder's content as an immutable Tree, computing the
// digests of the nodes it changed. The Builder stays usable; later edits
// copy what they touch again.
func (b *Builder[V]) Tree() Tree[V] {
	freeze(b.root, b.tok)
	b.tok = new(editToken)
	return Tree[V]{root: b.root, n: b.n}
}

func pathOf(name string) Hash {
	// sha256 only reads its input, so hash the string's bytes in place.
	return sha256.Sum256(unsafe.Slice(unsafe.StringData(name), len(name)))
}

func nibble(p *Hash, depth int) int {
	b := p[depth/2]
	if depth%2 == 0 {
		return int(b >> 4)
	}
	return int(b & 0x0f)
}

// slot returns the index in kids of nibble i, and whether that child exists.
func (n *node[V]) slot(i int) (int, bool) {
	bit := uint16(1) << i
	return bits.OnesCount16(n.bitmap & (bit - 1)), n.bitmap&bit != 0
}

func (n *node[V]) child(i int) *node[V] {
	if idx, ok := n.slot(i); ok {
		return n.kids[idx]
	}
	return nil
}

// own returns n if the Builder may change it, else a copy it may change.
func (b *Builder[V]) own(n *node[V]) *node[V] {
	if n.tok == b.tok {
		return n
	}
	c := *n
	c.tok = b.tok
	if n.kids != nil {
		c.kids = append(make([]*node[V], 0, len(n.kids)+1), n.kids...)
	}
	return &c
}

func (b *Builder[V]) leaf(name string, hash Hash, value V) *node[V] {
	return &node[V]{tok: b.tok, name: name, hash: hash, value: value}
}

// setChild puts c at nibble i of the owned branch n (c != nil).
func setChild[V any](n *node[V], i int, c *node[V]) {
	idx, ok := n.slot(i)
	if ok {
		n.kids[idx] = c
		return
	}
	n.kids = append(n.kids, nil)
	copy(n.kids[idx+1:], n.kids[idx:])
	n.kids[idx] = c
	n.bitmap |= 1 << i
}

// dropChild removes nibble i from the owned branch n.
func dropChild[V any](n *node[V], i int) {
	idx, ok := n.slot(i)
	if !ok {
		return
	}
	copy(n.kids[idx:], n.kids[idx+1:])
	n.kids[len(n.kids)-1] = nil
	n.kids = n.kids[:len(n.kids)-1]
	n.bitmap &^= 1 << i
}

func (b *Builder[V]) insert(n *node[V], depth int, name string, p *Hash, hash Hash, value V) (*node[V], bool) {
	if n == nil {
		return b.leaf(name, hash, value), true
	}
	if n.isLeaf() {
		if n.name == name {
			n = b.own(n)
			n.hash, n.value = hash, value
			return n, false
		}
		if depth >= maxDepth {
			panic("ledger: SHA-256 collision between " + n.name + " and " + name)
		}
		// Two names meet here: push the old leaf one level down and retry.
		op := pathOf(n.name)
		br := &node[V]{tok: b.tok}
		setChild(br, nibble(&op, depth), n)
		n = br
	}
	n = b.own(n)
	i := nibble(p, depth)
	c, added := b.insert(n.child(i), depth+1, name, p, hash, value)
	setChild(n, i, c)
	return n, added
}

func (b *Builder[V]) remove(n *node[V], depth int, name string, p *Hash) (*node[V], bool) {
	if n == nil {
		return nil, false
	}
	if n.isLeaf() {
		if n.name == name {
			return nil, true
		}
		return n, false
	}
	i := nibble(p, depth)
	old := n.child(i)
	c, removed := b.remove(old, depth+1, name, p)
	if !removed {
		return n, false
	}
	n = b.own(n)
	if c == nil {
		dropChild(n, i)
	} else {
		setChild(n, i, c)
	}
	// Keep the shape canonical: a branch holding a single leaf is that leaf.
	switch {
	case len(n.kids) == 0:
		return nil, true
	case len(n.kids) == 1 && n.kids[0].isLeaf():
		return n.kids[0], true
	}
	return n, true
}

func lookup[V any](n *node[V], name string) (Entry[V], bool) {
	if n == nil {
		return Entry[V]{}, false
	}
	p := pathOf(name)
	for depth := 0; n != nil; depth++ {
		if n.isLeaf() {
			if n.name == name {
				return Entry[V]{Name: n.name, Hash: n.hash, Value: n.value}, true
			}
			return Entry[V]{}, false
		}
		n = n.child(nibble(&p, depth))
	}
	return Entry[V]{}, false
}

func walk[V any](n *node[V], yield func(Entry[V]) bool) bool {
	if n == nil {
		return true
	}
	if n.isLeaf() {
		return yield(Entry[V]{Name: n.name, Hash: n.hash, Value: n.value})
	}
	for _, c := range n.kids {
		if !walk(c, yield) {
			return false
		}
	}
	return true
}

// freeze computes the digests of the nodes owned by tok, bottom up, and
// releases them. Frozen subtrees are not visited.
func freeze[V any](n *node[V], tok *editToken) {
	if n == nil || n.tok != tok {
		return
	}
	for _, c := range n.kids {
		freeze(c, tok)
	}
	n.digest = n.computeDigest()
	n.tok = nil
}

func (n *node[V]) computeDigest() Hash {
	// One contiguous buffer and sha256.Sum256: no hasher allocation. Leaf:
	// 0x00 | uvarint(len(name)) | name | hash. Branch: 0x01 | bitmap | the
	// children's digests in nibble order.
	var stack [3 + 16*sha256.Size]byte
	buf := stack[:0]
	if n.isLeaf() {
		buf = append(buf, 0)
		buf = binary.AppendUvarint(buf, uint64(len(n.name)))
		buf = append(buf, n.name...)
		buf = append(buf, n.hash[:]...)
	} else {
		buf = append(buf, 1, byte(n.bitmap>>8), byte(n.bitmap))
		for _, c := range n.kids {
			buf = append(buf, c.digest[:]...)
		}
	}
	return sha256.Sum256(buf)
}
