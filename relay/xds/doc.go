// Package xds is the relay's vocabulary of xDS and its content store,
// which every other part of the relay speaks and which knows nothing of
// streams, keys or relays:
//
//   - the type URLs the relay caches and serves, and the graph of which
//     type refers to which (TypeRefs), the one table that push order,
//     removal order, reference following, holds and restore all read;
//   - resources as immutable, content-addressed values (Resource), decoded
//     from untrusted bytes and interned by a Store, so each distinct
//     resource is held once however many keys and streams hold it, and
//     Dropped, which keeps the most recently dropped alive within a budget;
//   - sorted sets of subscribed names (NameSet) and the memo of the names
//     a tree's resources refer to (RefIndex);
//   - a key's view of one type as the relay persists it and finds it again
//     at a warm start (View, SavedKey).
package xds
