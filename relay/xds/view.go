package xds

import "github.com/meshrelay/meshrelay/ledger"

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
// hash to. A restored view is of unknown age (the zero ledger.Order): it
// covers only clients that hold nothing, so it is never sent over what a
// client or another relay holds, however old, until its source has
// answered on a stream opened after that was declared.
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

// HeldVersion is a version of a type that a SotW client of a key holds, as
// a draining relay handed it over (relay.HeldVersions): every resource's
// name and content hash, and the bodies the store kept (those the key's
// view did not hold when it was handed over).
type HeldVersion struct {
	Type    string
	Root    ledger.Hash
	Entries []HeldEntry
}

// HeldEntry is one resource of a HeldVersion; Body is nil if the store did
// not keep it (the relay that reads it holds it, or the version is lost).
type HeldEntry struct {
	Name string
	Hash ledger.Hash
	Body []byte
}
