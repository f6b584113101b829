package xds

import (
	"sync"

	"github.com/meshrelay/meshrelay/ledger"
)

// RefKind selects which references of a resource to follow.
type RefKind uint8

const (
	RefEndpoints RefKind = iota
	RefRoutes
	RefClusters
)

// Refs returns the names of kind the resource refers to.
func (r *Resource) Refs(kind RefKind) []string { return r.refs.of(kind) }

func (r refs) of(kind RefKind) []string {
	switch kind {
	case RefEndpoints:
		return r.endpoints
	case RefRoutes:
		return r.routes
	}
	return r.clusters
}

// RefIndex remembers, for a few recent trees, the set of names their
// resources refer to. Trees are content-addressed by their root, and the
// streams of a key mostly hold the same trees, so one computation serves
// them all. Safe for concurrent use.
type RefIndex struct {
	mu sync.Mutex
	m  map[refIndexKey]map[string]struct{}
}

type refIndexKey struct {
	root ledger.Hash
	kind RefKind
}

// refIndexSize bounds the memo; it is cleared when full (the working set is
// the few trees the streams hold now).
const refIndexSize = 128

func (x *RefIndex) Names(t ledger.Tree[*Resource], kind RefKind) map[string]struct{} {
	k := refIndexKey{t.Root(), kind}
	x.mu.Lock()
	set, ok := x.m[k]
	x.mu.Unlock()
	if ok {
		return set
	}
	set = make(map[string]struct{})
	complete := true
	for e := range t.All() {
		if e.Value == nil {
			// Declared by a client, content not held by this relay: its
			// references are unknown, and the set must not be remembered
			// for the root, which the same content held here shares.
			complete = false
			continue
		}
		for _, n := range e.Value.refs.of(kind) {
			set[n] = struct{}{}
		}
	}
	if !complete {
		return set
	}
	x.mu.Lock()
	if x.m == nil || len(x.m) >= refIndexSize {
		x.m = make(map[refIndexKey]map[string]struct{})
	}
	x.m[k] = set
	x.mu.Unlock()
	return set
}
