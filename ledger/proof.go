package ledger

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"math/bits"
)

// Proof shows what a Tree holds for one name, checkable against the Tree's
// Root alone: the name's leaf (or where its path ends without it) and, on
// the path down to it, every branch's other children's digests.
//
// A relay that holds a key's history answers "which content of name did
// the Envoys that ACKed root R receive?" with a Proof against R; whoever
// asked checks it with Verify and needs to trust neither the relay's memory
// nor its history.
type Proof struct {
	Name string
	// Levels are the branches on the path, root first.
	Levels []ProofLevel
	// Leaf is the leaf the path ends at, if any: Name's own (inclusion) or
	// another name's (absence). Nil means the path ends at an empty slot
	// (absence) or the tree is empty.
	Leaf *ProofLeaf
}

// ProofLevel is one branch on a Proof's path.
type ProofLevel struct {
	Bitmap uint16
	// Siblings are the digests of the branch's children other than the one
	// on the path, in nibble order.
	Siblings []Hash
}

// ProofLeaf is the (name, hash) of a leaf.
type ProofLeaf struct {
	Name string
	Hash Hash
}

// ErrBadProof is returned by Verify for a proof that does not lead to the
// root it is checked against, or is malformed.
var ErrBadProof = errors.New("ledger: proof does not verify")

// Prove returns the Proof for name: of inclusion if t holds it, of absence if
// not.
func (t Tree[V]) Prove(name string) Proof {
	pf := Proof{Name: name}
	p := pathOf(name)
	n := t.root
	for depth := 0; n != nil; depth++ {
		if n.isLeaf() {
			pf.Leaf = &ProofLeaf{Name: n.name, Hash: n.hash}
			break
		}
		i := nibble(&p, depth)
		lv := ProofLevel{Bitmap: n.bitmap}
		next := n.child(i)
		for _, c := range n.kids {
			if c != next {
				lv.Siblings = append(lv.Siblings, c.digest)
			}
		}
		pf.Levels = append(pf.Levels, lv)
		n = next
	}
	return pf
}

// Verify checks pf against root and returns the hash it proves the tree
// holds for pf.Name, or ok=false if it proves the tree does not hold it.
func (pf Proof) Verify(root Hash) (hash Hash, ok bool, err error) {
	if len(pf.Levels) > maxDepth {
		return Hash{}, false, fmt.Errorf("%w: %d levels", ErrBadProof, len(pf.Levels))
	}
	p := pathOf(pf.Name)
	depth := len(pf.Levels)
	// The digest of the subtree the path ends at, and whether it exists.
	var cur Hash
	present := false
	switch {
	case pf.Leaf != nil:
		lp := pathOf(pf.Leaf.Name)
		// The leaf sits where the path of its own name leads, and that
		// is where Name's path leads too.
		for d := range depth {
			if nibble(&lp, d) != nibble(&p, d) {
				return Hash{}, false, fmt.Errorf("%w: leaf %q is off the path", ErrBadProof, pf.Leaf.Name)
			}
		}
		cur = leafDigest(pf.Leaf.Name, pf.Leaf.Hash)
		present = true
		if pf.Leaf.Name == pf.Name {
			hash, ok = pf.Leaf.Hash, true
		}
	case depth == 0:
		// An empty tree.
		if root != emptyRoot {
			return Hash{}, false, ErrBadProof
		}
		return Hash{}, false, nil
	}
	for d := depth - 1; d >= 0; d-- {
		lv := pf.Levels[d]
		i := nibble(&p, d)
		bit := uint16(1) << i
		if (lv.Bitmap&bit != 0) != present {
			return Hash{}, false, fmt.Errorf("%w: bitmap at depth %d", ErrBadProof, d)
		}
		kids := bits.OnesCount16(lv.Bitmap)
		if want := kids - btoi(present); len(lv.Siblings) != want || kids == 0 {
			return Hash{}, false, fmt.Errorf("%w: %d siblings at depth %d", ErrBadProof, len(lv.Siblings), d)
		}
		var buf [3 + 16*sha256.Size]byte
		b := append(buf[:0], 1, byte(lv.Bitmap>>8), byte(lv.Bitmap))
		idx := bits.OnesCount16(lv.Bitmap & (bit - 1))
		for j, s := range lv.Siblings {
			if present && j == idx {
				b = append(b, cur[:]...)
			}
			b = append(b, s[:]...)
		}
		if present && idx == len(lv.Siblings) {
			b = append(b, cur[:]...)
		}
		cur, present = sha256.Sum256(b), true
	}
	if cur != root {
		return Hash{}, false, ErrBadProof
	}
	return hash, ok, nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func leafDigest(name string, hash Hash) Hash {
	n := node[struct{}]{name: name, hash: hash}
	return n.computeDigest()
}
