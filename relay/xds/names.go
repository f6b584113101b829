package xds

import (
	"slices"
	"strings"
	"unique"
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

// With returns s plus added minus removed, as a new set.
func (s NameSet) With(added, removed []string) NameSet {
	if len(added) == 0 && len(removed) == 0 {
		return s
	}
	drop := NewNameSet(removed)
	out := make(NameSet, 0, len(s)+len(added))
	for _, n := range s {
		if !drop.Has(n) {
			out = append(out, n)
		}
	}
	out = append(out, added...)
	return NewNameSet(out)
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
