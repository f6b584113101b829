package relay

import (
	"context"
	"fmt"
	"maps"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/warm"
	"github.com/meshrelay/meshrelay/relay/xds"
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
	Save(key string, term uint64, views []xds.View)
	// Load returns every persisted key. The relay checks each type's
	// resources against its root before serving them: damage to the store
	// costs a warm type, not a wrong one. (Whoever can write the store at
	// will can also write consistent roots: protect etcd itself.)
	Load(ctx context.Context) ([]xds.SavedKey, error)
}

// HeldVersions is implemented by Snapshots that also keep, for a while,
// the versions a draining relay's SotW clients hold (snapshot.Store does).
// A SotW client says of each type only the version it holds: once every
// relay that knew that version is gone (a rolling restart ends with none
// of the relays that served it), the relay it reconnects to finds it here,
// and holds back the removal of what its routes still use, as it does for
// a version the tier knows (claims.go).
type HeldVersions interface {
	// SaveHeld keeps v, a version a SotW client of key holds (every value
	// set), and the bodies of bodies (v's, of which the store writes
	// those it has not written itself).
	SaveHeld(ctx context.Context, key string, v xds.View, bodies []*xds.Resource) error
	// LoadHeld returns the version root of typeURL that SaveHeld kept for
	// key, if any, with the bodies of the entries has reports the caller
	// lacks. The caller checks it against root.
	LoadHeld(ctx context.Context, key, typeURL string, root ledger.Hash, has func(ledger.Hash) bool) (xds.HeldVersion, bool, error)
}

// snapshotLoadTimeout bounds the warm start's read of the store: past it the
// relay starts cold.
const snapshotLoadTimeout = 30 * time.Second

// loadSnapshots restores every persisted key, stale, before streams are let
// in (see watchWarm): a relay that loaded config is warm even while its
// upstream is unreachable.
func (c *keyCache) loadSnapshots(ctx context.Context) {
	defer close(c.loaded)
	start := time.Now()
	lctx, cancel := context.WithTimeout(ctx, snapshotLoadTimeout)
	saved, err := c.cfg.Keys.Snapshots.Load(lctx)
	cancel()
	if err != nil {
		c.log.Warn("warm start: snapshots not loaded; starting cold", "err", err)
		return
	}
	keys, types := 0, 0
	rs := warm.NewRestorer(c.store)
	rs.Prebuild(saved)
	for _, sk := range saved {
		if n := c.restoreKey(sk, rs); n > 0 {
			keys++
			types += n
		}
	}
	c.metrics.RestoredKeys.Add(float64(keys))
	c.restored.Store(int64(keys))
	if keys > 0 {
		c.host.markWarm(fmt.Sprintf("%d keys restored from snapshots", keys))
	}
	c.log.Info("warm start", "keys", keys, "types", types, "took", time.Since(start).Round(time.Millisecond))
}

// restoreKey installs a persisted key, stale, if no stream created it
// first, and returns the number of types restored.
func (c *keyCache) restoreKey(sk xds.SavedKey, rs *warm.Restorer) int {
	types := make(map[string]*views.Type, len(sk.Types))
	for _, st := range sk.Types {
		if !xds.Cached(st.Type) {
			continue
		}
		t, ok := rs.Tree(st)
		if !ok {
			c.log.Warn("warm start: persisted view does not match its root; not restored", "key", sk.Key, "type", xds.ShortType(st.Type))
			continue
		}
		types[st.Type] = &views.Type{View: c.views.Intern(t), Ready: true, Full: st.Full}
	}
	if len(types) == 0 {
		return 0
	}
	installed := c.installKey(aggkey.Key(sk.Key), func(k *keyState, u *feed) {
		k.views.Store(&views.Set{Types: types, Stale: true, Restored: true})
		now := time.Now()
		for typeURL, ts := range types {
			k.recordView(typeURL, ts.View, now, ledger.Order{})
		}
		c.ledger.SetSource(sk.Key, ledger.SourceUpstream, true)
		u.followRestored(rs)
		u.seedRestored()
	})
	if !installed {
		return 0
	}
	return len(types)
}

// followRestored derives, from restored views, the names they refer to
// (endpoints of clusters, routes of listeners), as apply does for views
// that arrive: the upstream asks for them, and those missing are pending.
// What it derives from a view is computed once for the keys that share it.
func (u *feed) followRestored(rs *warm.Restorer) {
	k := u.k
	k.mu.Lock()
	defer k.mu.Unlock()
	k.update(func(next *views.Set) {
		for _, d := range xds.FetchedTargets() {
			var parts []map[string]int
			sig := d.Target
			if ts := next.Types[d.Target]; ts != nil {
				sig += ts.View.Root().String()
			}
			for _, src := range d.Sources {
				if ts := next.Types[src]; ts != nil {
					parts = append(parts, rs.RefCounts(src, d.Kind, ts.View))
					sig += src + ts.View.Root().String()
				}
			}
			if len(parts) == 0 {
				continue
			}
			counts := maps.Clone(parts[0])
			for _, p := range parts[1:] {
				for n, c := range p {
					counts[n] += c
				}
			}
			u.derived[d.Target] = counts
			delete(u.derivedSets, d.Target)
			missing := rs.MissingOf(sig, func() (missing []string) {
				var view ledger.Tree[*xds.Resource]
				if ts := next.Types[d.Target]; ts != nil {
					view = ts.View
				}
				for n := range counts {
					if _, ok := view.Get(n); !ok {
						missing = append(missing, n)
					}
				}
				return missing
			})
			next.MarkPending(d.Target, missing, time.Now())
		}
	})
}

// seedRestored declares the restored views on the key's first upstream
// stream (Delta initial_resource_versions, the content hashes, which the
// upstream does not recognise): it then sends every resource again, so
// nothing unchanged reaches the Envoys, and removes what it no longer has,
// which a stream that declared nothing would never hear of. The versions
// are built when the type is first asked for (a restored key no Envoy asks
// for costs nothing).
func (u *feed) seedRestored() {
	for t, ts := range u.k.views.Load().Types {
		u.types[t] = &feedType{declare: ts.View}
	}
}

// persist hands k's views to Snapshots if this relay owns the key, holds
// its upstream stream, and a live stream confirmed the views. The key's feed
// calls it after every change from the upstream and when the views are
// confirmed.
func (c *keyCache) persist(k *keyState) {
	snaps := c.cfg.Keys.Snapshots
	if snaps == nil || sourceKind(k.source.Load()) != sourceUpstream {
		return
	}
	if o := c.cfg.Owners; o != nil {
		if _, self := o.Owner(string(k.key)); !self {
			return
		}
	}
	snap := k.views.Load()
	if snap.Stale {
		return
	}
	saved := make([]xds.View, 0, len(snap.Types))
	for t, ts := range snap.Types {
		if ts.Ready {
			saved = append(saved, xds.View{Type: t, Full: ts.Full, Tree: ts.View})
		}
	}
	snaps.Save(string(k.key), c.ownersTerm.Load(), saved)
}
