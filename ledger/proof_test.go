package ledger

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
)

func randomModel(r *rand.Rand, n int) map[string]Hash {
	m := map[string]Hash{}
	for range n {
		m[fmt.Sprintf("outbound|80||svc-%d.ns.svc.cluster.local", r.IntN(4*n+1))] = h(fmt.Sprint(r.IntN(7)))
	}
	return m
}

// TestProofsVerify: every name a tree holds is proved present at its hash,
// and names it does not hold are proved absent, for trees of every shape
// (empty, a single leaf at the root, long shared prefixes).
func TestProofsVerify(t *testing.T) {
	for seed := range uint64(30) {
		r := rand.New(rand.NewPCG(seed, 11))
		model := randomModel(r, r.IntN(400))
		tree := build(model)
		root := tree.Root()
		for name, want := range model {
			got, ok, err := tree.Prove(name).Verify(root)
			if err != nil || !ok || got != want {
				t.Fatalf("seed %d: Prove(%q).Verify = %v, %v, %v; want %v, true, nil", seed, name, got, ok, err, want)
			}
		}
		for i := range 50 {
			name := fmt.Sprintf("absent-%d", i)
			got, ok, err := tree.Prove(name).Verify(root)
			if err != nil || ok {
				t.Fatalf("seed %d: Prove(%q).Verify = %v, %v, %v; want absent", seed, name, got, ok, err)
			}
		}
	}
}

// TestForgedProofsFail: a proof changed in any part, or checked against
// another root, does not verify.
func TestForgedProofsFail(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 5))
	model := randomModel(r, 300)
	tree := build(model)
	root := tree.Root()
	var name string
	for n := range model {
		name = n
		break
	}
	other := build(map[string]Hash{name: h("other")}).Root()
	forgeries := map[string]func(p *Proof){
		"another hash": func(p *Proof) { p.Leaf.Hash = h("forged") },
		"another name": func(p *Proof) { p.Name, p.Leaf.Name = "forged", "forged" },
		"a sibling":    func(p *Proof) { p.Levels[len(p.Levels)-1].Siblings[0][0] ^= 1 },
		"a bitmap bit": func(p *Proof) { p.Levels[0].Bitmap ^= 1 << 15 },
		"a level less": func(p *Proof) { p.Levels = p.Levels[1:] },
		"no leaf":      func(p *Proof) { p.Leaf = nil },
		"no sibling":   func(p *Proof) { l := &p.Levels[0]; l.Siblings = l.Siblings[1:] },
		"absent made present": func(p *Proof) {
			// Claim the leaf proves another name at the same place.
			p.Name = name + "x"
		},
	}
	for what, forge := range forgeries {
		t.Run(what, func(t *testing.T) {
			p := tree.Prove(name)
			p.Levels = cloneLevels(p.Levels)
			leaf := *p.Leaf
			p.Leaf = &leaf
			forge(&p)
			hash, ok, err := p.Verify(root)
			if what == "absent made present" {
				// Verifies, but proves only that name+"x" is not there.
				if ok {
					t.Fatalf("Verify = %v, %v, %v; want not present", hash, ok, err)
				}
				return
			}
			if !errors.Is(err, ErrBadProof) {
				t.Fatalf("forged (%s) Verify = %v, %v, %v; want ErrBadProof", what, hash, ok, err)
			}
		})
	}
	if _, _, err := tree.Prove(name).Verify(other); !errors.Is(err, ErrBadProof) {
		t.Fatalf("Verify against another root: err = %v, want ErrBadProof", err)
	}
	if _, _, err := (Tree[int]{}).Prove(name).Verify(root); !errors.Is(err, ErrBadProof) {
		t.Fatalf("empty tree's proof against a non-empty root: err = %v, want ErrBadProof", err)
	}
}

func cloneLevels(ls []ProofLevel) []ProofLevel {
	out := make([]ProofLevel, len(ls))
	for i, l := range ls {
		out[i] = ProofLevel{Bitmap: l.Bitmap, Siblings: append([]Hash(nil), l.Siblings...)}
	}
	return out
}
