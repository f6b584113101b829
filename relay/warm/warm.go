// Package warm rebuilds what a relay persisted (relay/snapshot) into views
// it can serve, for a warm start: every distinct view built and checked
// against its Merkle root once, on every processor, and shared by the keys
// that persisted it, as are what the relay derives from them. Installing
// the restored keys is the relay's.
package warm

import (
	"runtime"
	"sync"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Restorer builds the views of restored keys. Keys that persisted the same
// view (most keys of a namespace) share one tree: it is built and checked
// once, and the relay holds it once.
type Restorer struct {
	store *xds.Store
	trees map[typeRoot]*ledger.Tree[*xds.Resource] // views that checked out
	// refs and missing cache what the relay's followRestored derives from
	// a view (the names it refers to) and from a pair of views (the names
	// referred to that the other lacks), for the keys that share them.
	refs    map[typeRoot]map[string]int
	missing map[string][]string

	// bodies maps the bodies Load returned to their Resources: the store
	// hands every key that holds a resource the same bytes, so a resource
	// held by 100 keys is hashed and looked up once.
	bodiesMu sync.Mutex
	bodies   map[*byte]*xds.Resource
}

func (rs *Restorer) known(body []byte) *xds.Resource {
	if len(body) == 0 {
		return nil
	}
	rs.bodiesMu.Lock()
	defer rs.bodiesMu.Unlock()
	return rs.bodies[&body[0]]
}

func (rs *Restorer) remember(body []byte, r *xds.Resource) {
	if len(body) == 0 {
		return
	}
	rs.bodiesMu.Lock()
	defer rs.bodiesMu.Unlock()
	rs.bodies[&body[0]] = r
}

// NewRestorer returns a Restorer that keeps what it decodes in store.
func NewRestorer(store *xds.Store) *Restorer {
	return &Restorer{
		store:   store,
		trees:   make(map[typeRoot]*ledger.Tree[*xds.Resource]),
		refs:    make(map[typeRoot]map[string]int),
		missing: make(map[string][]string),
		bodies:  make(map[*byte]*xds.Resource),
	}
}

// Prebuild builds and checks every distinct view of saved, on as many
// goroutines as there are processors: decoding the resources (to find what
// they refer to) is most of a warm start's work. A view that does not
// check out does not spoil another that claims the same root and does.
func (rs *Restorer) Prebuild(saved []xds.SavedKey) {
	type listID struct {
		k     typeRoot
		first *xds.SavedResource
		n     int
	}
	var todo []xds.SavedType
	seen := make(map[listID]bool)
	for _, sk := range saved {
		for _, st := range sk.Types {
			id := listID{k: typeRoot{st.Type, st.Root}, n: len(st.Resources)}
			if len(st.Resources) > 0 {
				id.first = &st.Resources[0]
			}
			if xds.Cached(st.Type) && !seen[id] {
				seen[id] = true
				todo = append(todo, st)
			}
		}
	}
	type built struct {
		k  typeRoot
		t  ledger.Tree[*xds.Resource]
		ok bool
	}
	work := make(chan xds.SavedType)
	out := make(chan built)
	workers := min(runtime.GOMAXPROCS(0), max(len(todo), 1))
	for range workers {
		go func() {
			for st := range work {
				t, ok := rs.build(st)
				out <- built{typeRoot{st.Type, st.Root}, t, ok}
			}
		}()
	}
	go func() {
		for _, st := range todo {
			work <- st
		}
		close(work)
	}()
	for range todo {
		if b := <-out; b.ok && rs.trees[b.k] == nil {
			t := b.t
			rs.trees[b.k] = &t
		}
	}
}

// build decodes st's resources into a tree and checks it against st.Root.
// It is safe for concurrent use (the store is).
func (rs *Restorer) build(st xds.SavedType) (ledger.Tree[*xds.Resource], bool) {
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, sr := range st.Resources {
		res := rs.known(sr.Body)
		if res == nil {
			var err error
			if res, err = rs.store.Restore(st.Type, sr.Name, sr.Body); err != nil {
				return ledger.Tree[*xds.Resource]{}, false
			}
			rs.remember(sr.Body, res)
		}
		if res.Name != sr.Name || res.Type != st.Type {
			return ledger.Tree[*xds.Resource]{}, false
		}
		b.Set(res.Name, res.Hash, res)
	}
	t := b.Tree()
	return t, t.Root() == st.Root
}

type typeRoot struct {
	typ  string
	root ledger.Hash
}

// Tree returns the checked view of st's root (Prebuild built them all):
// the content its root commits to.
func (rs *Restorer) Tree(st xds.SavedType) (ledger.Tree[*xds.Resource], bool) {
	if t := rs.trees[typeRoot{st.Type, st.Root}]; t != nil {
		return *t, true
	}
	return ledger.Tree[*xds.Resource]{}, false
}

// RefCounts returns how many resources of view (of type typ) refer to each
// name of kind.
func (rs *Restorer) RefCounts(typ string, kind xds.RefKind, view ledger.Tree[*xds.Resource]) map[string]int {
	k := typeRoot{typ, view.Root()}
	if c, ok := rs.refs[k]; ok {
		return c
	}
	c := make(map[string]int)
	for e := range view.All() {
		for _, n := range e.Value.Refs(kind) {
			c[n]++
		}
	}
	rs.refs[k] = c
	return c
}

// MissingOf returns what compute finds missing for the pair of views sig
// names, computing it once for the keys that share them.
func (rs *Restorer) MissingOf(sig string, compute func() []string) []string {
	if m, ok := rs.missing[sig]; ok {
		return m
	}
	m := compute()
	rs.missing[sig] = m
	return m
}
