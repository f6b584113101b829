package relay

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
)

// Snapshots keeps the views a relay learned from its sources where a relay
// that starts later finds them: the relay starts warm, serving its Envoys
// the last persisted config (marked stale) before any source answers.
// snapshot.Store implements it over etcd. Implementations must be safe for
// concurrent use, and Save must never block on the store's backend: the data
// path calls it.
type Snapshots interface {
	// Save hands over the views of a key the relay owns, confirmed by a
	// live upstream stream. The store keeps only the latest views of each
	// key and writes them when it can. term grows each time the relay's
	// idea of who owns which key changes: a store whose write for key was
	// fenced off by another owner writes again only for a later term.
	Save(key string, term uint64, views []View)
	// Load returns every persisted key. Content is not trusted: the relay
	// checks each type's resources against its root before serving them.
	Load(ctx context.Context) ([]SavedKey, error)
}

// View is a key's view of one type, as Save hands it over. Tree and its
// resources are immutable: the store may keep them.
type View struct {
	Type string
	// Full is set when the view is everything the source has of the type
	// (it answered a wildcard subscription), not just the names asked for.
	Full bool
	Tree ledger.Tree[*Resource]
}

// SavedKey is what Load found of one key.
type SavedKey struct {
	Key   string
	Types []SavedType
}

// SavedType is a persisted view: Root is the Merkle root the resources must
// hash to.
type SavedType struct {
	Type      string
	Full      bool
	Root      ledger.Hash
	Resources []SavedResource
}

// SavedResource is a persisted resource: its name and serialized body.
type SavedResource struct {
	Name string
	Body []byte
}

// snapshotLoadTimeout bounds the warm start's read of the store: past it the
// relay starts cold.
const snapshotLoadTimeout = 30 * time.Second

// loadSnapshots restores every persisted key, stale, before streams are let
// in (see watchWarm): a relay that loaded config is warm even while its
// upstream is unreachable.
func (r *Relay) loadSnapshots(ctx context.Context) {
	defer close(r.loaded)
	start := time.Now()
	lctx, cancel := context.WithTimeout(ctx, snapshotLoadTimeout)
	saved, err := r.cfg.Snapshots.Load(lctx)
	cancel()
	if err != nil {
		r.log.Warn("warm start: snapshots not loaded; starting cold", "err", err)
		return
	}
	keys, types := 0, 0
	rs := &restorer{r: r, trees: make(map[typeRoot]*ledger.Tree[*Resource])}
	for _, sk := range saved {
		if n := r.restoreKey(sk, rs); n > 0 {
			keys++
			types += n
		}
	}
	r.metrics.restoredKeys.Add(float64(keys))
	r.restored.Store(int64(keys))
	if keys > 0 {
		r.markWarm(fmt.Sprintf("%d keys restored from snapshots", keys))
	}
	r.log.Info("warm start", "keys", keys, "types", types, "took", time.Since(start).Round(time.Millisecond))
}

// restorer builds the views of restored keys. Keys that persisted the same
// view (most keys of a namespace) share one tree: it is built and checked
// once, and the relay holds it once.
type restorer struct {
	r     *Relay
	trees map[typeRoot]*ledger.Tree[*Resource] // nil: did not check out
}

type typeRoot struct {
	typ  string
	root ledger.Hash
}

// tree returns the view of st, checked: every resource must decode, and
// the view must hash to the persisted root.
func (rs *restorer) tree(st SavedType) (ledger.Tree[*Resource], bool) {
	k := typeRoot{st.Type, st.Root}
	if t, seen := rs.trees[k]; seen {
		if t == nil {
			return ledger.Tree[*Resource]{}, false
		}
		return *t, true
	}
	rs.trees[k] = nil
	b := ledger.Tree[*Resource]{}.Edit()
	for _, sr := range st.Resources {
		res, err := rs.r.store.decode(st.Type, &anypb.Any{TypeUrl: st.Type, Value: sr.Body}, sr.Name)
		if err != nil || res.Name != sr.Name {
			return ledger.Tree[*Resource]{}, false
		}
		b.Set(res.Name, res.Hash, res)
	}
	t := b.Tree()
	if t.Root() != st.Root {
		return ledger.Tree[*Resource]{}, false
	}
	rs.trees[k] = &t
	return t, true
}

// restoreKey installs a persisted key, stale, if no stream created it
// first, and returns the number of types restored.
func (r *Relay) restoreKey(sk SavedKey, rs *restorer) int {
	types := make(map[string]*typeSnap, len(sk.Types))
	for _, st := range sk.Types {
		if !cached(st.Type) {
			continue
		}
		t, ok := rs.tree(st)
		if !ok {
			r.log.Warn("warm start: persisted view does not match its root; not restored", "key", sk.Key, "type", shortType(st.Type))
			continue
		}
		types[st.Type] = &typeSnap{view: t, ready: true, full: st.Full}
	}
	if len(types) == 0 {
		return 0
	}
	key := Key(sk.Key)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state != 1 || r.keys[key] != nil {
		return 0
	}
	k := newKeyState(r, key)
	k.snap.Store(&keySnap{types: types, stale: true})
	r.keys[key] = k
	u := newUpstream(k)
	u.followRestored()
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		u.run(r.ctx)
	}()
	return len(types)
}

// followRestored derives, from restored views, the names they refer to
// (endpoints of clusters, routes of listeners), as apply does for views
// that arrive: the upstream asks for them, and those missing are pending.
func (u *upstream) followRestored() {
	k := u.k
	k.mu.Lock()
	defer k.mu.Unlock()
	k.update(func(next *keySnap) {
		for _, t := range []string{typeCluster, typeListener, typeScopedRoute} {
			if ts := next.types[t]; ts != nil {
				u.follow(next, t, ledger.Tree[*Resource]{}, ts.view)
			}
		}
	})
}

// persist hands the key's views to Snapshots if this relay owns the key,
// holds its upstream stream, and a live stream confirmed the views. The
// upstream goroutine calls it after every change from the upstream and
// when the views are confirmed.
func (u *upstream) persist() {
	snaps := u.r.cfg.Snapshots
	if snaps == nil || sourceKind(u.k.source.Load()) != sourceUpstream {
		return
	}
	if o := u.r.cfg.Owners; o != nil {
		if _, self := o.Owner(string(u.k.key)); !self {
			return
		}
	}
	snap := u.k.snap.Load()
	if snap.stale {
		return
	}
	views := make([]View, 0, len(snap.types))
	for t, ts := range snap.types {
		if ts.ready {
			views = append(views, View{Type: t, Full: ts.full, Tree: ts.view})
		}
	}
	snaps.Save(string(u.k.key), u.r.ownersTerm.Load(), views)
}
