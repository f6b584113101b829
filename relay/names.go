package relay

import (
	"hash/maphash"
	"slices"
	"strings"
	"unique"
)

// wildcardName is the explicit wildcard subscription of the xDS protocol.
const wildcardName = "*"

// nameSet is a sorted set of resource names. A sorted slice costs 16 bytes a
// name (the strings themselves are shared with the requests or the views),
// far less than a map, which matters with thousands of streams each
// subscribed to thousands of EDS names.
type nameSet []string

// newNameSet builds a set from an unsorted list, dropping duplicates and the
// wildcard name.
func newNameSet(names []string) nameSet {
	s := make(nameSet, 0, len(names))
	for _, n := range names {
		if n != wildcardName {
			s = append(s, n)
		}
	}
	slices.Sort(s)
	return slices.Compact(s)
}

func (s nameSet) has(name string) bool {
	_, ok := slices.BinarySearch(s, name)
	return ok
}

// diff returns the names in t and not in s (added) and in s and not in t
// (removed), walking both sorted sets once.
func (s nameSet) diff(t nameSet) (added, removed []string) {
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

// with returns s plus added minus removed, as a new set.
func (s nameSet) with(added, removed []string) nameSet {
	if len(added) == 0 && len(removed) == 0 {
		return s
	}
	drop := newNameSet(removed)
	out := make(nameSet, 0, len(s)+len(added))
	for _, n := range s {
		if !drop.has(n) {
			out = append(out, n)
		}
	}
	out = append(out, added...)
	return newNameSet(out)
}

func (s nameSet) String() string { return "[" + strings.Join(s, " ") + "]" }

// interned returns s with every name replaced by its canonical copy, so that
// thousands of streams subscribed to the same names hold each string once.
func (s nameSet) interned() nameSet {
	for i, n := range s {
		s[i] = unique.Make(n).Value()
	}
	return s
}

var listSeed = maphash.MakeSeed()

// listDigest is an order-independent digest of a list of names and its
// length. A SotW client repeats its whole subscription in every request,
// ACKs included; comparing digests tells, without sorting thousands of
// names, that nothing changed.
func listDigest(names []string) uint64 {
	sum := uint64(len(names))
	for _, n := range names {
		sum += maphash.String(listSeed, n)
	}
	return sum
}
