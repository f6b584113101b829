package ledger

import (
	"runtime"
	"sync"
	"weak"
)

// Interner shares trees of equal content: Intern returns, for a tree whose
// root it has seen on a tree still held somewhere, that tree, so that the
// same content is held once however many holders built it on their own
// (the keys of a namespace, each fed its own upstream stream the same
// config). It holds trees weakly: a tree nobody else holds is collected,
// and its entry with it. Safe for concurrent use; the zero value is ready.
type Interner[V any] struct {
	mu sync.Mutex
	m  map[Hash]interned[V]
}

type interned[V any] struct {
	root weak.Pointer[node[V]]
	n    int
}

// Intern returns the tree held for t's root if there is one, else t,
// which it holds from now on.
func (in *Interner[V]) Intern(t Tree[V]) Tree[V] {
	if t.root == nil {
		return t
	}
	h := t.root.digest
	in.mu.Lock()
	defer in.mu.Unlock()
	if e, ok := in.m[h]; ok {
		if r := e.root.Value(); r != nil {
			return Tree[V]{root: r, n: e.n}
		}
	}
	if in.m == nil {
		in.m = make(map[Hash]interned[V])
	}
	wp := weak.Make(t.root)
	in.m[h] = interned[V]{root: wp, n: t.n}
	// When the root is collected, its entry goes, unless a tree of the same
	// content took the entry meanwhile.
	runtime.AddCleanup(t.root, func(h Hash) {
		in.mu.Lock()
		defer in.mu.Unlock()
		if e, ok := in.m[h]; ok && e.root == wp {
			delete(in.m, h)
		}
	}, h)
	return t
}

// Len returns the number of distinct trees held.
func (in *Interner[V]) Len() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return len(in.m)
}
