package relay

import (
	"strings"

	"github.com/meshrelay/meshrelay/ledger"
)

// Versions on the wire are a content hash and the Stamp of the view it was
// sent from, "<hash>@<stamp>": a Delta resource's version (its content hash)
// and system_version_info (the view's root), a SotW version_info (the root
// of what the client holds). The hash says what the client holds, the Stamp
// how new it is (ledger.Stamp), and both come back when the client
// reconnects, to this relay or another.

// stampedVersion renders the wire version of content h sent from a view
// stamped s.
func stampedVersion(h ledger.Hash, s ledger.Stamp) string {
	return h.String() + "@" + s.String()
}

// ParseVersion parses a version the relay put on the wire (a Delta
// resource's version or system_version_info, a SotW version_info): its
// content hash and Stamp. A bare hash (from a relay that did not stamp)
// parses with the zero Stamp: unordered, older than any view. The input is
// untrusted: anything else is an error wrapping ledger.ErrBadHash or
// ledger.ErrBadStamp.
func ParseVersion(v string) (ledger.Hash, ledger.Stamp, error) {
	hash, stamp, stamped := strings.Cut(v, "@")
	h, err := ledger.ParseHash(hash)
	if err != nil {
		return ledger.Hash{}, 0, err
	}
	if !stamped {
		return h, 0, nil
	}
	s, err := ledger.ParseStamp(stamp)
	if err != nil {
		return ledger.Hash{}, 0, err
	}
	return h, s, nil
}

// observe moves the relay's clock past a Stamp learned from the tier (a
// peer relay, a snapshot): what this relay stamps from now on orders after
// it. A Stamp too far ahead of the wall clock is refused and logged: the
// relay it came from has a clock that is off.
func (r *Relay) observe(s ledger.Stamp, from, who string) {
	if s == 0 {
		return
	}
	if err := r.clock.Observe(s); err != nil {
		r.log.Warn("version stamp not observed", "from", from, "who", who, "err", err)
	}
}
