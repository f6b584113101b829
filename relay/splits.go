package relay

// Splits: the keys' splits this relay knows (told by the divergence
// check, or by a key's owner), and the key a node belongs to under them.

import (
	"errors"
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/peers"
)

// errKeySplit ends a relay's stream to a key's source when the key split:
// its trailer tells the splits, and the relay subscribes again at once.
var errKeySplit = errors.New("relay: the key split; subscribe again")

// splitBase returns the key k's members left by a split ("" if none).
func (k *keyState) splitBase() aggkey.Key {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.splitFrom
}

// leftBySplit notes that k, whose key is key, is the key its members have
// since a split of base moved them (key differs from base).
func (k *keyState) leftBySplit(key, base aggkey.Key) {
	if key == base {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.splitFrom = base
}

// ownerEnded is why a stream to the key's owner ended (err):
// errSplitsTold when the owner ended it because the key split (its
// trailer tells the splits: session reads it, whatever ended the
// session; the header tells them too, read with the first response).
func ownerEnded(err error) error {
	if st, ok := status.FromError(err); ok && st.Code() == codes.Aborted && st.Message() == errKeySplit.Error() {
		return errSplitsTold
	}
	return err
}

// errSplitsTold ends a stream to a key's owner that told the key split.
var errSplitsTold = errors.New("relay: the key's owner told its splits")

// readSplits learns the key's splits from an owner's metadata.
func (u *feed) readSplits(md metadata.MD) {
	v := md.Get(peers.MDSplits)
	if len(v) != 1 {
		return
	}
	splits, err := aggkey.DecodeSplits([]byte(v[0]))
	if err != nil {
		u.c.log.Warn("a key's owner sent splits this relay cannot read", "key", u.k.key, "err", err)
		return
	}
	u.c.learnSplits(u.k.key, splits)
}

// splitBook holds the records of the splits of the keys this relay knows
// of (aggkey.MergeSplit): found, or merged back, by its own checks, or told
// by the tier's other relays (MDSplits). A split whose latest record is
// merged moves nobody. Safe for concurrent use.
type splitBook struct {
	// gen counts changes: a stream whose key may have split looks again
	// when it moved.
	gen atomic.Uint64
	mu  sync.Mutex
	m   map[aggkey.Key][]aggkey.Split
}

// of returns k's split records, merged ones included: what the tier is
// told.
func (b *splitBook) of(k aggkey.Key) []aggkey.Split {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.m[k]
}

// active returns k's splits that move nodes now.
func (b *splitBook) active(k aggkey.Key) []aggkey.Split {
	return aggkey.Active(b.of(k))
}

// add enters records of k's splits and returns the ones that changed k's.
func (b *splitBook) add(k aggkey.Key, splits ...aggkey.Split) []aggkey.Split {
	b.mu.Lock()
	defer b.mu.Unlock()
	var fresh []aggkey.Split
	for _, s := range splits {
		next, added := aggkey.MergeSplit(b.m[k], s)
		if !added {
			continue
		}
		if b.m == nil {
			b.m = make(map[aggkey.Key][]aggkey.Split)
		}
		b.m[k] = next
		fresh = append(fresh, s)
	}
	if len(fresh) > 0 {
		b.gen.Add(1)
	}
	return fresh
}

// keyOf returns the key a node of identity id belongs to: its profile's
// (base), or its own if a split of that key moved it.
func (c *keyCache) keyOf(node *core.Node, id *auth.Identity) (key, base aggkey.Key) {
	base = aggkey.WithIdentity(c.cfg.Keys.Profile.Key(node), id)
	for _, s := range c.splits.active(base) {
		if s.Matches(node) {
			return aggkey.WithIdentity(aggkey.SplitKey(node), id), base
		}
	}
	return base, base
}

// learnSplits adds splits of key that another relay told; the members of
// key here look again at where they belong.
func (c *keyCache) learnSplits(key aggkey.Key, splits []aggkey.Split) {
	fresh := c.splits.add(key, splits...)
	if len(fresh) == 0 {
		return
	}
	for _, s := range fresh {
		if s.Merged {
			c.log.Info("key split merged back, told by another relay of the tier", "key", key, "split", s.String())
		} else {
			c.log.Info("key split, told by another relay of the tier", "key", key, "split", s.String())
		}
	}
	c.splitsChanged(key, fresh)
}

// splitsChanged tells those it concerns that changed, records of key's
// splits, changed: the ledger; the streams of key (a split moves some);
// and, for a split merged back, the keys of nodes of their own it had
// moved them to here, whose streams return to key and which nobody comes
// back to (their feeds drop them once they have no member).
func (c *keyCache) splitsChanged(key aggkey.Key, changed []aggkey.Split) {
	c.reportSplits(key)
	c.wakeKey(key)
	for _, s := range changed {
		if !s.Merged {
			continue
		}
		for _, k := range c.heldKeys() {
			n := k.presentedNode.Load()
			if k.key == key || n == nil || !s.Matches(n) || !aggkey.IsSplitKeyOf(k.key, n) {
				continue
			}
			k.abandoned.Store(true)
			k.wakeStreams()
			wake(k.upWake)
		}
	}
}

// nobodyComesBack reports whether k, once it has no member, will get none
// back, so that it need not idle (Keys.IdleTimeout) with its upstream stream
// open: its split was merged back here (abandoned), or it is the key of a
// node of its own that no split known here moves (another relay asked for
// it, and left). A split key at its owner whose asking relay left cost
// the key a second upstream stream for the whole idle time (issue 28's
// simulation, seed 1137 under -race).
func (c *keyCache) nobodyComesBack(k *keyState) bool {
	if k.abandoned.Load() {
		return true
	}
	n := k.presentedNode.Load()
	if n == nil || !aggkey.IsSplitKeyOf(k.key, n) {
		return false
	}
	c.splits.mu.Lock()
	defer c.splits.mu.Unlock()
	for _, splits := range c.splits.m {
		for _, s := range aggkey.Active(splits) {
			if s.Matches(n) {
				return false
			}
		}
	}
	return true
}

// KeySplit is one split of a key the relay knows, for reports.
type KeySplit struct {
	Key aggkey.Key
	// Split says what moved: the fields compared, and the diverging
	// node's id.
	Split string
}

// splitList returns the splits the relay knows, by key, in key order.
func (c *keyCache) splitList() []KeySplit {
	c.splits.mu.Lock()
	defer c.splits.mu.Unlock()
	var out []KeySplit
	for _, k := range slices.Sorted(maps.Keys(c.splits.m)) {
		for _, s := range aggkey.Active(c.splits.m[k]) {
			out = append(out, KeySplit{Key: k, Split: s.String()})
		}
	}
	return out
}

// reportSplits tells the ledger key's splits (the admin API shows them).
func (c *keyCache) reportSplits(key aggkey.Key) {
	all := c.splits.of(key)
	if len(all) == 0 {
		return
	}
	splits := aggkey.Active(all)
	desc := make([]string, len(splits))
	for i, s := range splits {
		desc[i] = s.String()
	}
	c.ledger.SetSplits(string(key), desc)
}

// wakeKey wakes the members of key, if the relay holds it.
func (c *keyCache) wakeKey(key aggkey.Key) {
	c.mu.Lock()
	k := c.keys[key]
	c.mu.Unlock()
	if k != nil {
		k.wakeStreams()
	}
}
