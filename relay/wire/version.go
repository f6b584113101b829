package wire

import (
	"strings"
	"sync"

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

// staleMark follows the system_version_info of a response to another relay
// whose view no live upstream stream has confirmed (the owner's upstream is
// down, or it restored the view and its source has not answered yet): the
// relay it feeds is stale too. Envoys never see it.
const staleMark = ";stale"

// MarkStale returns v marked as from a stale view.
func MarkStale(v string) string { return v + staleMark }

// CutStale returns v without its stale mark, and whether it had one.
func CutStale(v string) (string, bool) { return strings.CutSuffix(v, staleMark) }

// ParseVersion parses a version the relay put on the wire (a Delta
// resource's version or system_version_info, a SotW version_info): its
// content hash and Order. A bare hash (from a relay that did not order its
// versions) parses with the zero Order: of unknown age (the relay bounds it
// by when it is declared: ledger.Bound). The
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

// Versions renders versions (Version) once per distinct content and Order:
// every stream of a key sent the same view puts the same string on the
// wire and keeps it in its status, so they share one. Bounded: cleared
// when full (the working set is the few views in flight). Safe for
// concurrent use; the zero value is ready.
type Versions struct {
	mu sync.Mutex
	m  map[versionKey]string
}

type versionKey struct {
	h ledger.Hash
	o ledger.Order
}

// maxVersions bounds a Versions cache.
const maxVersions = 4096

// Of returns Version(h, o).
func (v *Versions) Of(h ledger.Hash, o ledger.Order) string {
	k := versionKey{h, o}
	v.mu.Lock()
	s, ok := v.m[k]
	v.mu.Unlock()
	if ok {
		return s
	}
	s = Version(h, o)
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.m == nil || len(v.m) >= maxVersions {
		v.m = make(map[versionKey]string)
	}
	v.m[k] = s
	return s
}
