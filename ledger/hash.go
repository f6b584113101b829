// Package ledger owns meshrelay's content versions: the Merkle trees whose
// roots are the versions the relay hands to Envoys, and (in later work) the
// record of which Envoy has ACKed which version.
//
// A version is never a counter. It is the Merkle root of the (name,
// content-hash) pairs of a view, so every relay that holds the same content
// computes the same version, whether it has run for a week or just started.
//
// The package is pure Go with no heavy dependencies, so its tests are fast.
package ledger

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
)

// Hash is a SHA-256 digest: the content hash of a resource, or the root of a
// Tree. The zero Hash means "no content".
type Hash [sha256.Size]byte

// HashBytes returns the content hash of b.
func HashBytes(b []byte) Hash { return sha256.Sum256(b) }

// String renders h as lower-case hex; this is the form used on the wire as an
// xDS version string.
func (h Hash) String() string { return hex.EncodeToString(h[:]) }

// IsZero reports whether h is the zero Hash.
func (h Hash) IsZero() bool { return h == Hash{} }

// HashFromBytes returns the Hash whose bytes are b (32 of them).
func HashFromBytes(b []byte) (Hash, error) {
	var h Hash
	if len(b) != len(h) {
		return Hash{}, fmt.Errorf("%w: %d bytes", ErrBadHash, len(b))
	}
	copy(h[:], b)
	return h, nil
}

// ErrBadHash is returned by ParseHash for anything that is not 64 hex digits.
var ErrBadHash = errors.New("ledger: not a content version")

// ParseHash parses the String form of a Hash. Clients send versions back to
// the relay (Delta initial_resource_versions, SotW version_info), so the input
// is untrusted: anything malformed is ErrBadHash, never a panic.
func ParseHash(s string) (Hash, error) {
	var h Hash
	if len(s) != 2*len(h) {
		return Hash{}, fmt.Errorf("%w: %d characters", ErrBadHash, len(s))
	}
	if _, err := hex.Decode(h[:], []byte(s)); err != nil {
		return Hash{}, fmt.Errorf("%w: %v", ErrBadHash, err)
	}
	return h, nil
}
