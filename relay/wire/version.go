package wire

import (
	"strings"

	"github.com/meshrelay/meshrelay/ledger"
)

// Versions on the wire are a content hash and the Order of the view it was
// sent from, "<hash>@<session>/<at>": a Delta resource's version (its
// content hash) and system_version_info (the view's root), a SotW
// version_info (the root of what the client holds). The hash says what the
// client holds, the Order how new it is (ledger.Order), and both come back
// when the client reconnects, to this relay or another.

// Version renders the wire version of content h sent from a view of
// Order o.
func Version(h ledger.Hash, o ledger.Order) string {
	return h.String() + "@" + o.String()
}

// ParseVersion parses a version the relay put on the wire (a Delta
// resource's version or system_version_info, a SotW version_info): its
// content hash and Order. A bare hash (from a relay that did not order its
// versions) parses with the zero Order: unordered, covered by any view. The
// input is untrusted: anything else is an error wrapping ledger.ErrBadHash
// or ledger.ErrBadOrder.
func ParseVersion(v string) (ledger.Hash, ledger.Order, error) {
	hash, order, ordered := strings.Cut(v, "@")
	h, err := ledger.ParseHash(hash)
	if err != nil {
		return ledger.Hash{}, ledger.Order{}, err
	}
	if !ordered {
		return h, ledger.Order{}, nil
	}
	o, err := ledger.ParseOrder(order)
	if err != nil {
		return ledger.Hash{}, ledger.Order{}, err
	}
	return h, o, nil
}
