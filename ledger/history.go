package ledger

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// HistoryConfig bounds a History. Every bound is applied when a version is
// recorded; the current version is never expired.
type HistoryConfig struct {
	// MaxVersions is how many versions are kept, the current one included.
	// Default 1000.
	MaxVersions int
	// MaxAge expires versions received longer ago than this. Default 1 h.
	MaxAge time.Duration
	// MaxChanges bounds the name changes held to go back through the kept
	// versions (about 50 bytes each, plus about 100 per version): it bounds
	// memory when versions change many names at once. Default 10,000: a
	// History holds at most about 0.6 MB, and 1,000 versions of one change
	// each (an endpoint moving) about 150 KB.
	MaxChanges int
}

// DefaultHistoryConfig returns the defaults.
func DefaultHistoryConfig() HistoryConfig {
	return HistoryConfig{MaxVersions: 1000, MaxAge: time.Hour, MaxChanges: 10_000}
}

// Validate reports the first field out of range.
func (c HistoryConfig) Validate() error {
	switch {
	case c.MaxVersions < 1:
		return fmt.Errorf("ledger: MaxVersions %d, want ≥ 1", c.MaxVersions)
	case c.MaxAge <= 0:
		return fmt.Errorf("ledger: MaxAge %v, want > 0", c.MaxAge)
	case c.MaxChanges < 1:
		return fmt.Errorf("ledger: MaxChanges %d, want ≥ 1", c.MaxChanges)
	}
	return nil
}

// Version is one recorded version of a view.
type Version struct {
	// Seq numbers the versions of one History, from 1, in the order they
	// were recorded.
	Seq uint64
	// Root is the view's Merkle root: the version itself.
	Root Hash
	// Received is when the view was received from its source.
	Received time.Time
	// Order says how new the version is (see Order): the latest its source
	// gave this content. Zero if of unknown age.
	Order Order
	// Len is the number of resources in the view.
	Len int
}

// History is the bounded record of the versions of one view (one key, one
// type) over time, with what each held.
//
// It keeps the current Tree (which it shares with whoever built it) and, for
// each older version, only the names that differ from the next one with
// their older hashes ("undo" records). An older tree is rebuilt on demand
// by applying the undo records from the current one back: memory grows with
// the changes, not with versions × resources, and rebuilding costs time in
// proportion to the changes between the two versions. (DESIGN suggests
// keeping interior nodes at some heights instead; with persistent trees
// sharing every unchanged subtree, the undo records are the smaller of the
// two and need no recomputation for the current version, which is the one
// almost every query asks about.) A rebuilt tree's root is checked against
// the recorded one, so a query can never answer from a wrong history.
//
// History is safe for concurrent use.
type History[V any] struct {
	cfg HistoryConfig

	mu       sync.Mutex
	cur      Tree[V]
	versions []histVersion // oldest first; the last is cur
	// log holds the undo records of every kept version, oldest first, in
	// one array (not one per version: fewer objects for the collector);
	// logBase is the position of log[0] since the History began.
	log     []undoEntry
	logBase int
	seq     uint64
}

// histVersion is a kept Version without pointers (the time as Unix
// nanoseconds): the collector skips the array of them.
type histVersion struct {
	seq      uint64
	root     Hash
	received int64
	order    Order
	len      int
	// log[undoFrom-logBase : undoTo-logBase] lists, by name, what this
	// version held of the names the next version changed (a zero Hash:
	// absent). The current version has none. Entries are never changed
	// once written, so slices of them stay valid without the lock.
	undoFrom, undoTo int
}

func (v *histVersion) version() Version {
	return Version{Seq: v.seq, Root: v.root, Received: time.Unix(0, v.received), Order: v.order, Len: v.len}
}

func (h *History[V]) undoOf(v *histVersion) []undoEntry {
	return h.log[v.undoFrom-h.logBase : v.undoTo-h.logBase : v.undoTo-h.logBase]
}

type undoEntry struct {
	name string
	hash Hash
}

// ErrUnknownVersion is returned for a root the History does not hold (never
// recorded, or expired).
var ErrUnknownVersion = errors.New("ledger: version not in history")

// NewHistory returns an empty History.
func NewHistory[V any](cfg HistoryConfig) (*History[V], error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &History[V]{cfg: cfg}, nil
}

// Record makes t the current version, received at at with Order order from
// its source, and reports whether it is a new version (a tree with the
// current root is not recorded again: its Order moves on). Its cost follows
// the difference from the current version.
func (h *History[V]) Record(t Tree[V], at time.Time, order Order) (Version, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if n := len(h.versions); n > 0 && h.versions[n-1].root == t.Root() {
		h.cur = t // the same content; keep the newest tree, which callers share
		if !order.IsZero() {
			h.versions[n-1].order = order
		}
		return h.versions[n-1].version(), false
	}
	end := h.logBase + len(h.log)
	if n := len(h.versions); n > 0 {
		from := len(h.log)
		Diff(h.cur, t, func(c Change[V]) bool {
			e := undoEntry{name: c.Name}
			if c.Old != nil {
				e.hash = c.Old.Hash
			}
			h.log = append(h.log, e)
			return true
		})
		slices.SortFunc(h.log[from:], func(a, b undoEntry) int { return strings.Compare(a.name, b.name) })
		end = h.logBase + len(h.log)
		h.versions[n-1].undoTo = end
	}
	h.seq++
	hv := histVersion{seq: h.seq, root: t.Root(), received: at.UnixNano(), order: order, len: t.Len(), undoFrom: end, undoTo: end}
	h.cur = t
	h.versions = append(h.versions, hv)
	v := hv.version()
	h.expire(at)
	return v, true
}

// expire drops the oldest versions beyond the bounds. The caller holds mu.
func (h *History[V]) expire(now time.Time) {
	drop := 0
	changes := len(h.log)
	for n := len(h.versions); n-drop > 1; drop++ {
		old := &h.versions[drop]
		if n-drop <= h.cfg.MaxVersions && changes <= h.cfg.MaxChanges && now.UnixNano()-old.received <= int64(h.cfg.MaxAge) {
			break
		}
		changes -= old.undoTo - old.undoFrom
	}
	if drop == 0 {
		return
	}
	clear(h.versions[:drop])
	h.versions = h.versions[drop:]
	if cap(h.versions) > 2*len(h.versions)+16 {
		h.versions = slices.Clone(h.versions)
	}
	// The dropped records are not cleared: a rebuild may still be reading
	// them. The array is copied once it is mostly dropped records.
	base := h.versions[0].undoFrom
	h.log = h.log[base-h.logBase:]
	h.logBase = base
	if cap(h.log) > 2*len(h.log)+1024 {
		h.log = slices.Clone(h.log)
	}
}

// Current returns the current version (zero Seq if none was recorded).
func (h *History[V]) Current() Version {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.versions) == 0 {
		return Version{}
	}
	return h.versions[len(h.versions)-1].version()
}

// Versions returns the kept versions, oldest first.
func (h *History[V]) Versions() []Version {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]Version, len(h.versions))
	for i, v := range h.versions {
		out[i] = v.version()
	}
	return out
}

// Lookup returns the latest kept version whose root is root.
func (h *History[V]) Lookup(root Hash) (Version, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if i := h.indexLocked(root); i >= 0 {
		return h.versions[i].version(), true
	}
	return Version{}, false
}

func (h *History[V]) indexLocked(root Hash) int {
	for i := len(h.versions) - 1; i >= 0; i-- {
		if h.versions[i].root == root {
			return i
		}
	}
	return -1
}

// Held returns how many versions and undo entries the History holds: what
// its memory grows with.
func (h *History[V]) Held() (versions, changes int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.versions), len(h.log)
}

// TreeAt rebuilds the tree of the kept version whose root is root. The
// values of entries rebuilt from undo records are zero: only names and
// hashes are history.
func (h *History[V]) TreeAt(root Hash) (Tree[V], error) {
	h.mu.Lock()
	i := h.indexLocked(root)
	if i < 0 {
		h.mu.Unlock()
		return Tree[V]{}, fmt.Errorf("%w: %s", ErrUnknownVersion, root)
	}
	cur := h.cur
	// The undo records are never changed once written; copy their headers.
	undo := make([][]undoEntry, 0, len(h.versions)-1-i)
	for j := len(h.versions) - 2; j >= i; j-- {
		undo = append(undo, h.undoOf(&h.versions[j]))
	}
	h.mu.Unlock()
	if len(undo) == 0 {
		return cur, nil
	}
	b := cur.Edit()
	for _, u := range undo {
		applyUndo(b, u)
	}
	t := b.Tree()
	if t.Root() != root {
		return Tree[V]{}, fmt.Errorf("ledger: history rebuilt %s, want %s", t.Root(), root)
	}
	return t, nil
}

// Back calls fn with the kept versions and their trees, newest first, at
// most max of them, until fn returns false. Each tree is rebuilt from the
// one after it (the values of rebuilt entries are zero), so a walk back
// costs the changes it goes through, not one rebuild per version.
func (h *History[V]) Back(max int, fn func(Version, Tree[V]) bool) {
	h.mu.Lock()
	n := min(max, len(h.versions))
	versions := make([]Version, n)
	undo := make([][]undoEntry, n) // undo[k] leads from tree k-1 to tree k
	for k := range n {
		v := &h.versions[len(h.versions)-1-k]
		versions[k] = v.version()
		if k > 0 {
			undo[k] = h.undoOf(v)
		}
	}
	t := h.cur
	h.mu.Unlock()
	for k := range n {
		if k > 0 {
			b := t.Edit()
			applyUndo(b, undo[k])
			t = b.Tree()
		}
		if !fn(versions[k], t) {
			return
		}
	}
}

// applyUndo takes b back over one version's undo records.
func applyUndo[V any](b *Builder[V], u []undoEntry) {
	var zero V
	for _, e := range u {
		if e.hash.IsZero() {
			b.Delete(e.name)
		} else {
			b.Set(e.name, e.hash, zero)
		}
	}
}

// Prove returns the Proof of what the version whose root is root held of
// name.
func (h *History[V]) Prove(root Hash, name string) (Proof, error) {
	t, err := h.TreeAt(root)
	if err != nil {
		return Proof{}, err
	}
	return t.Prove(name), nil
}

// FirstWith returns the Seq of the version that last brought name to hash:
// the first of the latest run of kept versions holding name at hash. A view
// at that version or a later one has received that change or a later one
// (if it holds name at all). It walks back only through that run.
func (h *History[V]) FirstWith(name string, hash Hash) (uint64, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	cur, ok := h.cur.Get(name)
	var at Hash // name's hash at version i, walking back
	if ok {
		at = cur.Hash
	}
	var first uint64
	for i := len(h.versions) - 1; i >= 0; i-- {
		v := &h.versions[i]
		if i < len(h.versions)-1 {
			undo := h.undoOf(v)
			if j, found := slices.BinarySearchFunc(undo, name, func(e undoEntry, n string) int { return strings.Compare(e.name, n) }); found {
				at = undo[j].hash
			}
		}
		if at == hash && !hash.IsZero() {
			first = v.seq
		} else if first != 0 {
			break // the run ended
		}
	}
	return first, first != 0
}
