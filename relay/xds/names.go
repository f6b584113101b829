package xds

import (
	"hash/maphash"
	"runtime"
	"slices"
	"strings"
	"sync"
	"unique"
	"unsafe"
	"weak"
)

// WildcardName is the explicit wildcard subscription of the xDS protocol.
const WildcardName = "*"

// NameSet is a sorted set of resource names. A sorted slice costs 16 bytes a
// name (the strings themselves are shared with the requests or the views),
// far less than a map, which matters with thousands of streams each
// subscribed to thousands of EDS names.
type NameSet []string

// NewNameSet builds a set from an unsorted list, dropping duplicates and the
// wildcard name.
func NewNameSet(names []string) NameSet {
	s := make(NameSet, 0, len(names))
	for _, n := range names {
		if n != WildcardName {
			s = append(s, n)
		}
	}
	slices.Sort(s)
	return slices.Compact(s)
}

func (s NameSet) Has(name string) bool {
	_, ok := slices.BinarySearch(s, name)
	return ok
}

// Diff returns the names in t and not in s (added) and in s and not in t
// (removed), walking both sorted sets once.
func (s NameSet) Diff(t NameSet) (added, removed []string) {
	i, j := 0, 0
	for i < len(s) || j < len(t) {
		switch {
		case j == len(t) || (i < len(s) && s[i] < t[j]):
			removed = append(removed, s[i])
			i++
		case i == len(s) || t[j] < s[i]:
			added = append(added, t[j])
			j++
		default:
			i++
			j++
		}
	}
	return added, removed
}

// With returns s less removed, plus added (a name in both stays), as a
// new set (s itself if both are empty). It sorts only added and removed,
// and merges.
func (s NameSet) With(added, removed []string) NameSet {
	if len(added) == 0 && len(removed) == 0 {
		return s
	}
	return s.without(NewNameSet(removed)).merge(NewNameSet(added))
}

// without returns the names of s not in drop, as a new set.
func (s NameSet) without(drop NameSet) NameSet {
	out := make(NameSet, 0, len(s))
	k := 0
	for _, n := range s {
		for k < len(drop) && drop[k] < n {
			k++
		}
		if k == len(drop) || drop[k] != n {
			out = append(out, n)
		}
	}
	return out
}

// Union returns the names in s or in t: s itself when t adds none (the
// common case of a key's EDS names, which its clusters name too), else a
// new set. It walks both sorted sets once.
func (s NameSet) Union(t NameSet) NameSet {
	i, j := 0, 0
	for i < len(s) && j < len(t) {
		switch {
		case s[i] < t[j]:
			i++
		case s[i] == t[j]:
			i, j = i+1, j+1
		default:
			return s.merge(t)
		}
	}
	if j < len(t) {
		return s.merge(t)
	}
	return s
}

// merge returns the union of s and t as a new set.
func (s NameSet) merge(t NameSet) NameSet {
	out := make(NameSet, 0, len(s)+len(t))
	i, j := 0, 0
	for i < len(s) || j < len(t) {
		switch {
		case j == len(t) || (i < len(s) && s[i] < t[j]):
			out, i = append(out, s[i]), i+1
		case i == len(s) || t[j] < s[i]:
			out, j = append(out, t[j]), j+1
		default:
			out, i, j = append(out, s[i]), i+1, j+1
		}
	}
	return out
}

func (s NameSet) String() string { return "[" + strings.Join(s, " ") + "]" }

// Interned returns s with every name replaced by its canonical copy, so that
// thousands of streams subscribed to the same names hold each string once.
func (s NameSet) Interned() NameSet {
	for i, n := range s {
		s[i] = unique.Make(n).Value()
	}
	return s
}

// NameSets shares equal name sets: the Envoys of a key subscribe to the
// same thousand EDS names, and each stream held its own copy (16 bytes a
// name). Intern returns the set held for s's content if some holder still
// holds it, else s, which it holds from then on. Sets are held weakly:
// one nobody holds is collected, and its entry with it. Interned sets are
// shared: nobody may change one. Safe for concurrent use; the zero value
// is ready.
type NameSets struct {
	mu sync.Mutex
	m  map[uint64][]internedSet // by setDigest
}

type internedSet struct {
	first weak.Pointer[string] // the set's backing array, by its first name
	n     int
}

// Intern returns the held set equal to s, or s (its names made canonical
// strings, NameSet.Interned), now held.
func (ns *NameSets) Intern(s NameSet) NameSet {
	if len(s) == 0 {
		return s
	}
	d := setDigest(s)
	if held, ok := ns.lookup(d, s); ok {
		return held
	}
	s = s.Interned() // outside the lock: a string each
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if held, ok := ns.lookupLocked(d, s); ok {
		return held // interned meanwhile
	}
	if ns.m == nil {
		ns.m = make(map[uint64][]internedSet)
	}
	wp := weak.Make(&s[0])
	ns.m[d] = append(ns.m[d], internedSet{first: wp, n: len(s)})
	runtime.AddCleanup(&s[0], func(d uint64) {
		ns.mu.Lock()
		defer ns.mu.Unlock()
		es := slices.DeleteFunc(ns.m[d], func(e internedSet) bool { return e.first == wp })
		if len(es) == 0 {
			delete(ns.m, d)
		} else {
			ns.m[d] = es
		}
	}, d)
	return s
}

func (ns *NameSets) lookup(d uint64, s NameSet) (NameSet, bool) {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	return ns.lookupLocked(d, s)
}

// lookupLocked finds the held set equal to s among those of digest d.
// The caller holds ns.mu.
func (ns *NameSets) lookupLocked(d uint64, s NameSet) (NameSet, bool) {
	for _, e := range ns.m[d] {
		if p := e.first.Value(); p != nil {
			if held := NameSet(unsafe.Slice(p, e.n)); slices.Equal(held, s) {
				return held, true
			}
		}
	}
	return nil, false
}

// Len returns the number of distinct sets held.
func (ns *NameSets) Len() int {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	n := 0
	for _, es := range ns.m {
		for _, e := range es {
			if e.first.Value() != nil {
				n++
			}
		}
	}
	return n
}

var setSeed = maphash.MakeSeed()

// setDigest hashes a sorted set.
func setDigest(s NameSet) uint64 {
	var h maphash.Hash
	h.SetSeed(setSeed)
	for _, n := range s {
		h.WriteString(n)
		h.WriteByte(0)
	}
	return h.Sum64()
}

// SotWResourceNames is a SotW request's resource_names for a subscription
// to names, and to every resource if wildcard: a wildcard with no names is
// the legacy empty list, the form every server understands, but only while
// the stream never named a resource of the type (named); after, the list
// must say "*".
func SotWResourceNames(wildcard bool, names []string, named bool) []string {
	if wildcard && (len(names) > 0 || named) {
		return append([]string{WildcardName}, names...)
	}
	return names
}
