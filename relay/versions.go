package relay

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// observe moves the relay's clock past an Order learned from the tier (a
// peer relay's views or declaration): what this relay orders from now on
// comes after it. An Order too far ahead of the wall clock is refused and
// logged: the relay it came from has a clock that is off.
// It reports whether the clock is past o now.
func (c *keyCache) observe(o ledger.Order, from, who string) bool {
	if o.IsZero() {
		return true
	}
	if err := c.clock.Observe(o.At); err != nil {
		c.log.Warn("version order not observed", "from", from, "who", who, "err", err)
		return false
	}
	return true
}

// maxClientAhead is how far past the relay's clock an Envoy's declared
// version may have arrived (clocks of different relays disagree a little).
const maxClientAhead = time.Second

// placed reports whether the relay can take content a client declares at
// Order o by that Order. It cannot without one (zero: a view of unknown
// age, another control plane's version, a relay's of a release before
// Orders), nor, from an Envoy, one that arrived later than this relay's
// clock allows: an Envoy's word is untrusted, and a version from the
// future could be neither covered nor demanded. (A peer relay's Orders move
// the clock instead: observe.) What cannot be placed is held by
// declaredBound.
func (c *keyCache) placed(o ledger.Order, fromPeer bool) bool {
	if o.IsZero() {
		return false
	}
	return fromPeer || o.At <= max(ledger.StampAt(time.Now().Add(maxClientAhead)), c.clock.Last())
}

// declaredBound is the Order of content a client declares now that cannot
// be placed: it arrived before now (ledger.Bound), so a view from a stream
// opened later covers it.
func (c *keyCache) declaredBound() ledger.Order { return ledger.Bound(c.clock.Now()) }

// maxDeclaredOrders bounds the distinct Orders a client's declaration of
// one type keeps: a client holds a type's resources from a few versions at
// most (those sent since it last held them all at one).
const maxDeclaredOrders = 16

// orderSet is the distinct Orders a client declared it holds a type's
// resources at, none covering another: the key's view may be sent once it
// covers them all.
type orderSet []ledger.Order

// add returns the set with o: dropped if a member covers it, replacing the
// members it covers. Past maxDeclaredOrders (an honest client never gets
// there) the set becomes the one Order that only a stream opened after all
// of them covers. The zero Order (nothing held) adds nothing.
func (s orderSet) add(o ledger.Order) orderSet {
	if o.IsZero() {
		return s
	}
	for _, m := range s {
		if m.Covers(o) {
			return s
		}
	}
	s = slices.DeleteFunc(s, func(m ledger.Order) bool { return o.Covers(m) })
	s = append(s, o)
	if len(s) > maxDeclaredOrders {
		latest := slices.MaxFunc(s, func(a, b ledger.Order) int { return cmp.Compare(a.At, b.At) }).At
		s = orderSet{ledger.Bound(latest)}
	}
	return s
}

// coveredBy reports whether view covers every Order of the set.
func (s orderSet) coveredBy(view ledger.Order) bool {
	for _, o := range s {
		if !view.Covers(o) {
			return false
		}
	}
	return true
}

// claimLookup is a key's question to the tier about one claimed version,
// shared by the key's streams that claim it (a relay's Envoys of one key
// that moved together ask once). The asking goroutine sets held and ok,
// then closes done and wakes the key's streams.
type claimLookup struct {
	done chan struct{}
	held ledger.Tree[*xds.Resource]
	ok   bool
	from string // who knew: "tier" or "store"
}

// claimQuestion identifies a lookup: a version of a type, for a
// subscription to every resource or to the names whose ListDigest is names.
type claimQuestion struct {
	typeURL  string
	root     ledger.Hash
	wildcard bool
	names    uint64
}

// maxClaimLookups bounds the lookups a key remembers; they are forgotten
// all at once when it is reached (those under way still answer their
// streams).
const maxClaimLookups = 64

// claimTable is a key's lookups of claimed versions, one per question:
// the streams of the key that claim alike wait for one lookup.
type claimTable struct {
	mu sync.Mutex
	m  map[claimQuestion]*claimLookup
}
